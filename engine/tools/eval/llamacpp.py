"""llama.cpp as a peer to measure (``ninfer-eval kld --llama-cpp``): the same GGUF run by llama.cpp through the
llama-cpp-python package, its full-vocabulary logits at every position compared with the reference exactly as the
engine's are. The package is never a dependency of this project: where it is missing, the check says how to get
it, or how to measure llama.cpp through its server instead (``--url``, top-k logprobs)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from engine.errors import NInferError

INSTALL = ("Install it with `pip install llama-cpp-python==0.3.36` (it compiles llama.cpp from source: many minutes "
           "on a small CPU; docs/BENCHMARKS.md gives a portable build command), or run llama.cpp's server on the same file (`llama-server -m MODEL.gguf --port 8081`) and "
           "measure it with `ninfer-eval kld MODEL.gguf --url http://127.0.0.1:8081` (a lower bound from top-k "
           "logprobs).")


class LlamaCppTarget:
    """llama.cpp on ``model_path`` with a context of ``ctx`` tokens, every position's logits kept."""

    def __init__(self, model_path: Path, ctx: int, threads: int = 0):
        try:
            import llama_cpp
        except ImportError:
            raise NInferError("--llama-cpp needs the llama-cpp-python package, which is not installed.",
                              INSTALL) from None
        self.version = getattr(llama_cpp, "__version__", "unknown")
        self.path = Path(model_path)
        try:
            self.llm = llama_cpp.Llama(model_path=str(self.path), n_ctx=ctx, logits_all=True, verbose=False,
                                       **({"n_threads": threads} if threads else {}))
        except (ValueError, RuntimeError, OSError) as e:
            raise NInferError(f"llama.cpp could not load {self.path}: {e}.",
                              "Give the GGUF file itself as the model (llama.cpp reads GGUF only).") from None

    def describe(self) -> dict[str, Any]:
        return {"weights": "llama.cpp", "kv": "llama.cpp", "window": "none",
                "model": f"{self.path.name}, llama-cpp-python {self.version}", "device": "cpu"}

    def logits(self, ids: list[int]) -> torch.Tensor:
        """The logits after each of ``ids`` (float32, [len(ids), vocab])."""
        self.llm.reset()
        self.llm.eval(list(ids))
        return torch.as_tensor(self.llm.scores[:len(ids)], dtype=torch.float32).clone()

    def close(self) -> None:
        close = getattr(self.llm, "close", None)
        if close is not None:
            close()
