"""The model library: find GGUF models on the Hugging Face hub, mark each file with the memory ledger (fits, fits
with a KV window, needs more memory, architecture not supported) before it is downloaded, download into the
standard hub cache with progress, cancellation and a verified sha256, and resolve ``hf:ORG/REPO[:QUANT]`` model
paths. Standard library and huggingface_hub only: no torch, no Qt. See docs/LIBRARY.md."""
