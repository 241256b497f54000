"""Putting an engine together: device, dtypes, weights, KV capacity, tokenizer."""
from __future__ import annotations

import functools
import logging
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import psutil
import torch

from engine import selfcheck
from engine.engine import Engine
from engine.config.engine_config import EngineConfig
from engine.hardware import resolve_device, return_freed_memory
from engine.errors import NInferError
from engine.memory.geometry import PAGE_SIZE, state_slots, state_snapshots
from engine.ledger import MIB, Ledger, ModelShape, build_ledger
from engine.ledger.placement import fit_experts
from engine.ledger.vision import VisionShape
from engine.model.config import ModelConfig
from engine.model.formats import pick_dtype, pick_kv_dtype, weight_format
from engine.kernel_cache import use_kernel_cache
from engine.model.linear import LOW_BIT, dense_cpu_dtype, dense_prefill_rows, use_cpu_kernel
from engine.model.registry import build_model
from engine.model.loader import load_weights
from engine.model.gguf_mmproj import load_mmproj_vision
from engine.model.image_processing import ImageInputError
from engine.model.vision_input import VisionModel
from engine.model.weights import Progress
from engine.runner import ModelRunner
from engine.speculative.factory import make_speculator
from engine.speculative.mtp import is_mtp_tensor
from engine.tokenizer import Tokenizer
from kernels import cpu_native

log = logging.getLogger("ninfer.build")

@dataclass
class LoadedEngine:
    engine: Engine
    tokenizer: "object"  # engine.tokenizer.Tokenizer
    config: ModelConfig
    path: Path
    device: torch.device
    dtype: torch.dtype
    load_seconds: float = 0.0
    ledger: Ledger | None = None  # the memory ledger the KV pools were sized with
    weight_storage: str = ""  # what each stored type became: "210 x Q4_1 -> int4, 61 x F32, 1 x Q8_0 -> int8"

    @property
    def context_window(self) -> int:
        """The longest sequence the engine takes: the context length, or less when the KV memory reaches less."""
        return self.engine.context_tokens


def size_kv(cfg: ModelConfig, device: torch.device, config: EngineConfig, cache_specs: list | None = None,
            vision: VisionModel | None = None) -> Ledger:
    """The KV pools from the memory ledger (engine/ledger), on the memory free now that the weights are loaded: the
    GPU pool's pages (kv_capacity auto: what all sequences want, or what fits), the host tier's pages and the reach
    of one sequence. With the context left to the model (auto_context) a pool that cannot hold the model's whole
    context shortens it to the reach, saying so; an explicit --max-context beyond reach is refused, as is anything
    that does not fit, naming the ledger line at fault and the remedy."""
    context, auto_context = config.max_context or cfg.max_position, not config.max_context
    vram_mib = torch.cuda.mem_get_info(device)[0] // MIB if device.type == "cuda" else 0
    ram_mib = psutil.virtual_memory().available // MIB
    shape = ModelShape.from_config(cfg, cache_specs=cache_specs)
    if vision is not None:  # the tower's activations for the largest image and the encoder cache
        shape = replace(shape, vision=vision_shape(vision))
    ledger = build_ledger(shape, config, vram_mib=vram_mib, ram_mib=ram_mib, include_weights=False,
                          max_context=context)
    if auto_context and ledger.gpu_pages and ledger.reach_tokens < context \
            and all(p.line in ("kv", "host_kv") for p in ledger.check() if p.level == "error"):
        log.warning("the KV memory holds %d tokens of one sequence, less than the model's %d: the context is %d "
                    "tokens (set --max-context, --kv-dtype or --host-kv-mib to choose)", ledger.reach_tokens,
                    context, ledger.reach_tokens)
        ledger = build_ledger(shape, config, vram_mib=vram_mib, ram_mib=ram_mib, include_weights=False,
                              max_context=ledger.reach_tokens)
    ledger.raise_if_refused()
    return ledger


def in_own_thread(fn):
    """`fn` made to run on a new thread that ends when it returns (its result returned, its exception raised in the
    caller).

    On the CPU, every thread that runs parallel PyTorch ops keeps a pool of OpenMP worker threads for as long as it
    lives. When the workers of all pools outnumber the cores, libgomp stops spinning between parallel regions and
    every region waits for a wake-up. Loading on a thread that ends leaves the engine thread's pool alone: int4 decode
    of the default model went from 33.4 to 58.7 tok/s on 2 cores (`ninfer-bench --weight-dtype auto`,
    docs/BENCHMARKS.md)."""

    @functools.wraps(fn)
    def on_own_thread(*args, **kwargs):
        result: dict = {}

        def run():
            try:
                result["value"] = fn(*args, **kwargs)
            except BaseException as e:  # noqa: BLE001 - handed to the caller as is
                result["error"] = e

        worker = threading.Thread(target=run, name="ninfer-load", daemon=True)
        worker.start()
        worker.join()
        if "error" in result:
            raise result["error"]
        return result["value"]

    return on_own_thread


@dataclass
class LoadedModel:
    """A model read, converted and self-checked, before any sequence memory exists: what `assemble_engine` builds
    engines over. `settings` are the settings it was loaded under (MODEL_FIELDS are the ones that shaped it)."""
    net: Any  # the model (engine/model/registry.py)
    tokenizer: Tokenizer
    config: ModelConfig
    path: Path
    device: torch.device
    dtype: torch.dtype
    kv_dtype: torch.dtype | str
    weight_format: str  # "" = dense
    settings: EngineConfig
    storage: str = ""
    mtp_tensors: dict = field(default_factory=dict)
    load_seconds: float = 0.0
    kv_name: str = "auto"  # the KV dtype's name the ledger plans with: the setting, or what --fit chose
    vision: Any = None  # engine.model.vision_input.VisionModel of a vision-language folder; None: text only


# the settings load_model reads: two engines over one LoadedModel must agree on them (the self-check ran with the KV
# dtype; --cpu-compile, the weight dtype and the dense prompt path change the model's layers)
MODEL_FIELDS = ("device", "threads", "weight_dtype", "kv_dtype", "prefill_cublas", "cpu_compile", "gdn_state_fp16",
                "allow_lossy_format", "cpu_moe", "n_cpu_moe", "fit", "mmproj")


def experts_on_host(cfg: ModelConfig, device: torch.device, c: EngineConfig, path: Path) -> tuple[int, str]:
    """How many MoE layers keep their experts in host memory (--cpu-moe: all; --n-cpu-moe N: the first N, at most
    all; neither, on a GPU: what --fit plans), and the KV dtype to plan with (the setting, or --fit's choice); 0
    layers where the setting has nothing to move (the model runs on the CPU, or has no MoE layers: said once)."""
    asked = "--cpu-moe" if c.cpu_moe else f"--n-cpu-moe {c.n_cpu_moe}" if c.n_cpu_moe else ""
    name = path.name
    if not asked:
        if c.fit and cfg.moe is not None and device.type == "cuda":
            return fitted_experts(device, c, path)
        return 0, c.kv_dtype
    return _asked_experts(cfg, device, c, asked, name), c.kv_dtype


def _asked_experts(cfg: ModelConfig, device: torch.device, c: EngineConfig, asked: str, name: str) -> int:
    if cfg.moe is None:
        log.warning("%s has no effect: %s has no mixture-of-experts layers.", asked, name)
        return 0
    if device.type == "cpu":
        log.info("%s: the model runs on the CPU, its experts are in host memory already.", asked)
        return 0
    layers = len(cfg.moe.layers)
    if c.n_cpu_moe > layers and not c.cpu_moe:
        log.info("--n-cpu-moe %d: %s has %d MoE layers; all of them keep their experts in host memory.",
                 c.n_cpu_moe, name, layers)
    return layers if c.cpu_moe else min(c.n_cpu_moe, layers)


def fitted_experts(device: torch.device, c: EngineConfig, path: Path) -> tuple[int, str]:
    """--fit (engine/ledger/placement.py) on the GPU memory free now: the MoE layers whose experts go to the host,
    and the KV dtype; a model that cannot fit is refused."""
    free = torch.cuda.mem_get_info(device)[0] // MIB
    plan = fit_experts(ModelShape.from_path(path), c, vram_mib=free, ram_mib=psutil.virtual_memory().available // MIB)
    if plan.host_layers is None:
        raise NInferError(f"{path.name} does not fit this GPU ({free} MiB free): {plan.why}",
                          "Use a lower-bit file of the model, a shorter --max-context or a GPU with more memory; or "
                          "run it on the CPU (--device cpu).")
    log.info("--fit: %s", plan.why)
    return plan.host_layers, plan.kv_dtype


WARMUP = "warm-up: "  # the progress messages after the weights are read (the launcher shows them as such)


def _warming(progress: Progress | None, what: str) -> None:
    if progress is not None:
        progress(1.0, WARMUP + what)


@in_own_thread
def load_model(model: str | Path | None = None, config: EngineConfig | None = None, *,
               progress: Progress | None = None, cancel: threading.Event | None = None,
               **settings: Any) -> LoadedModel:
    """Reads the model, converts it to the formats `config` asks for (MODEL_FIELDS) and self-checks lossy formats,
    on a thread of its own that ends with the loading (`in_own_thread`)."""
    c = (config or EngineConfig()).replace(**settings)
    t0 = time.perf_counter()
    dev = torch.device(resolve_device(c.device))
    if c.threads and dev.type == "cpu":
        torch.set_num_threads(c.threads)
    native = c.weight_dtype == "auto" or c.weight_dtype in LOW_BIT
    path, weights = load_weights(model, progress, cancel, native=native)
    cfg = weights.config
    storage = weights.storage_summary()
    log.info("loaded %s (%s, %s): %s", path.name, cfg.arch, weights.source_format, storage)
    tokenizer = Tokenizer.from_folder(path) if path.is_dir() else Tokenizer.from_gguf(path)
    fmt = weight_format(c.weight_dtype, weights)
    wdtype = pick_dtype("auto" if fmt or c.weight_dtype == "auto" else c.weight_dtype, dev)
    host_experts, kv_name = experts_on_host(cfg, dev, c, path)
    kdtype = pick_kv_dtype(kv_name, dev)
    if c.gdn_state_fp16 and "recurrent" not in cfg.layer_kinds:
        raise NInferError(f"--gdn-state-fp16 stores the recurrent state of Gated-DeltaNet layers in fp16, but "
                          f"{path.name} ({cfg.arch}) has no such layers.", "Drop --gdn-state-fp16 for this model.")
    options = {"state_fp16": True} if c.gdn_state_fp16 else {}
    options["cpu_compile"] = c.cpu_compile
    if host_experts:
        options["host_experts"] = host_experts
    _warming(progress, f"preparing the weights for the {dev.type.upper()}")
    net = build_model(weights, wdtype, dev, fmt, keep_native=c.weight_dtype == "auto", **options)
    log.info("weights: %s, %.0f MiB read per token", net.weight_format, net.weight_bytes() / 2**20)
    if host_experts:
        moved = sum(net.layers[i].moe.expert_bytes() for i in net.host_layers)
        log.info("experts of %d of %d MoE layers (%s) in host memory, computed on the CPU: %.0f MiB", host_experts,
                 len(cfg.moe.layers), ", ".join(map(str, sorted(net.host_layers))), moved / 2**20)
    if (dev.type == "cpu" or host_experts) and c.cpu_compile != "off":
        use_kernel_cache()
        if not cpu_native.loaded():
            _warming(progress, "loading the C++ decode kernels built for this CPU" if cpu_native.built() else
                     "compiling the C++ decode kernels for this CPU (the first start only, a minute or so; later "
                     "starts load them)")
        done = use_cpu_kernel(net)
        if done is None:
            log.warning("decoder layers: the C++ decode kernels are not available (%s); they decode through ATen's "
                        "kernels instead (%s). Install a C++ compiler (g++ or clang) to enable them, or set "
                        "--cpu-compile off to skip trying.", cpu_native.ready(),
                        "bf16 activations, slower" if fmt else "about half the speed")
        else:
            log.info("decoder layers: %s", done)
    _warming(progress, "checking the converted weights")
    selfcheck.run(weights, net, fmt, kdtype, tokenizer, allow=c.allow_lossy_format)
    mtp_tensors = {n: t for n, t in weights.tensors.items() if is_mtp_tensor(n, cfg.num_layers)}
    del weights
    vision = _load_vision(path, cfg, wdtype, dev, mmproj=c.mmproj, tokenizer=tokenizer)
    if vision is not None:  # a bigger image is scaled down to fit, as by the processor's own max_pixels
        vision.limit_pixels(c.max_image_pixels)
        vision.encoder_cache.max_bytes = vision_shape(vision).encoder_cache_bytes(c.max_image_pixels,
                                                                                  vision.tower.dtype.itemsize)
    freed = return_freed_memory()
    if freed >= 64 * MIB:
        log.info("memory: %.0f MiB the loading had freed handed back to the OS", freed / MIB)
    return LoadedModel(net, tokenizer, cfg, path, dev, wdtype, kdtype, fmt, c, storage, mtp_tensors,
                       time.perf_counter() - t0, kv_name, vision)


def vision_shape(vision: VisionModel) -> VisionShape:
    """A loaded tower as the ledger counts it (its activations at the processor's largest image)."""
    return VisionShape.from_config(vision.tower.cfg, vision.processor.max_pixels)


def _load_vision(path: Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, *, mmproj: str = "",
                 tokenizer: Tokenizer | None = None) -> VisionModel | None:
    """The vision tower of an HF folder that has one (vision_config and model.visual.* weights), or of a GGUF file
    from its mmproj file (`mmproj`, or the one beside it: engine/model/gguf_mmproj.py), dense in the model's
    activation dtype; None for text-only models and folders whose image processor (preprocessor_config.json) is
    missing or malformed (said in the log)."""
    if mmproj and path.is_dir():
        raise NInferError(f"--mmproj {mmproj}: {path.name} is a model folder, its vision tower in its own weights.",
                          "Drop --mmproj: it names the vision projector of a GGUF model file.")
    try:
        vision = VisionModel.from_folder(path, dtype, device) if path.is_dir() else \
            load_mmproj_vision(path, mmproj, cfg.hidden_size, tokenizer, dtype, device)
    except ImageInputError as e:  # the tower without its image processor: the text model still serves
        log.warning("%s: the vision tower is not loaded, requests with images are refused: %s", path.name, e)
        return None
    if vision is not None:
        if not cfg.mrope_section:
            where, fix = ("config.json", "Download the model folder's config.json again.") if path.is_dir() else \
                ("GGUF (no rope.dimension_sections)", "Convert the model again with a current llama.cpp, or serve it "
                 "without its mmproj file, text only.")
            raise NInferError(f"{path.name} has a vision tower, but its text config in the {where} has no "
                              f"mrope_section: image positions cannot be rotated.", fix)
        log.info("vision tower: %d blocks, %s; images in prompts are read", vision.tower.cfg.depth,
                 str(dtype).removeprefix("torch."))
    return vision


@in_own_thread
def assemble_engine(model: LoadedModel, config: EngineConfig | None = None, **settings: Any) -> LoadedEngine:
    """An engine over a loaded model: its sequence memory sized by the ledger, its runner, speculator and Engine.
    `config` must agree with the model's on MODEL_FIELDS (default: the model's own settings); several engines may be
    assembled over one model, one running at a time (they share its layers' scratch buffers)."""
    c = (config or model.settings).replace(**settings)
    differ = [f for f in MODEL_FIELDS if getattr(c, f) != getattr(model.settings, f)]
    if differ:
        raise ValueError(f"assemble_engine: {', '.join(differ)} differ from the settings the model was loaded with; "
                         f"load the model again (load_model) for those")
    t0 = time.perf_counter()
    cfg, dev, net, fmt = model.config, model.device, model.net, model.weight_format
    if c.max_context > cfg.max_position:
        raise NInferError(f"--max-context {c.max_context} is beyond this model's trained context of "
                          f"{cfg.max_position} tokens.", f"Use --max-context {cfg.max_position} or less (0 = the model's).")
    ledger = size_kv(cfg, dev, c.replace(kv_dtype=model.kv_name), net.cache_specs, model.vision)
    context, pages, host_pages = ledger.max_context, ledger.gpu_pages, ledger.host_pages
    log.info("KV: %d pages of %s (%s), %d host pages, context %d tokens", pages, ledger.kv_dtype,
             "auto" if ledger.kv_auto else "--kv-capacity", host_pages, context)
    if c.host_kv_mib and not host_pages:
        raise NInferError(f"--host-kv-mib {c.host_kv_mib} holds no KV page of this model "
                          f"({ledger.page_bytes / 2**20:.2f} MiB a page).",
                          f"Raise --host-kv-mib to at least {-(-ledger.page_bytes // 2**20)}.")
    snapshots = state_snapshots(c.max_concurrency, c.max_shared_prefixes != 0)  # recurrent layers' state (the ledger's)
    # on the CPU, --cpu-compile auto or step also takes the dense prompt path (linear.DenseScratch): float32
    # products, about 2x the low-bit kernels' speed from 64 rows on an AVX2 CPU (docs/KERNELS.md)
    dense_prefill = c.prefill_cublas or bool(dev.type == "cpu" and fmt and c.cpu_compile != "off")
    runner = ModelRunner(net, pages, model.kv_dtype, PAGE_SIZE, host_pages=host_pages,
                         host_pinned=not c.host_pageable, prefill_cublas=dense_prefill, cuda_graphs=c.cuda_graphs,
                         state_slots=state_slots(c.max_concurrency, c.speculative),
                         max_batch=c.max_concurrency, cpu_step=c.cpu_compile == "step" and dev.type == "cpu",
                         cpu_fused=c.cpu_compile == "auto" and dev.type == "cpu")
    if dense_prefill:
        log.info("prefill: low-bit layers run chunks of %d+ rows as dense matmuls%s%s", dense_prefill_rows(dev),
                 f" in {str(dense_cpu_dtype()).split('.')[-1]}" if dev.type == "cpu" else "",
                 "" if fmt else " (the weights are dense: nothing to do)")
    speculator = make_speculator(c, target=net, runner=runner, tokenizer=model.tokenizer, target_path=model.path,
                                 mtp_weights=model.mtp_tensors)
    if speculator is not None:
        log.info("speculative decoding: %s, up to %d draft tokens", speculator.method, speculator.max_draft)
    engine = Engine(runner, c.replace(max_context=context), eos_ids=model.tokenizer.eos_token_ids,
                    speculator=speculator, state_snapshots=snapshots, vision=model.vision,
                    model_name=model.path.name)
    return LoadedEngine(engine, model.tokenizer, cfg, model.path, dev, model.dtype,
                        model.load_seconds + time.perf_counter() - t0, ledger, model.storage)


def build_engine(model: str | Path | None = None, config: EngineConfig | None = None, *,
                 progress: Progress | None = None, cancel: threading.Event | None = None,
                 **settings: Any) -> LoadedEngine:
    """Loads the model and builds its engine under `config` (engine/config/engine_config.py; keyword `settings` change
    single fields of it, e.g. build_engine(path, max_context=1024)): load_model, then assemble_engine."""
    c = (config or EngineConfig()).replace(**settings)
    loaded = load_model(model, c, progress=progress, cancel=cancel)
    _warming(progress, "sizing the KV cache and building the engine")
    engine = assemble_engine(loaded, c)
    loaded.mtp_tensors = {}  # the speculator holds what it took
    return engine
