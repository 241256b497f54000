"""A sequence's memory across layer kinds: attention pages and recurrent state (manager.py is the entry)."""
