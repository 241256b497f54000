"""Small helpers shared by the Triton modules (no triton import here)."""
from __future__ import annotations


def is_interpreted(kernel) -> bool:
    """True when `kernel` was decorated under TRITON_INTERPRET=1 (the decision is made once, at import time), so the
    wrapper picks interpreter-friendly launch parameters: big blocks, small grids, IEEE float32 dots."""
    return type(kernel).__name__ == "InterpretedFunction"
