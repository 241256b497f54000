"""The model library: search the hub with fit marks, download, and the models on this computer."""
