"""llama.cpp as a peer for ``ninfer-bench --compare llama.cpp``: the same GGUF file, prompt token ids, greedy
decoding and thread count, through llama-cpp-python. It is measured, never used: install it only to compare
(`pip install llama-cpp-python`, which compiles llama.cpp for this machine)."""
from __future__ import annotations

import time
from pathlib import Path


def load_llamacpp(path: Path, threads: int, context: int):
    try:  # optional, and only for this comparison: imported when asked for
        from llama_cpp import Llama
    except ImportError:
        raise RuntimeError("--compare llama.cpp needs llama-cpp-python, which is not installed; run "
                           "`pip install llama-cpp-python` (it compiles llama.cpp), or use --compare transformers")
    if path.suffix.lower() != ".gguf":
        raise RuntimeError(f"--compare llama.cpp needs a GGUF file; {path.name} is not one")
    return Llama(model_path=str(path), n_ctx=context, n_threads=threads, n_threads_batch=threads, n_batch=512,
                 logits_all=False, verbose=False)


def bench_llamacpp(llm, prompt_ids: list[int], gen_tokens: int, repeat: int, summarise) -> dict:
    """TTFT = prompt evaluation plus the first token; decode = first token -> last token, greedy (temperature 0,
    no repetition penalty), never stopping early."""
    runs = []
    for i in range(repeat + 1):
        llm.reset()
        tokens, stamps = [], []
        t0 = time.perf_counter()
        for token in llm.generate(list(prompt_ids), top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0,
                                  reset=True):
            stamps.append(time.perf_counter())
            tokens.append(int(token))
            if len(tokens) == gen_tokens:
                break
        if i:
            runs.append(dict(ttft_s=stamps[0] - t0, decode_s=stamps[-1] - stamps[0], tokens=tokens))
    weight_bytes = Path(llm.model_path).stat().st_size
    return dict(summarise(runs, weight_bytes), weight_bytes=weight_bytes)
