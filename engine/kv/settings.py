"""What the KV window settings mean together: the combinations that cannot work (each with its remedy) and the
derived values --print-config explains (window and retrieval pages, a windowed conversation's GPU pages, the
host tier's pages). Read by engine.config; the numbers match engine.kv.window.WindowSpec."""
from __future__ import annotations

import functools
from typing import Any


def kv_tier_problems(v: dict[str, Any], src: dict[str, str]) -> list[str]:
    """The KV window / host tier / ring combinations that cannot work, each with its remedy."""
    out = []
    window, retrieve, ring, host = v["kv_window"], v["kv_retrieve"], v["kv_ring"], v["host_kv_mib"]
    cap, ctx = v["kv_capacity"], v["max_context"]

    def at(*names: str) -> str:  # where the settings came from, each source once
        return "[" + ", ".join(dict.fromkeys(src[n] for n in names)) + "]"

    ringed = window > 0 and ring != "off"
    if isinstance(cap, int) and 0 < cap < ctx and window == 0:
        out.append(f"{at('kv_capacity', 'max_context')} --kv-capacity {cap} is below --max-context {ctx}: a KV cache "
                   f"smaller than the context needs ring mode; set --kv-window (e.g. {min(cap // 2, 16384)}) with "
                   f"--kv-retrieve and --host-kv-mib, or raise --kv-capacity to at least {ctx} (or use auto), or lower "
                   f"--max-context to {cap}")
    if retrieve and window == 0:
        out.append(f"{at('kv_retrieve', 'kv_window')} --kv-retrieve {retrieve} brings older pages back into a window, "
                   f"but --kv-window is 0; set --kv-window (e.g. 4096) or --kv-retrieve 0")
    if retrieve and window and ring == "off":
        out.append(f"{at('kv_retrieve', 'kv_ring')} --kv-retrieve {retrieve} has nothing to bring back with --kv-ring "
                   f"off (the window caps each conversation, nothing older is kept); use --kv-ring auto (with "
                   f"--host-kv-mib) or --kv-retrieve 0")
    if ring == "on" and window == 0:
        out.append(f"{at('kv_ring', 'kv_window')} --kv-ring on needs a window; set --kv-window (e.g. 4096) or "
                   f"--kv-ring auto")
    if ringed and host == 0:
        out.append(f"{at('kv_window', 'host_kv_mib')} --kv-window {window} keeps older pages in host memory, but "
                   f"--host-kv-mib is 0; set --host-kv-mib (e.g. 4096), or --kv-ring off to cap each conversation at "
                   f"the window")
    if host and not ringed and not v["kv_reuse_hostbacked"]:
        why = "--kv-ring is off" if window else "--kv-window is 0"
        out.append(f"{at('host_kv_mib', 'kv_window' if not window else 'kv_ring')} --host-kv-mib {host} is used only "
                   f"by ring mode and by --kv-reuse-hostbacked, and {why}; set --kv-window (with --kv-ring auto) or "
                   f"--kv-reuse-hostbacked, or --host-kv-mib 0")
    if v["kv_reuse_hostbacked"] and host == 0:
        out.append(f"{at('kv_reuse_hostbacked', 'host_kv_mib')} --kv-reuse-hostbacked keeps evicted prefix pages in "
                   f"host memory, but --host-kv-mib is 0; set --host-kv-mib (e.g. 4096) or drop --kv-reuse-hostbacked")
    if v["kv_reuse_hostbacked"] and v["max_shared_prefixes"] == 0:
        out.append(f"{at('kv_reuse_hostbacked', 'max_shared_prefixes')} --kv-reuse-hostbacked extends prefix reuse, "
                   f"but --max-shared-prefixes is 0 (off); set --max-shared-prefixes (or auto) or drop "
                   f"--kv-reuse-hostbacked")
    if ringed and retrieve == 0 and not v["allow_lossy_window"]:
        out.append(f"{at('kv_window', 'kv_retrieve')} --kv-window {window} with --kv-retrieve 0 never attends to "
                   f"context older than the window again, so answers would silently miss it; set --kv-retrieve "
                   f"(e.g. {window}), or pass --allow-lossy-window to accept that")
    if v["host_pageable"] and host == 0:
        out.append(f"{at('host_pageable', 'host_kv_mib')} --host-pageable applies to the host KV tier, but "
                   f"--host-kv-mib is 0; set --host-kv-mib or drop --host-pageable")
    if window and v["spec"] == "mtp":
        out.append(f"{at('spec', 'kv_window')} --spec mtp does not run on windowed KV (its heads run over the target's "
                   f"page table); use --spec ngram or --spec draft, or --kv-window 0")
    if ringed and isinstance(cap, int):
        need = window_footprint(v) * PAGE_TOKENS
        if cap < need:
            out.append(f"{at('kv_capacity', 'kv_window')} --kv-capacity {cap} is below what one windowed conversation "
                       f"holds on the GPU ({need} tokens: {_footprint_text(v)}); raise --kv-capacity to {need} or "
                       f"lower --kv-window / --kv-retrieve / --prefill-chunk")
    return out


PAGE_TOKENS = 64


def window_footprint(v: Any) -> int:
    """GPU pages one windowed conversation holds (engine.kv.window.WindowSpec.footprint, from settings)."""
    get = v.get if isinstance(v, dict) else lambda n: getattr(v, n)
    pages = lambda n: -(-n // PAGE_TOKENS)  # noqa: E731
    return 1 + pages(pages(get("kv_window")) * PAGE_TOKENS + get("prefill_chunk")) + 2 + pages(get("kv_retrieve"))


def _footprint_text(v: Any) -> str:
    get = v.get if isinstance(v, dict) else lambda n: getattr(v, n)
    retrieve = -(-get("kv_retrieve") // PAGE_TOKENS)
    total = window_footprint(v)
    return f"{total} pages: sink 1 + window and step {total - 1 - retrieve} + retrieved {retrieve}"


def kv_note(settings: Any, name: str) -> str:
    window = -(-settings.kv_window // PAGE_TOKENS) * PAGE_TOKENS
    ringed = settings.kv_ring != "off"
    if name == "kv_window":
        if not ringed:
            return f"{window} tokens ({window // PAGE_TOKENS} pages): the most one conversation holds (ring off)"
        return f"{window} tokens ({window // PAGE_TOKENS} pages) recent context on the GPU; {_footprint_text(settings)}"
    if name == "kv_retrieve":
        if not ringed:
            return "unused with --kv-ring off"
        if settings.kv_retrieve == 0:
            return "LOSSY: context older than the window is dropped (--allow-lossy-window)"
        pages = -(-settings.kv_retrieve // PAGE_TOKENS)
        return f"{pages} pages ({pages * PAGE_TOKENS} tokens) per layer and step, chosen by Quest page bounds"
    if name == "kv_reuse_hostbacked":
        return "evicted prefix pages keep a host copy; the host pool gives them up first when sequences need it"
    if name == "kv_ring":
        return {"auto": "windowed once a conversation outgrows the window", "on": "every conversation windowed",
                "off": "a conversation longer than the window is refused (400 context_length_exceeded)"}[
            settings.kv_ring]
    return f"every full page of a windowed conversation written through to host memory; {_host_pages_note(settings)}"


@functools.lru_cache(maxsize=4)
def _model_shape(model: str | None) -> Any:
    from engine.ledger import ModelShape

    return ModelShape.from_path(model)


def _host_pages_note(settings: Any) -> str:
    """The host tier's page count for the model (read from its metadata only), or how to get it."""
    try:
        from engine.hardware import resolve_device
        from engine.ledger import resolve_kv_dtype

        shape = _model_shape(settings.model)
        kv = resolve_kv_dtype(settings.kv_dtype, resolve_device(settings.device) == "cuda")
        page = shape.kv_bytes_per_token(kv) * PAGE_TOKENS
        pages = settings.host_kv_mib * 2**20 // page
        return (f"{pages} pages of {page / 2**20:.2f} MiB ({kv}, {shape.name}): a windowed conversation reaches "
                f"{pages * PAGE_TOKENS} tokens")
    except Exception as e:  # the model cannot be read here: the note says so, loading will report it properly
        return f"page count unknown ({type(e).__name__}: the model could not be read); see ninfer-doctor --ledger"
