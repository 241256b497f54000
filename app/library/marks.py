"""Fit marks for the models on this computer (Qt-free): the memory ledger's mark (engine/library/fit.py), with this
machine's memory and the launcher's settings, for each file on disk; and a mixture-of-experts model that does not fit
the GPU whole is marked with --fit's plan (engine/ledger/placement.py, what the engine does at load) when experts in
host memory let it fit. The shape is read as ``ninfer-doctor --ledger`` reads it (metadata only, no weights)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from engine.library.fit import FITS, UNKNOWN, UNSUPPORTED, FitMark
from engine.library.local import LocalModel

FITS_EXPERTS = "fits with host experts"


def mark_model_shape(shape, *, vram_mib: int, ram_mib: int, settings: Mapping[str, Any] | None = None) -> FitMark:
    """The ledger's mark for ``shape``; on a GPU, a MoE model that does not fit whole gets --fit's plan instead
    (where the settings leave the experts to --fit: fit on, neither cpu_moe nor n_cpu_moe)."""
    from engine.ledger.placement import fit_experts
    from engine.library.fit import mark_shape

    s = {k: v for k, v in (settings or {}).items() if v is not None}
    mark = mark_shape(shape, vram_mib=vram_mib, ram_mib=ram_mib, settings=s)
    to_fit = s.get("fit", True) and not s.get("cpu_moe") and not s.get("n_cpu_moe")
    if mark.mark == FITS or not (vram_mib and shape.moe_layers and to_fit):
        return mark
    plan = fit_experts(shape, s, vram_mib=vram_mib, ram_mib=ram_mib)
    if not plan.host_layers:  # None: nothing fits (the ledger's mark says by how much); 0: it fitted whole
        return mark
    return FitMark(FITS_EXPERTS, f"{plan.context:,} tokens: {plan.why}", context=plan.context,
                   weights_bytes=mark.weights_bytes)


def _shape(m: LocalModel):
    from engine.ledger import ModelShape
    from engine.library.fit import merged_header, shape_from_header
    from engine.library.header import read_local_header

    if m.parts:  # a split model: every part's tensors (its parts are merged into one file only when loaded)
        header = merged_header([read_local_header(p) for p in m.parts])
        return shape_from_header(header, m.name, m.size)
    return ModelShape.from_path(m.path)


def mark_local(m: LocalModel, *, vram_mib: int, ram_mib: int, settings: Mapping[str, Any] | None = None) -> FitMark:
    """The mark of a model on disk (read on a worker thread: its header is parsed)."""
    from engine.errors import NInferError

    if m.problem:
        return FitMark(UNKNOWN, m.problem)
    if not m.supported:
        return FitMark(UNSUPPORTED, f"this engine cannot run the {m.architecture or 'unknown'} architecture")
    try:
        return mark_model_shape(_shape(m), vram_mib=vram_mib, ram_mib=ram_mib, settings=settings)
    except (NInferError, OSError, ValueError) as e:
        return FitMark(UNKNOWN, f"{type(e).__name__}: {e}" if not isinstance(e, NInferError) else str(e))


def memory_text(vram_mib: int, ram_mib: int) -> str:
    """"for 0 MiB VRAM free (no GPU) and 16,000 MiB RAM available": what the marks were planned on."""
    gpu = f"{vram_mib:,} MiB VRAM free" if vram_mib else "no GPU"
    return f"for {gpu} and {ram_mib:,} MiB RAM available now, with the launcher's settings"


def same_file(m: LocalModel, path: str | Path | None) -> bool:
    """Whether ``m`` is the model file ``path`` (a split model: the file its parts were merged into)."""
    if path is None:
        return False
    try:
        target = Path(path).resolve()
        if m.parts:
            from engine.library.split import merged_path

            return merged_path(list(m.parts)).resolve() == target
        return m.path.resolve() == target
    except OSError:
        return False
