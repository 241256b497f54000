"""``ninfer-bench`` (``python -m engine.tools.bench``): our engine measured on one request, beside a peer.

    cli.py                the command: options, the modes, what is printed and written to --json
    measure.py            the prompt, our engine's runs, their summary (median TTFT, tok/s, GB/s), ratios, the table
    machine.py            the machine's facts, a reference read bandwidth, other processes' CPU load
    peer_transformers.py  HF transformers on the same model (--compare transformers, the default)
    peer_llamacpp.py      llama.cpp through llama-cpp-python (--compare llama.cpp)
    api.py                the same request through the HTTP server and SSE (--via-api)
    speculative.py        speculative decoding against none on three kinds of content (--spec METHOD)
    step_profile.py       a decode step by ATen operator (--profile-steps N)

Imports run one way: cli.py imports the others, which import measure.py (or nothing of this package)."""
