"""The settings: the table of every setting (table.py), their typed values (settings.py), loading and merging them
from flags, environment and TOML (loading.py), the engine's frozen view of them (engine_config.py) and what the KV
tier settings mean together (kv_notes.py)."""
