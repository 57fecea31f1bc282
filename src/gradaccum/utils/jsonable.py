"""Numbers as JSON can hold them: no torch here (the planner's --json uses it)."""

from __future__ import annotations

import math


def finite(x):
    """`x` with every non-finite float (nan, inf) in it replaced by None, for JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {key: finite(value) for key, value in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite(value) for value in x]
    return x
