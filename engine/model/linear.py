"""Linear layers over dense or low-bit weights, and the policy that turns loaded tensors into a weight format.

Formats (`--weight-dtype`): fp32/bf16/fp16 dense; int8 per output channel; int4 in groups of 32 (GGUF Q4_0/Q4_1 kept
as stored, without requantizing); ternary ({-1,0,+1} x group scale). The matmuls go through kernels.dispatch: Triton on
CUDA, ATen's int8/int4 pack kernels on the CPU."""
from __future__ import annotations

import functools
import logging
import math

import torch
import torch.nn.functional as F

from kernels import cpu, cpu_native, dispatch
from kernels.quant import QuantizedWeight, as_int8, dequantize, quantize_int4, quantize_int8, quantize_ternary

log = logging.getLogger("ninfer.model")

LOW_BIT = ("int8", "int4", "ternary")
INT4_GROUP, TERNARY_GROUP = 32, 64
Weight = torch.Tensor | QuantizedWeight
FEW_ROWS, WIDE_OUT = 16, 16384  # see Linear.__call__
# --prefill-cublas: rows from which a low-bit layer dequantizes and runs a dense matmul (CPU measurement in
# docs/KERNELS.md: the crossover is 50-64 rows on SmolLM2's layers; on CUDA the kernels' own choice, not timed)
PREFILL_DENSE_ROWS = 64


def dense_prefill_rows(device: torch.device) -> int:
    """Rows from which a low-bit layer takes the dense prompt path: on the CPU, right above the C++ kernel's rows
    (kernels/cpu.NATIVE_ROWS), so no call reaches ATen's packed kernels and their second copy of the weight (a
    mixture-of-experts prompt gives each expert a few dozen rows); elsewhere PREFILL_DENSE_ROWS."""
    return cpu.NATIVE_ROWS + 1 if device.type == "cpu" else PREFILL_DENSE_ROWS


def is_linear(name: str) -> bool:
    """A weight a linear layer multiplies by (the names HF checkpoints give them), which low-bit formats store."""
    return name.endswith("_proj.weight") or ".in_proj_" in name and name.endswith(".weight") \
        or name == "lm_head.weight"


EMBEDDING = "model.embed_tokens.weight"


def keeps_codes(name: str) -> bool:
    """A tensor a GGUF file's low-bit codes are loaded for as they are: the linear weights, and the embedding (whose
    rows are decoded when looked up on the CPU, and which is the output layer of a tied model)."""
    return is_linear(name) or name == EMBEDDING


def layer_linears(layer) -> list:
    """A decoder layer's Linear layers, with the experts of its mixture-of-experts block (engine/model/moe.py)."""
    out = [v for v in vars(layer).values() if isinstance(v, Linear)]
    moe = getattr(layer, "moe", None)
    return out + (moe.linears() if moe is not None else [])


def is_router(name: str) -> bool:
    """A MoE router or shared-expert gate weight (engine/model/moe.py): kept dense float32 in every format."""
    return name.endswith(("mlp.gate.weight", "mlp.shared_expert_gate.weight"))


def native_format(tensors: dict[str, Weight]) -> str | None:
    """The low-bit format most linear weights are stored in (as loaded from a GGUF file), if any."""
    kinds = [t.format for n, t in tensors.items() if is_linear(n) and isinstance(t, QuantizedWeight)]
    if not kinds:
        return None
    top = max(set(kinds), key=kinds.count)
    return {"int4_asym": "int4", "int4_sym": "int4", "int8": "int8", "ternary": "ternary"}[top]


def convert(name: str, t: Weight, fmt: str, dtype: torch.dtype, device: torch.device,
            keep_native: bool = False) -> Weight:
    """One tensor in the format the model runs: dense tensors for norms/embeddings, `fmt` for linear weights.
    `keep_native` (--weight-dtype auto): a linear weight keeps the format it was loaded in, low-bit or dense (a GGUF
    file's weights are never stored with fewer bits than the file gives them, engine/model/gguf_exact.py). The
    output layer on the CPU keeps a low-bit weight as loaded (engine/model/head.output_layer computes its logits in
    float32) and is dense in `dtype` otherwise; elsewhere a low-bit model's output layer is int8 per channel unless
    kept."""
    dense = lambda: dequantize(t, torch.float32) if isinstance(t, QuantizedWeight) else t  # noqa: E731
    if is_router(name):
        return dense().to(device=device, dtype=torch.float32)
    head = name == "lm_head.weight"
    if (head or name == EMBEDDING) and device.type == "cpu" and fmt in LOW_BIT and isinstance(t, QuantizedWeight):
        return t  # as stored: engine/model/head.py decodes the looked-up rows and makes the logits float32-exact
    if fmt not in LOW_BIT or not is_linear(name) or head and device.type == "cpu":
        return dense().to(device=device, dtype=dtype)
    if keep_native:
        return t.to(device) if isinstance(t, QuantizedWeight) else t.to(device=device, dtype=dtype)
    want = "int8" if head else fmt
    if isinstance(t, QuantizedWeight) and _matches(t, want):
        return t.to(device)
    dense = dense().float()
    if want == "int8":
        q = quantize_int8(dense)
    elif want == "int4":
        q = quantize_int4(dense, INT4_GROUP, symmetric=False)
    else:
        q = quantize_ternary(dense, TERNARY_GROUP)
    return q.to(device)


def _matches(t: QuantizedWeight, want: str) -> bool:
    if want == "int8":
        return t.format == "int8" and t.group_size == t.in_features  # per channel: the CPU fast path needs it
    return t.format.startswith(want)


def fuse(parts: list[Weight]) -> Weight:
    """Stacks weights along the output dimension so q/k/v (or gate/up) run as one matmul."""
    if all(isinstance(p, torch.Tensor) for p in parts):
        return torch.cat(parts)
    if all(isinstance(p, QuantizedWeight) for p in parts) and len({p.scales.dtype for p in parts}) > 1 \
            and len({(p.format, p.group_size, p.mins is None) for p in parts}) == 1:  # float32 scales for all: exact
        wide = lambda t: None if t is None else t.float()  # noqa: E731
        parts = [QuantizedWeight(p.format, p.qweight, wide(p.scales), wide(p.mins), p.group_size, p.shape)
                 for p in parts]
    first = parts[0]
    same = all(isinstance(p, QuantizedWeight) and p.format == first.format and p.group_size == first.group_size
               and p.scales.dtype == first.scales.dtype and (p.mins is None) == (first.mins is None) for p in parts)
    if not same and all(isinstance(p, QuantizedWeight) for p in parts):
        # mixed low-bit storage (a Q4_K_M file's Q4_K q/k beside a Q6_K v): int8 with mins holds each exactly
        group = math.gcd(*(p.group_size for p in parts))
        # symmetric parts (a Q4_0 q/k beside a Q8_0 v) need no mins, and float16 scales stay float16: exact too,
        # and 2-4 fewer bytes a group to read per token
        symmetric = all(p.mins is None and p.format in ("int4_sym", "int8", "ternary") for p in parts)
        half = all(p.scales.dtype == torch.float16 for p in parts)
        parts = [as_int8(p, group) for p in parts]
        if symmetric:
            parts = [QuantizedWeight("int8", p.qweight, p.scales.half() if half else p.scales, None, group, p.shape)
                     for p in parts]
        first = parts[0]
        log.info("stacked a mixed-format fused weight as int8 in groups of %d%s (exact)", group,
                 ", symmetric" if symmetric else " with mins")
    elif not same:  # low-bit beside dense parts (a weight no low-bit format holds exactly): dense, exact
        dtype = next(p.dtype for p in parts if isinstance(p, torch.Tensor))
        log.info("a fused weight with dense parts runs dense (%s)", str(dtype).split(".")[-1])
        return torch.cat([dequantize(p, dtype) if isinstance(p, QuantizedWeight) else p for p in parts])
    cat = lambda ts: None if ts[0] is None else torch.cat(ts)  # noqa: E731
    return QuantizedWeight(first.format, cat([p.qweight for p in parts]), cat([p.scales for p in parts]),
                           cat([p.mins for p in parts]), first.group_size,
                           (sum(p.out_features for p in parts), first.in_features))


class DenseScratch:
    """--prefill-cublas: a low-bit layer computing at least `min_rows` rows (a prefill chunk) dequantizes its weight
    into a buffer shared by every layer of the model and runs a dense matmul (cuBLAS on CUDA, oneDNN/BLAS on the
    CPU); fewer rows (decode) keep the low-bit GEMV. The buffers are sized for the largest layer, allocated at the
    first chunk and then reused: no dequantized copy of any layer is kept. On the CPU the weight is dequantized exactly
    in float32 and multiplied in float32, or rounded to bf16 where the CPU multiplies bf16 natively (dense_cpu_dtype;
    measured 1.2-2.2x faster than the low-bit kernels from 64 rows, docs/KERNELS.md). Where Triton runs (CUDA) the Triton
    dequantize kernel writes a fresh tensor instead (it has no out= argument): freed after the matmul, its block is
    handed to the next layer of that shape by the caching allocator."""

    def __init__(self, min_rows: int, size: int = 0):
        """`size`: elements of the largest weight that will use it (the buffers are allocated at that size)."""
        self.min_rows, self.size = min_rows, size
        self.buffers: dict[torch.dtype, torch.Tensor] = {}
        self.grown = 0  # buffer allocations: 2 on the CPU (float32 and bf16), at the first chunk (tested)

    def _buffer(self, dtype: torch.dtype, shape: tuple[int, int], device: torch.device) -> torch.Tensor:
        n = shape[0] * shape[1]
        buf = self.buffers.get(dtype)
        if buf is None or buf.numel() < n or buf.device != device:
            self.size = max(self.size, n)
            buf = self.buffers[dtype] = torch.empty(self.size, dtype=dtype, device=device)
            self.grown += 1
        return buf[:n].view(shape)

    def weight(self, qw: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
        """qw dequantized to `dtype`, [out, in]: a view of a shared buffer, valid until the next call."""
        if dispatch.use_triton(qw.device):
            return dispatch.dequantize_to(qw, dtype)
        native = qw.device.type == "cpu" and cpu_native.loaded() and cpu_native.lowbit_supported(qw)
        if native and dtype == torch.bfloat16:  # rounded in the same pass: no float32 copy written and read again
            return cpu_native.dequantize_into(qw, self._buffer(dtype, qw.shape, qw.device))
        buf = self._buffer(torch.float32, qw.shape, qw.device)
        if native:
            w = cpu_native.dequantize_into(qw, buf)  # the same values in one pass (5x faster than ATen's four)
        else:
            w = dequantize(qw, out=buf)
        return w if dtype == torch.float32 else self._buffer(dtype, qw.shape, qw.device).copy_(w)

    def linear(self, x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
        cd = dense_cpu_dtype() if x.device.type == "cpu" and x.dtype == torch.float32 else x.dtype
        y = F.linear(x.to(cd), self.weight(qw, cd)).to(x.dtype)
        return y if bias is None else y + bias.to(y.dtype)


@functools.cache
def dense_cpu_dtype() -> torch.dtype:
    """What the CPU's dense prefill multiplies float32 activations in: bf16 where oneDNN runs bf16 matmuls natively
    (AVX-512 BF16, AMX), else float32: on an AVX2 CPU a bf16 matmul is emulated and ~5x slower than float32
    (docs/KERNELS.md), and float32 is exact."""
    return torch.bfloat16 if torch.ops.mkldnn._is_mkldnn_bf16_supported() else torch.float32


def enable_dense_prefill(model, min_rows: int) -> DenseScratch:
    """Gives every low-bit linear layer of the decoder layers (not the output layer, which prefill runs on one row
    per sequence) one shared DenseScratch."""
    linears = [v for layer in model.layers for v in layer_linears(layer) if isinstance(v.weight, QuantizedWeight)]
    scratch = DenseScratch(min_rows, max((v.weight.out_features * v.weight.in_features for v in linears), default=0))
    for v in linears:
        v.scratch = scratch
    return scratch


def use_cpu_kernel(model) -> str | None:
    """Marks the weights the C++ kernels of kernels/cpu_native.py read for decode rows, building or loading them
    first: the decoder layers' low-bit weights (4-bit and grouped int8 in groups of 32k; kernels/cpu.native_fn) and
    every float32 linear weight, the output layer's included (`dense_linear`). Returns what was done, for the load
    log, or None where the kernels are not available (`cpu_native.ready()` says why)."""
    linears = [v for layer in model.layers for v in layer_linears(layer)]
    quantized = [v for v in linears if isinstance(v.weight, QuantizedWeight)]
    taken = [v.weight for v in quantized if cpu_native.lowbit_supported(v.weight)]
    dense = [v for v in linears + [model.lm_head] if type(v) is Linear and _dense_float32(v)]
    if not taken and not dense:
        return "no weight the C++ decode kernels read"
    if cpu_native.ready() is not None:
        return None
    for qw in taken:
        qw.cache = {k: v for k, v in qw.cache.items()  # the path is chosen again at the next call
                    if not (isinstance(k, tuple) and k[0] == "cpu_linear")}
        qw.cache["lowbit_native"] = True
    for v in dense:
        v.native_dense = True
    said = [f"{len(taken)} of {len(quantized)} low-bit weights decode through the C++ kernel (activations rounded to "
            f"int16 per block of 32)"] if quantized else []
    if dense:
        said.append(f"{len(dense)} float32 weights through the C++ GEMV")
    return "; ".join(said)


def _dense_float32(v) -> bool:
    w = v.weight
    return (isinstance(w, torch.Tensor) and w.dtype == torch.float32 and w.device.type == "cpu" and w.dim() == 2
            and w.is_contiguous() and (v.bias is None or v.bias.dtype == torch.float32 and v.bias.is_contiguous()))


class Linear:
    def __init__(self, weight: Weight, bias: torch.Tensor | None = None):
        self.weight, self.bias = weight, bias
        self.scratch: DenseScratch | None = None  # set by enable_dense_prefill
        self.native_dense = False  # set by use_cpu_kernel: a float32 CPU weight the C++ GEMV reads for decode rows

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if isinstance(w, QuantizedWeight):
            if self.scratch is not None and x.numel() >= self.scratch.min_rows * x.shape[-1]:
                return self.scratch.linear(x, w, self.bias)
            return dispatch.linear(x, w, self.bias)
        if self.native_dense and x.dim() == 2 and x.shape[0] <= FEW_ROWS and x.dtype == torch.float32:
            return cpu_native.dense_linear(x, w, self.bias)  # decode rows (use_cpu_kernel)
        if x.device.type == "cpu" and 1 < x.shape[0] <= FEW_ROWS and w.shape[0] >= WIDE_OUT and x.dim() == 2:
            # a few rows through a wide layer (the output layer over a verified draft): the CPU BLAS reads W
            # several times as x @ W.T at 2-3 rows, once as W @ x.T (measured: 23 ms vs 6 ms, 49152 x 576 fp32)
            y = (w @ x.t()).t()
            return y if self.bias is None else y + self.bias
        return F.linear(x, w, self.bias)

    @property
    def nbytes(self) -> int:
        w = self.weight
        n = w.nbytes if isinstance(w, QuantizedWeight) else w.numel() * w.element_size()
        return n + (0 if self.bias is None else self.bias.numel() * self.bias.element_size())
