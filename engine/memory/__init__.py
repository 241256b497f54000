"""A sequence's memory across layer kinds: what each layer keeps (specs.py), the pools and an engine's memory built
from them (build.py), the KV cache and its pages (kv/), the recurrent state (state.py), and the one manager the
scheduler asks (manager.py)."""
