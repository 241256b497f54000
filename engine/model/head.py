"""The layers over the vocabulary: the embedding lookup and the output layer (final hidden state -> logits).

A low-bit embedding (kept as the file's codes on the CPU, linear.convert) is decoded row by row as it is looked up:
the same values as a float32 table, without holding one. The output layer: on the CPU its logits are float32
products of exactly the weights the file gives: a low-bit output layer (a GGUF file's Q8_0 tied embedding, a Q6_K
`output.weight`) is held as int8 codes, which hold every such format exactly, and runs through the C++ kernel of
kernels/cpu_native.py, or where that does not build, the compiled kernel of kernels/cpu_compiled.py; where neither
can be built (no C++ compiler) or --cpu-compile is off, the layer is dense float32 instead: the same logits, about
4x the bytes read per token. Elsewhere it is a Linear like the others."""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from engine.kernel_cache import use_kernel_cache
from engine.model.linear import Linear, Weight
from kernels import cpu_compiled, cpu_native
from kernels.quant import QuantizedWeight, as_int8, dequantize

log = logging.getLogger("ninfer.model")

COMPILE_MIN_WEIGHTS = 1 << 22  # smaller output layers stay dense float32 (a few MiB; not worth a compile)


def embed_rows(table: Weight, ids: torch.Tensor) -> torch.Tensor:
    """The embeddings of `ids` [T] -> [T, hidden]: rows of a dense table, or rows of a low-bit one, decoded exactly."""
    if not isinstance(table, QuantizedWeight):
        return F.embedding(ids, table)
    rows = QuantizedWeight(table.format, table.qweight[ids], table.scales[ids],
                           None if table.mins is None else table.mins[ids], table.group_size,
                           (ids.numel(), table.in_features))
    return dequantize(rows, torch.float32)


class CompiledHead(Linear):
    """A Linear over int8 codes whose product is float32 (kernels.cpu_compiled.exact_linear)."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = cpu_compiled.exact_linear(x.reshape(-1, x.shape[-1]).float(), self.weight)
        y = y.view(*x.shape[:-1], y.shape[-1])
        return y if self.bias is None else y + self.bias.float()


def output_layer(weight: Weight, dtype: torch.dtype, device: torch.device, cpu_compile: str = "auto") -> Linear:
    """The model's output layer over `weight` as loaded (linear.convert leaves a low-bit head as stored on the
    CPU). `cpu_compile`: auto (the compiled kernel where it builds and pays) or off (dense float32)."""
    if device.type != "cpu" or not isinstance(weight, QuantizedWeight):
        return Linear(weight)
    dense_mib = weight.out_features * weight.in_features * torch.finfo(dtype).bits / 8 / 2**20
    if cpu_compile == "off" or weight.out_features * weight.in_features < COMPILE_MIN_WEIGHTS:
        return Linear(dequantize(weight, torch.float32).to(dtype))
    codes = _int8_codes(weight)
    use_kernel_cache()
    why = cpu_compiled.ready(codes)
    if why is not None:
        log.warning("output layer: the compiled CPU kernel is not available (%s); it runs dense float32 instead "
                    "(the same logits, %.0f MiB read per token instead of %.0f). Install a C++ compiler (g++ or "
                    "clang) to enable it, or set --cpu-compile off to skip trying.", why, dense_mib,
                    codes.nbytes / 2**20)
        return Linear(dequantize(weight, torch.float32).to(dtype))
    kernel = ("the C++ CPU kernel" if codes.cache.get("native")
              else f"the compiled CPU kernel (the C++ one is not available: {cpu_native.ready()})")
    log.info("output layer: %s held as int8 codes, float32 logits through %s (%.0f MiB read per token instead of "
             "%.0f dense)", weight.format, kernel, codes.nbytes / 2**20, dense_mib)
    return CompiledHead(codes)


def _int8_codes(qw: QuantizedWeight) -> QuantizedWeight:
    """The same weight as int8 codes with float32 scales (and mins where they are not all zero): exact."""
    if qw.format != "int8":
        qw = as_int8(qw, qw.group_size)
    mins = None if qw.mins is None or not bool(qw.mins.any()) else qw.mins.float().contiguous()
    return QuantizedWeight("int8", qw.qweight.contiguous(), qw.scales.float().contiguous(), mins, qw.group_size,
                           qw.shape)
