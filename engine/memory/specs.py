"""What each kind of layer keeps per sequence (the model says, per layer; the runner sizes its pools from it).

- attention: K and V for every position, in the paged KV cache (engine/kv/); windowed with KV tiers;
- recurrent: a fixed-size state per sequence (e.g. a Gated-DeltaNet layer's conv window and delta-rule matrix), in
  the state pool (engine/memory/state.py), whatever the sequence's length.

Torch-free, so that the ledger and the app can count bytes without loading the engine."""
from __future__ import annotations

import math
from dataclasses import dataclass

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class AttentionSpec:
    num_kv_heads: int
    head_dim: int
    kind: str = "attention"


@dataclass(frozen=True)
class StateTensor:
    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"  # a DTYPE_BYTES key

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class RecurrentSpec:
    tensors: tuple[StateTensor, ...]
    kind: str = "recurrent"

    @property
    def nbytes(self) -> int:
        """Bytes of one sequence's state in this layer."""
        return sum(t.nbytes for t in self.tensors)


LAYER_KINDS = ("attention", "recurrent")
