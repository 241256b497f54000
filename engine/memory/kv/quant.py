"""KV-cache number formats: what each `kv_dtype` stores per token and head, and the PyTorch reference quantizers.

This is the definition the Triton paged-attention kernels must match (see docs/KV.md).

| kv_dtype | K per (token, kv head)                         | V per (token, kv head)                      |
| -------- | ---------------------------------------------- | ------------------------------------------- |
| fp32/fp16/bf16 | D floats                                 | D floats                                    |
| k8v8     | int8 [D] + one fp16 scale                      | int8 [D] + one fp16 scale                   |
| k8v4     | int8 [D] + one fp16 scale                      | uint8 [D/2] (int4 x 2) + fp16 scale per group |
| k4v4     | uint8 [D/2] + fp16 scale per group             | uint8 [D/2] + fp16 scale per group          |
| rk4v4    | as k4, of K times the Hadamard rotation H      | as v4 (V is never rotated)                  |

Byte layout: the one engine/memory/geometry.py states (its KV_LAYOUTS); a test keeps the byte counts equal.

Quantizing (symmetric, no zero point, round to nearest even) a group of values x (int8: the whole head, group = D;
int4: groups of `INT4_GROUP` = 32 consecutive channels along D): scale = absmax(x) / 127 for int8, q in -127..127;
absmax(x) / 7.5 for int4, q clamped to -8..7. The scale is stored as fp16 rounded *up* (never below 2^-14, the
smallest normal), and q = round(x / scale): +-absmax lands just inside +-7.5 and rounds to +-7, so no value clips,
|x - q * scale| <= scale / 2 for every element, and the int4 step is absmax / 7.5 rather than absmax / 7 (code
0 = -8 stays unused; the kernels must still decode it). Dequantizing is q * scale in float32. int4 codes are
stored as q + 8 (0..15), element 2j in the low nibble of byte j and element 2j + 1 in the high nibble (the
kernels/quant.py packing). When D is not a multiple of 32 the int4 group is the largest even divisor of D that
is at most 32.

rk (rotated keys): K is multiplied by H, the normalized (orthonormal, symmetric) Sylvester-Hadamard matrix of size D
when D is a power of two, else block-diagonal with Hadamard blocks of the largest power of two dividing D. Outlier
channels are spread over the head (or block) so a group's scale is not set by one channel. Queries are rotated by
the same H at attention time: (qH)(kH)^T = q H H^T k^T = q k^T, so the scores are unchanged in exact arithmetic.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch

FLOAT_KV_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
QUANT_KV_DTYPES = ("k8v8", "k8v4", "k4v4", "rk4v4")
KV_DTYPES = tuple(FLOAT_KV_DTYPES) + QUANT_KV_DTYPES
INT4_GROUP = 32
SCALE_DTYPE = torch.float16
_SCALE_MIN = 2.0 ** -14  # the smallest normal fp16: scales never go subnormal
_SCALE_MAX = 65504.0


@dataclass(frozen=True)
class PartFormat:
    """How one of K or V is stored: `bits` None = plain floats of `dtype`; 8 or 4 = quantized."""
    bits: int | None
    dtype: torch.dtype | None = None  # the float dtype, for bits None
    rotate: bool = False

    @property
    def quantized(self) -> bool:
        return self.bits is not None


@dataclass(frozen=True)
class KVFormat:
    name: str
    k: PartFormat
    v: PartFormat

    @property
    def quantized(self) -> bool:
        return self.k.quantized or self.v.quantized


def kv_format(kv_dtype: str | torch.dtype) -> KVFormat:
    """The format of a kv_dtype name (fp32, fp16, bf16, k8v8, k8v4, k4v4, rk4v4) or a torch float dtype."""
    if isinstance(kv_dtype, torch.dtype):
        names = {v: k for k, v in FLOAT_KV_DTYPES.items()}
        if kv_dtype not in names:
            raise ValueError(f"KV dtype {kv_dtype} is not supported; use one of {KV_DTYPES}")
        kv_dtype = names[kv_dtype]
    if kv_dtype in FLOAT_KV_DTYPES:
        part = PartFormat(None, FLOAT_KV_DTYPES[kv_dtype])
        return KVFormat(kv_dtype, part, part)
    if kv_dtype not in QUANT_KV_DTYPES:
        raise ValueError(f"unknown kv_dtype {kv_dtype!r}; known: {', '.join(KV_DTYPES)}")
    rotate = kv_dtype.startswith("r")
    kbits, vbits = int(kv_dtype[-3]), int(kv_dtype[-1])
    return KVFormat(kv_dtype, PartFormat(kbits, rotate=rotate), PartFormat(vbits))


def group_size(bits: int, head_dim: int) -> int:
    """Channels sharing one scale: the whole head for int8; 32 (or the largest even divisor of D <= 32) for int4."""
    if bits == 8:
        return head_dim
    if head_dim % 2:
        raise ValueError(f"int4 KV needs an even head_dim, got {head_dim}")
    return max(g for g in range(2, min(INT4_GROUP, head_dim) + 1, 2) if head_dim % g == 0)


def part_layout(part: PartFormat, head_dim: int) -> list[tuple[str, int, torch.dtype]]:
    """The tensors storing one part, each (name, last-dim size, dtype); the leading dims are [pages, page, heads]."""
    if not part.quantized:
        return [("data", head_dim, part.dtype)]
    g = group_size(part.bits, head_dim)
    codes = ("data", head_dim, torch.int8) if part.bits == 8 else ("data", head_dim // 2, torch.uint8)
    return [codes, ("scale", head_dim // g, SCALE_DTYPE)]


# ---------------------------------------------------------------------------------------------------- quantizing
def _scales(x: torch.Tensor, bits: int, g: int) -> torch.Tensor:
    """fp16 scales [..., D // g] for float32 x [..., D], rounded up so that no value clips."""
    amax = x.unflatten(-1, (-1, g)).abs().amax(-1)
    s = amax / (127.0 if bits == 8 else 7.5)
    # fp16 rounds to nearest within 2^-11 relative: scaling by (1 + 2^-10) first makes the stored scale >= s
    return (s * (1 + 2.0 ** -10)).clamp(_SCALE_MIN, _SCALE_MAX).to(SCALE_DTYPE)


def quantize(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] (any float dtype) -> (codes, fp16 scales [..., D // group]): int8 [..., D] for 8 bits, packed
    uint8 [..., D // 2] for 4 bits."""
    xf = x.float()
    g = group_size(bits, x.shape[-1])
    s = _scales(xf, bits, g)
    lo, hi = (-127, 127) if bits == 8 else (-8, 7)
    q = torch.round(xf.unflatten(-1, (-1, g)) / s.float().unsqueeze(-1)).clamp_(lo, hi).flatten(-2)
    if bits == 8:
        return q.to(torch.int8), s
    c = (q + 8).to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4), s


def dequantize(codes: torch.Tensor, scales: torch.Tensor, bits: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values [..., D] that (codes, scales) stand for, computed in float32 and cast to `dtype`."""
    if bits == 8:
        q = codes.float()
    else:  # unpack straight into float32 (cheaper than stacking the nibbles as integers first)
        q = torch.empty(*codes.shape, 2, dtype=torch.float32, device=codes.device)
        q[..., 0] = codes & 15
        q[..., 1] = codes >> 4
        q = q.flatten(-2).sub_(8)
    g = q.shape[-1] // scales.shape[-1]
    return q.unflatten(-1, (-1, g)).mul_(scales.float().unsqueeze(-1)).flatten(-2).to(dtype)


# ---------------------------------------------------------------------------------------------------- rotation
def hadamard_block(head_dim: int) -> int:
    """The Hadamard block size used for a head of `head_dim`: D itself when a power of two, else the largest power
    of two dividing D."""
    return head_dim & -head_dim


@lru_cache(maxsize=16)
def _hadamard(n: int, device: str) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return (h / math.sqrt(n)).float().to(device)


def hadamard(head_dim: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The full [D, D] rotation (block-diagonal when D is not a power of two): orthonormal and symmetric."""
    b = hadamard_block(head_dim)
    return torch.block_diag(*[_hadamard(b, str(device))] * (head_dim // b))


def rotate(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [..., D] times H (its own inverse), computed in float32; returned in `dtype` (default x.dtype)."""
    d = x.shape[-1]
    b = hadamard_block(d)
    h = _hadamard(b, str(x.device))
    y = (x.float().unflatten(-1, (d // b, b)) @ h).flatten(-2)
    return y.to(dtype or x.dtype)
