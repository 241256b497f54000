"""Confidence intervals for pass counts (the Wilson score interval, which stays inside 0..1 and behaves at 0 and n
passes, unlike the normal approximation)."""
from __future__ import annotations

import math

Z95 = 1.959963984540054


def wilson(passed: int, total: int, z: float = Z95) -> tuple[float, float]:
    """The 95% (by default) interval of a pass rate observed as ``passed`` of ``total``; (0, 1) for no items."""
    if total <= 0:
        return 0.0, 1.0
    p = passed / total
    centre = (p + z * z / (2 * total)) / (1 + z * z / total)
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / (1 + z * z / total)
    return max(0.0, centre - half), min(1.0, centre + half)


def rate_text(passed: int, total: int) -> str:
    """'12/30 (40.0%, 95% CI 24.6-57.7%)'."""
    lo, hi = wilson(passed, total)
    rate = f"{100 * passed / total:.1f}%" if total else "n/a"
    return f"{passed}/{total} ({rate}, 95% CI {100 * lo:.1f}-{100 * hi:.1f}%)"


def difference(passed_a: int, total_a: int, passed_b: int, total_b: int, z: float = Z95) -> tuple[float, float, float]:
    """B's pass rate minus A's and its 95% interval (Newcombe's method from the two Wilson intervals; it treats the
    two runs as independent, which is conservative for runs over the same items)."""
    pa, pb = passed_a / max(total_a, 1), passed_b / max(total_b, 1)
    la, ua = wilson(passed_a, total_a, z)
    lb, ub = wilson(passed_b, total_b, z)
    d = pb - pa
    return d, d - math.sqrt((pb - lb) ** 2 + (ua - pa) ** 2), d + math.sqrt((ub - pb) ** 2 + (pa - la) ** 2)
