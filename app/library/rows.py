"""What the model library window shows in its tables, as text (Qt-free): sizes, parameter counts, times, download
progress, and the model reference the app loads for a hub file or a file on disk."""
from __future__ import annotations

import time

from engine.library.download import DownloadProgress
from engine.library.fit import FITS, FITS_WINDOW, NEEDS_MORE, UNSUPPORTED

from app.library.marks import FITS_EXPERTS


def size_text(n: int) -> str:
    if n >= 2**30:
        return f"{n / 2**30:.2f} GiB"
    if n >= 2**20:
        return f"{n / 2**20:.1f} MiB"
    return f"{n / 2**10:.0f} KiB" if n >= 2**10 else f"{n} B"


def params_text(n: int) -> str:
    if not n:
        return "?"
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.1f}{unit}".replace(".0", "")
    return str(n)


def context_text(n: int) -> str:
    return f"{n:,}" if n else "?"


def last_used_text(when: float | None, now: float | None = None) -> str:
    if when is None:
        return "never"
    ago = max((now or time.time()) - when, 0)
    if ago < 90:
        return "just now"
    if ago < 90 * 60:
        return f"{ago / 60:.0f} min ago"
    if ago < 36 * 3600:
        return f"{ago / 3600:.0f} h ago"
    if ago < 60 * 86400:
        return f"{ago / 86400:.0f} days ago"
    return time.strftime("%Y-%m-%d", time.localtime(when))


def progress_text(p: DownloadProgress) -> str:
    """"41.2 of 98.4 MiB · 12.3 MiB/s · 5 s left"."""
    rate = f"{p.rate / 2**20:.1f} MiB/s" if p.rate > 0 else "starting"
    left = "" if p.eta_s is None else (f" · {p.eta_s:.0f} s left" if p.eta_s < 120 else
                                       f" · {p.eta_s / 60:.0f} min left")
    return f"{p.done / 2**20:.1f} of {p.total / 2**20:.1f} MiB · {rate}{left}"


MARK_COLOURS = {FITS: "ok", FITS_WINDOW: "warning", FITS_EXPERTS: "warning", NEEDS_MORE: "error",
                UNSUPPORTED: "error"}  # else: muted


def hub_reference(repo_id: str, quant: str, same_quant: int) -> str | None:
    """The hf: reference that loads a repository's file of ``quant``: None when the name carries no quant or other
    files in the repository share it (the app then loads the file by its path)."""
    return f"hf:{repo_id}:{quant}" if quant and same_quant == 1 else None
