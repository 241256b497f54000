"""A qwen35moe GGUF file's mixture-of-experts tensors, as llama.cpp's converter writes them, under the HF names the
model reads (engine/model/moe.py); engine/model/gguf_names.MOE_NAMES maps their names.

- the router `ffn_gate_inp` {H, E} is mlp.gate.weight [E, H] (the converter keeps it F32);
- the experts are stacked, one 3-D tensor per projection: `ffn_gate_exps` / `ffn_up_exps` {H, I, E} and
  `ffn_down_exps` {I, H, E}, or gate and up merged as `ffn_gate_up_exps` {H, 2I, E} (gate rows first). They are cut
  into mlp.experts.{e}.{gate,up,down}_proj.weight; a Q4_0/Q4_1/Q8_0/TQ2_0 file's blocks are repacked per expert
  without requantizing, as engine/model/gguf_file.py does for 2-D weights;
- the shared expert `ffn_{gate,up,down}_shexp` is mlp.shared_expert.*, and its gate `ffn_gate_inp_shexp` {H}
  mlp.shared_expert_gate.weight [1, H]."""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from kernels.quant import from_gguf

def _parts(name: str, e: int, rows: int) -> list[tuple[str, slice]]:
    """The per-expert names one stacked tensor's expert `e` holds, with the rows of it each takes."""
    base = name.rsplit(".", 1)[0]
    if name.endswith("gate_up_proj"):
        half = rows // 2
        return [(f"{base}.{e}.gate_proj.weight", slice(0, half)), (f"{base}.{e}.up_proj.weight", slice(half, rows))]
    return [(f"{base}.{e}.{name.rsplit('.', 1)[1]}.weight", slice(0, rows))]


def split_stacked(name: str, t, shape: tuple[int, ...], native: bool, native_types: tuple[str, ...],
                  exact: Callable | None) -> dict[str, torch.Tensor]:
    """The experts of stacked GGUF tensor `t` (HF pseudo-name `name`, shape (E, rows, cols)) under their HF names:
    repacked blocks where `native` and the type is one of `native_types`, an exact low-bit form from `exact(values,
    blocks)` where it gives one, else float32."""
    kind = t.tensor_type.name
    experts, rows, cols = shape
    out: dict[str, torch.Tensor] = {}
    if native and kind in native_types:
        raw = np.array(t.data, dtype=np.uint8, order="C").reshape(experts, rows, -1)
        for e in range(experts):
            for hf, sel in _parts(name, e, rows):
                block = torch.from_numpy(np.ascontiguousarray(raw[e, sel]))
                out[hf] = from_gguf(block, kind, (sel.stop - sel.start, cols))
        return out
    values = dequantize(t.data, GGMLQuantizationType(t.tensor_type)).reshape(shape)
    blocks = np.asarray(t.data).reshape(experts, rows, -1)
    for e in range(experts):
        for hf, sel in _parts(name, e, rows):
            packed = exact(values[e, sel], blocks[e, sel]) if exact is not None else None
            out[hf] = packed if packed is not None else torch.from_numpy(np.array(values[e, sel], dtype=np.float32))
    return out


def restore_moe(name: str, arr: np.ndarray) -> np.ndarray:
    """The shared expert's gate as HF holds it ([1, H]; the file may store {H})."""
    if name.endswith("mlp.shared_expert_gate.weight") and arr.ndim == 1:
        return arr[None, :]
    return arr
