"""What each kind of layer keeps per sequence (the model says, per layer; the runner sizes its pools from it).

- attention: K and V for every position, in the paged KV cache (engine/memory/kv/); windowed with KV tiers;
- recurrent: a fixed-size state per sequence (e.g. a Gated-DeltaNet layer's conv window and delta-rule matrix), in
  the state pool (engine/memory/state.py), whatever the sequence's length.

Torch-free, so that the ledger and the app can count bytes without loading the engine."""
from __future__ import annotations

import math
from dataclasses import dataclass

from engine.memory.dtypes import float_format



@dataclass(frozen=True)
class AttentionSpec:
    num_kv_heads: int
    head_dim: int
    kind: str = "attention"


@dataclass(frozen=True)
class StateTensor:
    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"  # torch's name of a float format (engine/memory/dtypes.py)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * float_format(self.dtype).bytes


@dataclass(frozen=True)
class RecurrentSpec:
    tensors: tuple[StateTensor, ...]
    kind: str = "recurrent"

    @property
    def nbytes(self) -> int:
        """Bytes of one sequence's state in this layer."""
        return sum(t.nbytes for t in self.tensors)


def gated_delta_spec(n, activation_dtype: str, state_dtype: str) -> RecurrentSpec:
    """What a Gated-DeltaNet layer keeps per sequence (`n`: its shape, a ModelConfig's `linear` or the ledger's
    LinearAttention): the conv window of its last kernel - 1 inputs, in the activations' dtype, and the delta-rule
    state per value head, in `state_dtype` (float32, or float16 with --gdn-state-fp16). The one formula of a
    recurrent state's bytes: the layer allocates from it, the ledger plans with it."""
    return RecurrentSpec((StateTensor("conv", (n.conv_dim, n.conv_kernel - 1), activation_dtype),
                          StateTensor("ssm", (n.num_v_heads, n.head_k_dim, n.head_v_dim), state_dtype)))


LAYER_KINDS = ("attention", "recurrent")
