"""The launcher: the settings form generated from the schema, presets, live checks with remedies in the form's words,
and the memory ledger's bars."""
