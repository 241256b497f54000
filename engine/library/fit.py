"""Mark a GGUF file for this machine and the chosen settings with the memory ledger, before it is downloaded.

The shape comes from the file's header (fetched from the hub with range requests, or read from a local file): the
same fields ``ninfer-doctor --ledger`` reads from a whole file. Marks:

- ``fits``: the ledger fits with the settings as given (the model's whole context unless --max-context says less);
- ``fits with a KV window``: it fits only in ring mode, recent tokens on the GPU and older ones in host RAM;
- ``needs more memory``: neither fits; ``detail`` carries the ledger's numbers;
- ``architecture not supported``: the engine cannot run this architecture (shown, never hidden);
- ``unknown``: the header could not be read (``detail`` says why).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from engine.library.header import GGUFHeader

FITS, FITS_WINDOW, NEEDS_MORE, UNSUPPORTED, UNKNOWN = (
    "fits", "fits with a KV window", "needs more memory", "architecture not supported", "unknown")
WINDOWS = (32768, 16384, 8192, 4096)  # KV windows tried, largest first


@dataclass(frozen=True)
class FitMark:
    mark: str
    detail: str = ""
    kv_window: int = 0  # with FITS_WINDOW: the window that fits
    host_kv_mib: int = 0  # with FITS_WINDOW: the host KV pool it needs
    context: int = 0  # tokens a conversation can reach with these settings
    weights_bytes: int = 0

    def __str__(self) -> str:
        return f"{self.mark}: {self.detail}" if self.detail else self.mark


def supported_architectures() -> tuple[str, ...]:
    from engine.model.config import GGUF_ARCHS, GGUF_HYBRID_ARCHS

    return tuple(GGUF_ARCHS) + tuple(GGUF_HYBRID_ARCHS)


def runs_experts(h: GGUFHeader) -> bool:
    """False for a file with experts in an architecture whose MoE layers this engine does not run (a Mixtral as
    'llama'); the MoE architectures it runs are GGUF_MOE_ARCHS (qwen35moe, qwen3next)."""
    from engine.model.config import GGUF_MOE_ARCHS

    return not h.get(f"{h.architecture}.expert_count") or h.architecture in GGUF_MOE_ARCHS


def _first(value: Any) -> Any:
    return max(value) if isinstance(value, (list, tuple)) and value else value


def shape_from_header(h: GGUFHeader, name: str, file_size: int = 0):
    """A ledger ModelShape from a GGUF header (no tensor data needed). Raises LibraryError when a field the ledger
    needs is missing."""
    from engine.ledger import LinearAttention, ModelShape
    from engine.library.hub import LibraryError

    arch = h.architecture

    def get(key: str, default: Any = None) -> Any:
        return h.get(f"{arch}.{key}", default)

    layers, hidden = get("block_count"), get("embedding_length")
    if not layers or not hidden:
        raise LibraryError(f"{name}: the header has no {arch}.block_count / embedding_length.",
                           "The file was converted by an incompatible tool; pick another file.")
    layers, hidden = int(layers), int(hidden)
    mtp = int(get("nextn_predict_layers", 0) or 0)
    main = [t for t in h.tensors if _block(t.name) < layers - mtp or _block(t.name) < 0] if mtp else h.tensors
    heads = int(_first(get("attention.head_count", 0)) or 0)
    kv = get("attention.head_count_kv", heads)
    if isinstance(kv, (list, tuple)):  # hybrids: 0 KV heads on the recurrent layers
        full, kv_heads = sum(1 for n in kv if n), int(max(kv))
    else:
        # a hybrid without the key (qwen3next files of older converters): llama.cpp's default, every fourth layer
        interval = int(get("full_attention_interval", 0) or (4 if get("ssm.time_step_rank") else 0))
        kv_heads, full = int(kv), layers // interval if interval else layers
    head_dim = int(get("attention.key_length", hidden // max(heads, 1)))
    linear = None
    if full < layers:
        v_heads, k_heads = int(get("ssm.time_step_rank", 0)), int(get("ssm.group_count", 0))
        k_dim, inner = int(get("ssm.state_size", 0)), int(get("ssm.inner_size", 0))
        linear = LinearAttention(layers - full, v_heads, k_dim, inner // v_heads if v_heads else 0,
                                 2 * k_heads * k_dim + inner, int(get("ssm.conv_kernel", 4)))
    vocab = int(get("vocab_size", 0) or h.array_lengths.get("tokenizer.ggml.tokens")
                or len(h.get("tokenizer.ggml.tokens", []) or []))
    stored = sum(t.n_bytes for t in main) or file_size
    fmt = "GGUF " + "/".join(sorted({t.type_name for t in main}))
    return ModelShape(name=str(h.get("general.name", name)), layers=layers - mtp if mtp else layers,
                      full_attention_layers=full, kv_heads=kv_heads, head_dim=head_dim, hidden=hidden, vocab=vocab,
                      params=sum(t.n_elements for t in main), heads=heads,
                      intermediate=int(_first(get("feed_forward_length", 0)) or 0),
                      max_position=int(get("context_length", 4096)), stored_bytes=stored, stored_format=fmt,
                      source="gguf", linear=linear, mtp_layers=mtp)


def _block(name: str) -> int:
    parts = name.split(".")
    return int(parts[1]) if len(parts) > 2 and parts[0] == "blk" and parts[1].isdigit() else -1


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def mark_shape(shape, *, vram_mib: int, ram_mib: int, settings: Mapping[str, Any] | None = None) -> FitMark:
    """The mark for a shape under ``settings`` (setting names -> values; None: the engine's defaults)."""
    from engine.ledger import MIB, build_ledger

    s = {k: v for k, v in (settings or {}).items() if v is not None}
    ledger = build_ledger(shape, s, vram_mib=vram_mib, ram_mib=ram_mib)
    weights = ledger.line("weights")
    wbytes = weights.bytes if weights else 0
    if ledger.fits:
        return FitMark(FITS, f"{ledger.max_context:,} tokens, {_gib(ledger.free(ledger.kv_device))} free",
                       context=ledger.reach_tokens, weights_bytes=wbytes)
    first = ledger.check()[0]
    if not s.get("kv_window"):
        best = None  # the largest window whose every page is on the GPU
        for window in WINDOWS:
            if window >= ledger.max_context:
                continue
            need = -(-ledger.max_context * (ledger.page_bytes // ledger.page_size) // MIB) + 1
            tried = build_ledger(shape, dict(s, kv_window=window, kv_retrieve=s.get("kv_retrieve") or 4096,
                                             host_kv_mib=max(int(s.get("host_kv_mib") or 0), need)),
                                 vram_mib=vram_mib, ram_mib=ram_mib)
            if tried.fits:
                best = (window, tried)  # without a full fit, the smallest window that fits
                if tried.reach_gpu_tokens >= window:
                    break
        if best is not None:
            window, tried = best
            on = min(window, tried.reach_gpu_tokens)
            return FitMark(FITS_WINDOW, f"--kv-window {window} --kv-retrieve {tried.settings['kv_retrieve']} "
                                        f"--host-kv-mib {tried.settings['host_kv_mib']}: {ledger.max_context:,} "
                                        f"tokens, the last {on:,} on the {'GPU' if vram_mib else 'KV pool'}",
                           kv_window=window, host_kv_mib=int(tried.settings["host_kv_mib"]),
                           context=tried.reach_tokens, weights_bytes=wbytes)
    return FitMark(NEEDS_MORE, first.message, weights_bytes=wbytes)


def mark_header(h: GGUFHeader, name: str, *, vram_mib: int, ram_mib: int, file_size: int = 0,
                settings: Mapping[str, Any] | None = None) -> FitMark:
    from engine.errors import NInferError

    arch = h.architecture
    if arch not in supported_architectures():
        return FitMark(UNSUPPORTED, f"'{arch or 'unknown'}' (this engine runs {', '.join(supported_architectures())})")
    if not runs_experts(h):
        return FitMark(UNSUPPORTED, f"'{arch}' with mixture-of-experts layers (this engine runs them in qwen35moe "
                                    f"and qwen3next files)")
    try:
        shape = shape_from_header(h, name, file_size)
        return mark_shape(shape, vram_mib=vram_mib, ram_mib=ram_mib, settings=settings)
    except NInferError as e:
        return FitMark(UNKNOWN, str(e))


def mark_hub_file(f, *, vram_mib: int, ram_mib: int, settings: Mapping[str, Any] | None = None) -> FitMark:
    """Marks a hub file (engine.library.hub.HubFile) from its header, fetched with range requests. An architecture
    the hub already reports as unsupported is marked without fetching anything."""
    from engine.library.header import HeaderInvalid, HeaderTruncated, read_remote_header
    from engine.library.hub import auth_headers, file_url

    if f.architecture and f.architecture not in supported_architectures():
        return FitMark(UNSUPPORTED, f"'{f.architecture}' (this engine runs {', '.join(supported_architectures())})")
    if f.split and not f.parts:
        return FitMark(UNKNOWN, f"part {f.split[0]} of {f.split[1]} of a split model whose other parts are not all "
                                f"in the repository")
    try:
        headers = [read_remote_header(file_url(p), auth_headers()) for p in (f.parts or (f,))]
    except (HeaderInvalid, HeaderTruncated) as e:
        return FitMark(UNKNOWN, f"the header of {f.filename} cannot be read ({type(e).__name__} {e})")
    except Exception as e:  # network or HTTP errors: the file stays listed, its mark says why
        return FitMark(UNKNOWN, f"the header of {f.filename} could not be fetched ({type(e).__name__}: {e})")
    h = merged_header(headers)
    return mark_header(h, f.filename, vram_mib=vram_mib, ram_mib=ram_mib, file_size=f.size, settings=settings)


def merged_header(headers: list[GGUFHeader]) -> GGUFHeader:
    """A split model's header: part 1's metadata with every part's tensors."""
    import dataclasses

    if len(headers) == 1:
        return headers[0]
    return dataclasses.replace(headers[0], tensors=[t for h in headers for t in h.tensors])


def machine_memory() -> tuple[int, int]:
    """(VRAM MiB free on the usable GPU or 0, RAM MiB available), as ``ninfer-doctor --ledger`` plans by default."""
    from engine.hardware import probe

    report = probe()
    gpu = report.usable_gpu()
    vram = (gpu.vram_free_mib if gpu.vram_free_mib is not None else gpu.vram_total_mib) if gpu else 0
    return int(vram or 0), int(report.ram_available_mib)
