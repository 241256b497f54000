"""Low-bit weight formats: the `QuantizedWeight` container, packing, quantizing, dequantizing, GGUF block repacking.

Formats (weight matrix [out_features, in_features], `groups = in_features // group_size`):

| format      | qweight                          | value of element (o, i), g = i // group_size         |
| ----------- | -------------------------------- | ---------------------------------------------------- |
| `int8`      | int8  [out, in]                  | q * scales[o, g] (+ mins[o, g] where given)          |
| `int4_asym` | uint8 [out, in // 2]             | q * scales[o, g] + mins[o, g],  q in 0..15 (GGUF Q4_1)|
| `int4_sym`  | uint8 [out, in // 2]             | (q - 8) * scales[o, g],         q in 0..15 (GGUF Q4_0)|
| `ternary`   | uint8 [out, in // 4]             | (c - 1) * scales[o, g],  c in 0..2 (3 decodes to +2)  |

Packing along in_features: int4 byte j holds element 2j in its low nibble and 2j+1 in its high nibble; ternary
byte j holds element 4j+s in bits 2s..2s+1 (s = 0..3). Scales (and mins) are [out, groups] of any float dtype
(float16 for the int4/ternary formats and GGUF imports, float32 for per-channel int8); everything is computed in
float32. `dequantize` multiplies then adds in float32 exactly as gguf-py does, so GGUF imports dequantize
bit-identically to `gguf.quants.dequantize`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

FORMATS = ("int8", "int4_asym", "int4_sym", "ternary")
_PER_BYTE = {"int8": 1, "int4_asym": 2, "int4_sym": 2, "ternary": 4}


@dataclass(eq=False)
class QuantizedWeight:
    """A quantized [out_features, in_features] weight. `cache` holds derived layouts (e.g. the CPU int4 pack) keyed
    by (purpose, dtype); it is rebuilt on demand and never part of the format."""
    format: str
    qweight: torch.Tensor
    scales: torch.Tensor
    mins: Optional[torch.Tensor]
    group_size: int
    shape: tuple[int, int]
    cache: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        out_f, in_f = self.shape = (int(self.shape[0]), int(self.shape[1]))
        if self.format not in FORMATS:
            raise ValueError(f"unknown weight format {self.format!r}; known: {FORMATS}")
        per_byte = _PER_BYTE[self.format]
        if self.group_size <= 0 or in_f % self.group_size or self.group_size % per_byte:
            raise ValueError(f"group_size {self.group_size} must divide in_features {in_f} and be a multiple "
                             f"of {per_byte} for {self.format}")
        want_dtype = torch.int8 if self.format == "int8" else torch.uint8
        if self.qweight.dtype != want_dtype or tuple(self.qweight.shape) != (out_f, in_f // per_byte):
            raise ValueError(f"{self.format} qweight must be {want_dtype} [{out_f}, {in_f // per_byte}], got "
                             f"{self.qweight.dtype} {list(self.qweight.shape)}")
        groups = (out_f, in_f // self.group_size)
        if not self.scales.is_floating_point() or tuple(self.scales.shape) != groups:
            raise ValueError(f"scales must be float [{groups[0]}, {groups[1]}], got {self.scales.dtype} "
                             f"{list(self.scales.shape)}")
        if self.format == "int4_asym" and self.mins is None or self.format in ("int4_sym", "ternary") \
                and self.mins is not None:
            raise ValueError("mins are required for int4_asym, optional for int8, and not taken by the others")
        if self.mins is not None and (tuple(self.mins.shape) != groups or not self.mins.is_floating_point()):
            raise ValueError(f"mins must be float [{groups[0]}, {groups[1]}]")

    @property
    def out_features(self) -> int:
        return self.shape[0]

    @property
    def in_features(self) -> int:
        return self.shape[1]

    @property
    def num_groups(self) -> int:
        return self.shape[1] // self.group_size

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    @property
    def nbytes(self) -> int:
        """Bytes of the format itself (packed weights + scales + mins), not of the cache."""
        t = [self.qweight, self.scales] + ([self.mins] if self.mins is not None else [])
        return sum(x.numel() * x.element_size() for x in t)

    def to(self, device: torch.device | str) -> "QuantizedWeight":
        mv = lambda t: None if t is None else t.to(device)  # noqa: E731
        return QuantizedWeight(self.format, mv(self.qweight), mv(self.scales), mv(self.mins), self.group_size,
                               self.shape)


def row_slice(qw: QuantizedWeight, start: int, n: int) -> QuantizedWeight:
    """Rows start..start+n of `qw` as a weight of its own whose tensors are views of qw's (no copy)."""
    cut = lambda t: None if t is None else t[start:start + n]  # noqa: E731
    return QuantizedWeight(qw.format, cut(qw.qweight), cut(qw.scales), cut(qw.mins), qw.group_size,
                           (n, qw.in_features))


# ---------------------------------------------------------------------------------------------------- packing
def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] codes 0..15 (any integer dtype) -> uint8 [..., K // 2]: element 2j low nibble, 2j+1 high nibble."""
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K // 2] -> uint8 codes [..., K]."""
    return torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2)


def pack_ternary(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] 2-bit codes 0..3 -> uint8 [..., K // 4]: element 4j+s in bits 2s..2s+1."""
    c = codes.to(torch.uint8)
    return c[..., 0::4] | (c[..., 1::4] << 2) | (c[..., 2::4] << 4) | (c[..., 3::4] << 6)


def unpack_ternary(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K // 4] -> uint8 codes [..., K] (0..3; value = code - 1)."""
    return torch.stack([(packed >> (2 * s)) & 3 for s in range(4)], dim=-1).flatten(-2)


def codes(qw: QuantizedWeight) -> torch.Tensor:
    """The unpacked integer codes [out, in] as stored (int8 values, int4 0..15, ternary 0..3)."""
    if qw.format == "int8":
        return qw.qweight
    return unpack_int4(qw.qweight) if qw.format.startswith("int4") else unpack_ternary(qw.qweight)


# ---------------------------------------------------------------------------------------------------- quantizing
def _grouped(w: torch.Tensor, group_size: int) -> torch.Tensor:
    if w.dim() != 2:
        raise ValueError(f"expected a 2-D weight, got shape {list(w.shape)}")
    out_f, in_f = w.shape
    if group_size <= 0 or in_f % group_size:
        raise ValueError(f"group_size {group_size} must divide in_features {in_f}")
    return w.detach().float().reshape(out_f, in_f // group_size, group_size)


def _safe_inv(s: torch.Tensor) -> torch.Tensor:
    return torch.where(s == 0, torch.zeros_like(s), 1.0 / torch.where(s == 0, torch.ones_like(s), s))


def quantize_int8(w: torch.Tensor, group_size: Optional[int] = None,
                  scale_dtype: torch.dtype = torch.float32) -> QuantizedWeight:
    """Symmetric int8, round to nearest: scale = absmax / 127 per output channel (or per group of `group_size`)."""
    gs = int(w.shape[1]) if group_size is None else group_size
    g = _grouped(w, gs)
    s = (g.abs().amax(-1, keepdim=True) / 127).to(scale_dtype)
    q = torch.round(g * _safe_inv(s.float())).clamp_(-127, 127).to(torch.int8)
    return QuantizedWeight("int8", q.reshape(w.shape).contiguous(), s.squeeze(-1).contiguous(), None, gs,
                           tuple(w.shape))


def quantize_int4(w: torch.Tensor, group_size: int = 32, symmetric: bool = False,
                  scale_dtype: torch.dtype = torch.float16) -> QuantizedWeight:
    """4-bit in groups along in_features, round to nearest, the GGUF conventions:
    asymmetric (Q4_1): d = (max - min) / 15, m = min, q = round((w - m) / d) in 0..15, w ~ q*d + m;
    symmetric (Q4_0): d = (signed value of largest magnitude) / -8, q = round(w / d) + 8 in 0..15, w ~ (q-8)*d.
    q is computed with the scale as stored (rounded to `scale_dtype`)."""
    if group_size % 2:
        raise ValueError("int4 group_size must be even")
    g = _grouped(w, group_size)
    if symmetric:
        imax = g.abs().argmax(-1, keepdim=True)
        d = (torch.gather(g, -1, imax) / -8).to(scale_dtype)
        q = (torch.round(g * _safe_inv(d.float())) + 8).clamp_(0, 15)
        m = None
    else:
        lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
        d = ((hi - lo) / 15).to(scale_dtype)
        m = lo.to(scale_dtype)
        q = torch.round((g - m.float()) * _safe_inv(d.float())).clamp_(0, 15)
    packed = pack_int4(q.reshape(w.shape)).contiguous()
    return QuantizedWeight("int4_sym" if symmetric else "int4_asym", packed, d.squeeze(-1).contiguous(),
                           None if m is None else m.squeeze(-1).contiguous(), group_size, tuple(w.shape))


def quantize_ternary(w: torch.Tensor, group_size: int = 64,
                     scale_dtype: torch.dtype = torch.float16, scale: str = "mean") -> QuantizedWeight:
    """Ternary {-1, 0, +1} x per-group scale: scale = mean(|w|) per group (or, scale="absmax", the largest |w|:
    exact for weights that are already ternary, such as GGUF TQ1_0), t = round(clip(w / scale, -1, 1))."""
    if group_size % 4:
        raise ValueError("ternary group_size must be a multiple of 4")
    g = _grouped(w, group_size)
    s = (g.abs().amax(-1, keepdim=True) if scale == "absmax" else g.abs().mean(-1, keepdim=True)).to(scale_dtype)
    t = torch.round((g * _safe_inv(s.float())).clamp(-1, 1))
    packed = pack_ternary((t + 1).reshape(w.shape)).contiguous()
    return QuantizedWeight("ternary", packed, s.squeeze(-1).contiguous(), None, group_size, tuple(w.shape))


def quantize(w: torch.Tensor, fmt: str, group_size: Optional[int] = None) -> QuantizedWeight:
    """One entry point: fmt in FORMATS; group_size defaults: int8 per channel, int4 32, ternary 64."""
    if fmt == "int8":
        return quantize_int8(w, group_size)
    if fmt in ("int4_asym", "int4_sym"):
        return quantize_int4(w, group_size or 32, symmetric=fmt == "int4_sym")
    if fmt == "ternary":
        return quantize_ternary(w, group_size or 64)
    raise ValueError(f"unknown weight format {fmt!r}; known: {FORMATS}")


def dequantize(qw: QuantizedWeight, dtype: torch.dtype = torch.float32,
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The float weight [out, in] the format stands for (computed in float32, then cast to `dtype`).
    This is the PyTorch twin of the Triton `dequantize_to` kernel and the definition every quantized GEMM must meet.
    `out` (float32 [out, in]): written in place instead, with no float temporaries (the codes are copied in, then
    offset, scaled and shifted in place: the same float32 operations, so the same values)."""
    out_f, in_f = qw.shape
    shape = (out_f, qw.num_groups, qw.group_size)
    c = codes(qw)
    if out is not None:
        out.copy_(c)
        if qw.format in ("int4_sym", "ternary"):
            out.sub_(8 if qw.format == "int4_sym" else 1)
        groups = out.view(shape)
        groups.mul_(qw.scales.unsqueeze(-1))  # a float32 product, as below
        if qw.mins is not None:
            groups.add_(qw.mins.unsqueeze(-1))
        return out
    if qw.format == "int8":
        q = c.float()
    elif qw.format == "int4_sym":
        q = (c.to(torch.int8) - 8).float()
    elif qw.format == "ternary":
        q = (c.to(torch.int8) - 1).float()
    else:
        q = c.float()
    w = q.reshape(shape) * qw.scales.float().unsqueeze(-1)
    if qw.mins is not None:
        w = w + qw.mins.float().unsqueeze(-1)
    return w.reshape(out_f, in_f).to(dtype)


# ---------------------------------------------------------------------------------------------------- GGUF
_GGUF_BLOCKS = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q8_0": (32, 34), "TQ2_0": (256, 66)}


def _gguf_blocks(raw: torch.Tensor, shape: tuple[int, int], kind: str) -> torch.Tensor:
    block, nbytes = _GGUF_BLOCKS[kind]
    out_f, in_f = int(shape[0]), int(shape[1])
    if in_f % block:
        raise ValueError(f"{kind}: in_features {in_f} is not a multiple of the block size {block}")
    if raw.dtype != torch.uint8 or raw.numel() != out_f * (in_f // block) * nbytes:
        raise ValueError(f"{kind}: expected {out_f * (in_f // block) * nbytes} uint8 bytes for shape "
                         f"{[out_f, in_f]}, got {raw.dtype} x {raw.numel()}")
    return raw.contiguous().reshape(out_f, in_f // block, nbytes)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] little-endian bytes -> float16 [...]."""
    return b.contiguous().view(torch.float16).squeeze(-1)


def from_gguf_q4_1(raw_blocks: torch.Tensor, shape: tuple[int, int]) -> QuantizedWeight:
    """GGUF Q4_1 blocks (fp16 d, fp16 m, 16 bytes: element j low nibble of byte j, element j+16 high nibble),
    uint8 [rows, nblocks*20], repacked without requantizing -> int4_asym, group 32, fp16 scales/mins."""
    b = _gguf_blocks(raw_blocks, shape, "Q4_1")
    qs = b[..., 4:20]
    c = torch.cat((qs & 15, qs >> 4), dim=-1).reshape(shape[0], shape[1])
    return QuantizedWeight("int4_asym", pack_int4(c).contiguous(), _f16(b[..., 0:2]), _f16(b[..., 2:4]), 32,
                           tuple(shape))


def from_gguf_q4_0(raw_blocks: torch.Tensor, shape: tuple[int, int]) -> QuantizedWeight:
    """GGUF Q4_0 blocks (fp16 d + 16 bytes of nibbles, w = (q - 8) * d), uint8 [rows, nblocks*18] -> int4_sym."""
    b = _gguf_blocks(raw_blocks, shape, "Q4_0")
    qs = b[..., 2:18]
    c = torch.cat((qs & 15, qs >> 4), dim=-1).reshape(shape[0], shape[1])
    return QuantizedWeight("int4_sym", pack_int4(c).contiguous(), _f16(b[..., 0:2]), None, 32, tuple(shape))


def from_gguf_q8_0(raw_blocks: torch.Tensor, shape: tuple[int, int]) -> QuantizedWeight:
    """GGUF Q8_0 blocks (fp16 d + 32 int8, w = q * d), uint8 [rows, nblocks*34] -> int8 with group 32."""
    b = _gguf_blocks(raw_blocks, shape, "Q8_0")
    q = b[..., 2:34].contiguous().view(torch.int8).reshape(shape[0], shape[1])
    return QuantizedWeight("int8", q, _f16(b[..., 0:2]), None, 32, tuple(shape))


def from_gguf_tq2_0(raw_blocks: torch.Tensor, shape: tuple[int, int]) -> QuantizedWeight:
    """GGUF TQ2_0 blocks of 256 (64 bytes of 2-bit codes, then fp16 d; element 128h + 32s + j sits in bits 2s of
    byte 32h + j; w = (code - 1) * d), uint8 [rows, nblocks*66] -> ternary with group 256."""
    b = _gguf_blocks(raw_blocks, shape, "TQ2_0")
    qs = b[..., 0:64].reshape(shape[0], -1, 2, 1, 32)
    c = torch.cat([(qs >> (2 * s)) & 3 for s in range(4)], dim=3).reshape(shape[0], shape[1])
    return QuantizedWeight("ternary", pack_ternary(c).contiguous(), _f16(b[..., 64:66]), None, 256, tuple(shape))


def from_gguf(raw_blocks: torch.Tensor, ggml_type: str, shape: tuple[int, int]) -> QuantizedWeight:
    """Dispatch by GGML type name: Q4_0, Q4_1, Q8_0, TQ2_0."""
    table = {"Q4_0": from_gguf_q4_0, "Q4_1": from_gguf_q4_1, "Q8_0": from_gguf_q8_0, "TQ2_0": from_gguf_tq2_0}
    if ggml_type not in table:
        raise ValueError(f"GGML type {ggml_type} cannot be repacked; supported: {sorted(table)}")
    return table[ggml_type](raw_blocks, shape)


def as_int8(qw: QuantizedWeight, group_size: int) -> QuantizedWeight:
    """The same weight as int8 codes with float32 scales and mins in groups of `group_size` (a divisor of its own
    group): exact for every format (int4 and ternary codes are int8 codes with a shifted origin), so weights of
    different formats can be stacked into one without requantizing."""
    if qw.group_size % group_size:
        raise ValueError(f"group_size {group_size} must divide the weight's group of {qw.group_size}")
    c = codes(qw).to(torch.int16)
    c = c - 8 if qw.format == "int4_sym" else c - 1 if qw.format == "ternary" else c
    repeat = qw.group_size // group_size
    scales = qw.scales.float().repeat_interleave(repeat, dim=1)
    mins = torch.zeros_like(scales) if qw.mins is None else qw.mins.float().repeat_interleave(repeat, dim=1)
    return QuantizedWeight("int8", c.to(torch.int8).contiguous(), scales, mins, group_size, qw.shape)
