"""GGUF low-bit types held exactly in a format the kernels run (kernels.quant), never with fewer bits than the file.

Every type here is, per group of `group` consecutive weights, `code * scale (+ min)` with integer codes in a known
range. The scale and min of each weight are read by decoding the tensor with the gguf package twice more, on copies
of its blocks whose codes are overwritten: every code 0 (the min) and every code 1 with the min factor zeroed (the
scale). So the bit layouts of the scales stay the gguf package's business, and the result is checked: a weight is
kept in its format only when `kernels.quant.dequantize` reproduces the gguf package's decoding bit for bit (scales
in float16 where they round-trip, else float32); otherwise it stays dense float32 (`pack_exact` returns None).

| GGUF type | stored as | group | codes |
| --- | --- | --- | --- |
| Q5_0 | int8 | 32 | q - 16 in -16..15 |
| Q5_1 | int8 + mins | 32 | q in 0..31 |
| Q2_K | int4_asym | 16 | q in 0..3 |
| Q3_K | int4_sym | 16 | q in -4..3 |
| Q4_K | int4_asym | 32 | q in 0..15 |
| Q5_K | int8 + mins | 32 | q in 0..31 |
| Q6_K | int8 | 16 | q - 32 in -32..31 |
| IQ4_NL, IQ4_XS | int8 | 32 | the 16 non-linear levels, -127..113 |

Q4_0, Q4_1, Q8_0 and TQ2_0 are repacked from their blocks (kernels.quant.from_gguf); TQ1_0 is ternary with absmax
scales. The other types (IQ1-IQ3 grids, MXFP4, NVFP4) stay dense float32: exact, at 32 bits a weight.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from kernels.quant import QuantizedWeight, dequantize, pack_int4


@dataclass(frozen=True)
class ExactLayout:
    fmt: str  # "int8" (with mins where `zero` is given) | "int4_asym" | "int4_sym"
    group: int
    lo: int  # code range
    hi: int
    unit: tuple[tuple[int, int, int], ...]  # (start, stop, byte) written into each block: every code 1, min factor 0
    zero: tuple[tuple[int, int, int], ...] | None = None  # every code 0 (types with a min)


EXACT_LAYOUTS = {
    "Q5_0": ExactLayout("int8", 32, -16, 15, unit=((2, 6, 0xFF), (6, 22, 0x11))),
    "Q5_1": ExactLayout("int8", 32, 0, 31, unit=((2, 4, 0), (4, 8, 0), (8, 24, 0x11)),
                        zero=((4, 8, 0), (8, 24, 0))),
    "Q2_K": ExactLayout("int4_asym", 16, 0, 3, unit=((16, 80, 0x55), (82, 84, 0)), zero=((16, 80, 0),)),
    "Q3_K": ExactLayout("int4_sym", 16, -4, 3, unit=((0, 32, 0xFF), (32, 96, 0x55))),
    "Q4_K": ExactLayout("int4_asym", 32, 0, 15, unit=((2, 4, 0), (16, 144, 0x11)), zero=((16, 144, 0),)),
    "Q5_K": ExactLayout("int8", 32, 0, 31, unit=((2, 4, 0), (16, 48, 0), (48, 176, 0x11)), zero=((16, 176, 0),)),
    "Q6_K": ExactLayout("int8", 16, -32, 31, unit=((0, 128, 0x11), (128, 192, 0xAA))),
    "IQ4_NL": ExactLayout("int8", 32, -127, 113, unit=((2, 18, 0x88),)),
    "IQ4_XS": ExactLayout("int8", 32, -127, 113, unit=((8, 136, 0x88),)),
}
STORED_AS = {**{k: v.fmt.split("_")[0] for k, v in EXACT_LAYOUTS.items()},
             "Q4_0": "int4", "Q4_1": "int4", "Q8_0": "int8", "TQ2_0": "ternary", "TQ1_0": "ternary"}


def probe_planes(blocks: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray | None]:
    """(scale, min or None) of every weight of a `kind` tensor given as its raw uint8 blocks [rows, bytes], each
    float32 [rows, columns] as the gguf package decodes them."""
    layout = EXACT_LAYOUTS[kind]
    qtype = GGMLQuantizationType[kind]

    def decoded(writes) -> np.ndarray:
        rows = blocks.shape[0]
        copy = np.array(blocks, dtype=np.uint8, copy=True).reshape(rows, -1, GGML_QUANT_SIZES[qtype][1])
        for start, stop, byte in writes:
            copy[..., start:stop] = byte
        return gguf_dequantize(copy.reshape(rows, -1), qtype)

    return decoded(layout.unit), None if layout.zero is None else decoded(layout.zero)


def pack_exact(values: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor | None,
               kind: str) -> QuantizedWeight | None:
    """The weight `values` [out, in] (the gguf package's decoding) in its exact format, from its per-weight scale
    and min planes (`probe_planes`, moved with the same row and column orders); None when the shape does not fit
    the groups or the format does not reproduce `values` bit for bit."""
    layout = EXACT_LAYOUTS[kind]
    out_f, in_f = values.shape
    if in_f % layout.group:
        return None
    shape = (out_f, in_f // layout.group, layout.group)
    s = scale.reshape(shape)[..., 0].contiguous()
    m = None if minimum is None else minimum.reshape(shape)[..., 0].contiguous()
    safe = torch.where(s == 0, torch.ones_like(s), s).unsqueeze(-1)
    shifted = values.reshape(shape) - (0 if m is None else m.unsqueeze(-1))
    q = torch.where(s.unsqueeze(-1) == 0, torch.zeros_like(shifted), torch.round(shifted / safe))
    q = q.clamp_(layout.lo, layout.hi).reshape(out_f, in_f)
    half = torch.equal(s.half().float(), s) and (m is None or torch.equal(m.half().float(), m))
    s, m = (s.half(), None if m is None else m.half()) if half else (s, m)
    if layout.fmt == "int8":
        qw = QuantizedWeight("int8", q.to(torch.int8).contiguous(), s, m, layout.group, (out_f, in_f))
    else:
        stored = q + 8 if layout.fmt == "int4_sym" else q
        qw = QuantizedWeight(layout.fmt, pack_int4(stored.to(torch.uint8)).contiguous(), s, m, layout.group,
                             (out_f, in_f))
    return qw if torch.equal(dequantize(qw), values) else None
