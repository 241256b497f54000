"""Bytes of each KV dtype: the page layout contract."""
from __future__ import annotations

from dataclasses import dataclass
from engine.ledger.common import _ceil_div


@dataclass(frozen=True)
class KVLayout:
    """Bytes of one KV dtype. ``*_group``: elements sharing a scale along head_dim; 0 = one scale per token per head,
    None = floating point (no scale)."""

    name: str
    k_bits: int
    v_bits: int
    k_group: int | None
    v_group: int | None
    scale_bytes: int = 2
    rotated_k: bool = False
    planning_only: bool = False

    def _part(self, bits: int, group: int | None, head_dim: int) -> int:
        values = _ceil_div(head_dim * bits, 8)
        if group is None:
            return values
        if group:  # the largest even divisor of D up to the group (engine.kv.quant.group_size); 32 for D = 64, 256
            group = max((g for g in range(2, min(group, head_dim) + 1, 2) if head_dim % g == 0), default=head_dim)
        groups = 1 if group == 0 else head_dim // group
        return values + groups * self.scale_bytes

    def bytes_per_head(self, head_dim: int) -> int:
        """K plus V bytes of one token in one KV head."""
        return self._part(self.k_bits, self.k_group, head_dim) + self._part(self.v_bits, self.v_group, head_dim)

    def bytes_per_token(self, layers: int, kv_heads: int, head_dim: int) -> int:
        return layers * kv_heads * self.bytes_per_head(head_dim)


KV_LAYOUTS: dict[str, KVLayout] = {
    "fp32": KVLayout("fp32", 32, 32, None, None),
    "fp16": KVLayout("fp16", 16, 16, None, None),
    "bf16": KVLayout("bf16", 16, 16, None, None),
    "k8v8": KVLayout("k8v8", 8, 8, 0, 0),
    "k8v4": KVLayout("k8v4", 8, 4, 0, 32),
    "k4v4": KVLayout("k4v4", 4, 4, 32, 32),
    "rk4v4": KVLayout("rk4v4", 4, 4, 32, 32, rotated_k=True),
    "k4v4-e8": KVLayout("k4v4-e8", 4, 4, 32, 32, scale_bytes=1, planning_only=True),
    "rk4v4-e8": KVLayout("rk4v4-e8", 4, 4, 32, 32, scale_bytes=1, rotated_k=True, planning_only=True),
}
KV_DTYPES = ("auto", *KV_LAYOUTS)


def resolve_kv_dtype(name: str, on_gpu: bool) -> str:
    """``auto`` is what engine.build.pick_dtype picks: bf16 on a GPU, fp32 on the CPU."""
    if name == "auto":
        return "bf16" if on_gpu else "fp32"
    if name not in KV_LAYOUTS:
        raise ValueError(f"unknown KV dtype {name!r}; one of {', '.join(KV_DTYPES)}")
    return name
