"""CPU kernels in C++ (kernels/cpu_native.cpp, cpu_output.cpp, cpu_dense.cpp, cpu_decode.cpp, cpu_moe.cpp,
cpu_hybrid.cpp, cpu_vnni.cpp, cpu_moe_prompt.cpp: one translation unit each, what they share declared in
cpu_kernels.h), built on first use for the machine they run on into one library.

* `q8_linear(x, qw)`: y = x @ dequantize(qw).T in float32 for grouped int8 weights (codes c, float32 scales d and
  optional mins m per group: w = c*d + m), reading the 1-byte codes once for up to four rows of x. Only the summation
  order differs from a float32 matmul over the dequantized weight (its twin: `reference.quant_linear_ref` with float32
  activations). With AVX2, FMA and F16C each row of x goes through `lowbit_linear`'s integer products twice: rounded
  to int16, then what that rounding left, rounded again. Together they hold x to about 2^-32 of each block's largest
  value, finer than float32 rounds the products, and each weight row is read once for both (~15% faster than
  converting the codes to floats). Elsewhere plain loops are left to the compiler.
* `lowbit_linear(x, qw)`: y = x @ dequantize(qw).T for 4-bit and grouped int8 weights (group a multiple of 32) with
  float32 or float16 scales, reading the codes as stored. The activations are rounded to int16 per block of 32 (a
  step of max|x| / 32767: finer than the bfloat16 that ATen's int4 kernel rounds them to) and multiplied as integers,
  16 products an instruction with AVX2; mins meet exact float32 block sums of x. Twin: `reference.lowbit_linear_ref`.
  Decode and verification steps of the decoder layers use it (kernels/dispatch.py); about 3x faster than ATen's
  int4 kernel on a CPU without AVX-512 (docs/KERNELS.md). On a CPU with AVX-512 VNNI (kernels/cpu_vnni.cpp) the
  same int16 products run 32 an instruction (`vpdpwssd`): the same integer sums, only the float32 summation of the
  blocks' products differs. `gemv_paths()` / `gemv_path(name)` name and switch the code path (benchmarks: A/B).

* `dense_linear(x, w, bias)`: y = x @ w.T (+ bias) for a few float32 rows and a float32 weight (the decode steps of
  a dense float32 model), reading each weight row once for up to four rows: about 2x ATen's float32 GEMV on two AVX2
  cores (docs/KERNELS.md). Only the summation order differs from F.linear.
* `rms_norm(x, w, eps)`: F.rms_norm of float32 rows (ATen's CPU kernel takes ~25 us for one 576-wide row; a decode
  step of the default model calls it 61 times). engine/model/layers.rms_norm takes it once the kernels are loaded.

Why C++: inductor's code for the same expression (kernels/cpu_compiled.py) loads 8 codes at a time into a vector
made for 32 and reduces every group horizontally; on a CPU without AVX-512 that reads the default model's output
layer (49,152 x 576 codes) at about 1 GB/s, 10x slower than memory allows (docs/KERNELS.md).

Built with torch's C++ extension builder (a C++ compiler and ninja) into the project's cache folder, named by a hash
of the source and of the CPU's features, so a build made for another CPU is never loaded; a later start loads it in
about a second. `ready()` says why where it cannot be built or loaded (callers fall back to the compiled kernel).
"""
from __future__ import annotations

import contextlib
import hashlib
import os

import torch

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

from kernels.quant import QuantizedWeight

_HERE = os.path.dirname(os.path.abspath(__file__))
SOURCES = [os.path.join(_HERE, name)  # one translation unit each, linked into one library
           for name in ("cpu_native.cpp", "cpu_output.cpp", "cpu_dense.cpp", "cpu_decode.cpp", "cpu_moe.cpp",
                        "cpu_hybrid.cpp", "cpu_vnni.cpp", "cpu_moe_prompt.cpp")]
HEADERS = [os.path.join(_HERE, "cpu_kernels.h")]
FLAGS = ["-O3", "-march=native", "-fopenmp"]

_state: dict = {}  # "error": why the kernel is not available, once tried; "op": the loaded op


def _cpu_features() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return os.uname().machine


def _source() -> str:
    """Every source and header, named, as the build key reads them (a change to any of them is another build)."""
    text = []
    for path in SOURCES + HEADERS:
        with open(path) as f:
            text.append(f"// {os.path.basename(path)}\n{f.read()}")
    return "\n".join(text)


def build_dir(key: str) -> str | None:
    """Where the build with this key goes: a folder beside inductor's cache (engine/kernel_cache.py points
    TORCHINDUCTOR_CACHE_DIR into the user's kernel cache), else None: torch's own extensions folder, under a name
    that carries the same key."""
    root = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    return os.path.join(os.path.dirname(root), "cpu_native", key) if root else None


def _this_build() -> tuple[str, str | None]:
    """(key, folder) of this CPU's build of the current sources; the key is worked out once per process (it reads
    every source file), the folder from where the kernel cache is now."""
    if "key" not in _state:
        _state["key"] = build_key(_source())
    return _state["key"], build_dir(_state["key"])


def build_key(source: str) -> str:
    """A hash of the source, the flags, torch's version and the CPU's features: another CPU gets another build."""
    text = source + " ".join(FLAGS) + torch.__version__ + _cpu_features()
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@contextlib.contextmanager
def build_lock(folder: str | None):
    """One builder of a build folder at a time, by an flock the system releases when its holder dies. torch's own
    lock file there (`lock`, which cpp_extension waits on forever) outlives a builder that was killed mid-build; a
    process holding the flock knows that no live builder left it, so it removes it. Without flock (or a folder of
    torch's choosing): torch's lock alone."""
    if folder is None or fcntl is None:
        yield
        return
    with open(os.path.join(folder, "builder.flock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            stale = os.path.join(folder, "lock")
            if os.path.exists(stale):
                os.remove(stale)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def sources_in(folder: str | None) -> tuple[list[str], str]:
    """(sources, include folder) to build from: copies of the sources and header in `folder`/src (the key says they
    are these very files), so that every checkout of the project writes the same build.ninja into the shared build
    folder (torch writes the paths it is given there; another path would make ninja rebuild everything). Copied
    only where a file differs, under the build lock. Without a folder of our own: the files where they are."""
    if folder is None:
        return SOURCES, _HERE
    src = os.path.join(folder, "src")
    os.makedirs(src, exist_ok=True)
    for path in SOURCES + HEADERS:
        copy = os.path.join(src, os.path.basename(path))
        with open(path, "rb") as f:
            data = f.read()
        if os.path.isfile(copy):
            with open(copy, "rb") as f:
                if f.read() == data:
                    continue
        with open(copy + ".tmp", "wb") as f:
            f.write(data)
        os.replace(copy + ".tmp", copy)
    return [os.path.join(src, os.path.basename(p)) for p in SOURCES], src


def ready() -> str | None:
    """None once the kernel is loaded (built now, or loaded from an earlier build); else why it is not available."""
    if "op" in _state or "error" in _state:
        return _state.get("error")
    if os.environ.get("NINFER_CPU_NATIVE", "1") == "0":
        _state["error"] = "NINFER_CPU_NATIVE=0"
        return _state["error"]
    try:
        from torch.utils.cpp_extension import load
        key, folder = _this_build()
        if folder is not None:
            os.makedirs(folder, exist_ok=True)
        with build_lock(folder):
            sources, include = sources_in(folder)
            load(f"ninfer_cpu_{key}", sources=sources, extra_include_paths=[include], is_python_module=False,
                 extra_cflags=FLAGS, extra_ldflags=["-fopenmp"], build_directory=folder)
        _state["op"] = torch.ops.ninfer_cpu.q8_linear.default
        _state["lowbit"] = torch.ops.ninfer_cpu.lowbit_linear.default
        _state["rms_norm"] = torch.ops.ninfer_cpu.rms_norm.default
        _state["dequantize"] = torch.ops.ninfer_cpu.dequantize_into.default
        _state["decode_step"] = torch.ops.ninfer_cpu.decode_step.default
        _state["dense"] = torch.ops.ninfer_cpu.dense_linear.default
        _state["hybrid_step"] = torch.ops.ninfer_cpu.hybrid_step.default
        _state["gemv_isa"] = torch.ops.ninfer_cpu.gemv_isa.default
        _state["gemv_widest"] = int(_state["gemv_isa"](-1))
        _state["gemv_split"] = torch.ops.ninfer_cpu.gemv_split.default
        _state["moe_prompt"] = torch.ops.ninfer_cpu.moe_prompt.default
        _register_shapes()
    except Exception as e:  # no compiler or ninja, a compile error: the caller falls back
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        _state["error"] = f"the C++ kernel did not build: {(lines[0] if lines else type(e).__name__)[:300]}"
    return _state.get("error")


def supported(qw: QuantizedWeight) -> bool:
    return (qw.format == "int8" and qw.qweight.dtype == torch.int8 and qw.scales.dtype == torch.float32
            and qw.group_size % 32 == 0 and (qw.mins is None or qw.mins.dtype == torch.float32))


def q8_linear(x: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    """[M, K] float32 -> [M, N] float32; `ready()` must have returned None and `supported(qw)` be true."""
    return _state["op"](x, qw.qweight, qw.scales, qw.mins)


def built() -> bool:
    """Whether this CPU's build of the kernels is in the kernel cache already (loading it then takes a second, no
    compiler); never builds."""
    key, folder = _this_build()
    return folder is not None and os.path.isfile(os.path.join(folder, f"ninfer_cpu_{key}.so"))


def loaded() -> bool:
    """Whether the kernels are loaded (`ready()` ran and succeeded); never builds."""
    return "op" in _state


LOWBIT_MAX_IN = 32768  # the longest weight row lowbit_linear takes (kernels/cpu_native.cpp: MAX_BLOCKS blocks of 32)


def lowbit_supported(qw: QuantizedWeight) -> bool:
    if qw.format not in ("int4_asym", "int4_sym", "int8") or qw.group_size % 32 or qw.in_features > LOWBIT_MAX_IN:
        return False
    if qw.scales.dtype not in (torch.float32, torch.float16) or qw.scales.device.type != "cpu":
        return False
    return (qw.mins is None or qw.mins.dtype == qw.scales.dtype) and all(
        t is None or t.is_contiguous() for t in (qw.qweight, qw.scales, qw.mins))


def lowbit_op():
    """The op itself: (x [M, K] float32, codes, scales, mins or None, symmetric 4-bit) -> [M, N] float32."""
    return _state["lowbit"]


def lowbit_linear(x: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    """[M, K] float32 -> [M, N] float32; `ready()` must have returned None and `lowbit_supported(qw)` be true."""
    return _state["lowbit"](x, qw.qweight, qw.scales, qw.mins, qw.format == "int4_sym")


# the low-bit GEMV's code paths, by the level kernels/cpu_vnni.cpp's gemv_isa takes
GEMV_PATHS = ("avx2", "avx512-vnni")


def gemv_paths() -> list[str]:
    """The low-bit GEMV's code paths this build has (the default, the widest, last); `loaded()` must be true. A
    machine without AVX2 has one portable path, named "avx2" here all the same."""
    return list(GEMV_PATHS[:_state["gemv_widest"] + 1])


class gemv_path:
    """`with gemv_path(name):` lowbit_linear, q8_linear and the decode steps' GEMVs take the code path `name` (one
    of gemv_paths()) within the block; for benchmarks, which alternate the paths in one process."""

    def __init__(self, name: str):
        if name not in gemv_paths():
            raise ValueError(f"GEMV path {name!r} is not in this build, which has {', '.join(gemv_paths())}")
        self.level = GEMV_PATHS.index(name)

    def __enter__(self):
        self.before = _state["gemv_isa"](self.level)
        return self

    def __exit__(self, *exc):
        _state["gemv_isa"](self.before)


GEMV_SPLITS = ("static", "dynamic")  # one contiguous share of the weight rows per thread, or chunks taken in turn


class gemv_split:
    """`with gemv_split(name):` the GEMVs' threads split the weight rows `name`-ly (GEMV_SPLITS; the default is
    dynamic: a thread held back by another process leaves its rows to the others); for benchmarks."""

    def __init__(self, name: str):
        if name not in GEMV_SPLITS:
            raise ValueError(f"GEMV split {name!r}: choose {' or '.join(GEMV_SPLITS)}")
        self.value = GEMV_SPLITS.index(name)

    def __enter__(self):
        self.before = _state["gemv_split"](self.value)
        return self

    def __exit__(self, *exc):
        _state["gemv_split"](self.before)


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ weight.T (+ bias) for float32 operands, a few rows (decode); `loaded()` must be true."""
    return _state["dense"](x, weight, bias)


def dequantize_into(qw: QuantizedWeight, out: torch.Tensor) -> torch.Tensor:
    """kernels.quant.dequantize(qw, out=out) in one pass (the same float32 values; into a bfloat16 `out`, those values
    rounded as .to(torch.bfloat16) rounds them); `lowbit_supported(qw)`."""
    return _state["dequantize"](qw.qweight, qw.scales, qw.mins, qw.format == "int4_sym", out)


def _register_shapes() -> None:
    """Output shapes for torch.compile (--cpu-compile step traces the decoder layers' calls of the kernel)."""
    @torch.library.register_fake("ninfer_cpu::lowbit_linear")
    def _(x, codes, scales, mins, sym):
        return x.new_empty(x.shape[0], codes.shape[0])

    @torch.library.register_fake("ninfer_cpu::rms_norm")
    def _(x, weight, eps):
        return torch.empty_like(x)

    @torch.library.register_fake("ninfer_cpu::q8_linear")
    def _(x, codes, scales, mins):
        return x.new_empty(x.shape[0], codes.shape[0])

    @torch.library.register_fake("ninfer_cpu::dense_linear")
    def _(x, weight, bias):
        return x.new_empty(x.shape[0], weight.shape[0])


def decode_step_op():
    """kernels/cpu_decode.cpp's decode_step (engine/model/cpu_fused.py calls it); `loaded()` must be true."""
    return _state["decode_step"]


def hybrid_step_op():
    """kernels/cpu_hybrid.cpp's hybrid_step (engine/model/cpu_hybrid.py calls it); `loaded()` must be true."""
    return _state["hybrid_step"]


def moe_layers(weights: list, moe_at: list[int], syms: list[int], dims: list[int], hidden: int):
    """A model's MoE layers for hybrid_step, read and checked once (kernels/cpu_moe.cpp's MoeLayers: a step then
    converts none of the expert tensors again); `loaded()` must be true. Raises RuntimeError naming what is wrong."""
    return torch.classes.ninfer_cpu.MoeLayers(weights, moe_at, syms, dims, hidden)


def moe_prompt_op():
    """kernels/cpu_moe_prompt.cpp's moe_prompt (engine/model/moe_prompt.py calls it); `loaded()` must be true."""
    return _state["moe_prompt"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """F.rms_norm over the last dim of float32 x with a float32 weight [D]; `loaded()` must be true."""
    return _state["rms_norm"](x, weight, eps)
