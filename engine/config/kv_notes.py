"""What the KV window settings mean together, for engine.config.loading: the combinations that cannot work (each with its
remedy and sources) and the derived values --print-config explains (window and retrieval pages, a windowed
conversation's GPU pages, the host tier's pages). The numbers come from engine.memory.geometry."""
from __future__ import annotations

from typing import Any, Callable

from engine.memory.geometry import PAGE_SIZE, WindowSpec, resolve_kv_dtype, tier_problems


def kv_tier_problems(v: dict[str, Any], src: dict[str, str]) -> list[str]:
    """The KV window / host tier / ring combinations that cannot work (engine.memory.geometry.tier_problems), each
    with its remedy and where its settings came from."""
    return [f"[{', '.join(dict.fromkeys(src[n] for n in p.settings))}] {p}" for p in tier_problems(v)]


def kv_note(settings: Any, name: str, model_shape: Callable[[], Any] | None = None) -> str:
    """The --print-config note on a KV-tier setting (`model_shape`: the model's ledger shape, for the host tier's
    page count)."""
    spec = WindowSpec.from_settings(settings)
    window, ringed = spec.window, settings.kv_ring != "off"
    if name == "kv_window":
        if not ringed:
            return f"{window} tokens ({window // PAGE_SIZE} pages): the most one conversation holds (ring off)"
        return f"{window} tokens ({window // PAGE_SIZE} pages) recent context on the GPU; {spec.footprint_text()}"
    if name == "kv_retrieve":
        if not ringed:
            return "unused with --kv-ring off"
        if settings.kv_retrieve == 0:
            return "LOSSY: context older than the window is dropped (--allow-lossy-window)"
        return (f"{spec.retrieve_pages} pages ({spec.retrieve} tokens) per layer and step, chosen by Quest page "
                f"bounds")
    if name == "kv_reuse_hostbacked":
        return "evicted prefix pages keep a host copy; the host pool gives them up first when sequences need it"
    if name == "kv_ring":
        return {"auto": "windowed once a conversation outgrows the window", "on": "every conversation windowed",
                "off": "a conversation longer than the window is refused (400 context_length_exceeded)"}[
            settings.kv_ring]
    return (f"every full page of a windowed conversation written through to host memory; "
            f"{_host_pages_note(settings, model_shape)}")


def _host_pages_note(settings: Any, model_shape: Callable[[], Any] | None) -> str:
    """The host tier's page count for the model (`model_shape()`: its ledger shape, read from its metadata only), or
    how to get it."""
    if model_shape is None:
        return "ninfer-doctor --ledger counts its pages for the model"
    try:
        from engine.hardware import resolve_device

        shape = model_shape()
        kv = resolve_kv_dtype(settings.kv_dtype, resolve_device(settings.device) == "cuda")
        page = shape.kv_bytes_per_token(kv) * PAGE_SIZE
        pages = settings.host_kv_mib * 2**20 // page
        return (f"{pages} pages of {page / 2**20:.2f} MiB ({kv}, {shape.name}): a windowed conversation reaches "
                f"{pages * PAGE_SIZE} tokens")
    except Exception as e:  # the model cannot be read here: the note says so, loading will report it properly
        return f"page count unknown ({type(e).__name__}: the model could not be read); see ninfer-doctor --ledger"
