"""What `gradaccum fit` searches within: settings component (no torch)."""

from __future__ import annotations

from dataclasses import dataclass

from gradaccum.settings.field import setting
from gradaccum.utils.errors import BadInput
from gradaccum.utils.sizes import parse_bytes

MAX_TOLERANCE = 0.5
"""The most --batch-tolerance takes: a batch half again or half the target is another recipe."""


def read_tolerance(value, flag: str) -> float:
    """--batch-tolerance as a fraction: 0.05 or 5%, from 0 to MAX_TOLERANCE."""
    body = str(value).strip()
    percent = body.endswith("%")
    try:
        fraction = float(body[:-1] if percent else body) / (100 if percent else 1)
    except ValueError:
        raise BadInput(flag, value, "expected a fraction: 0.05 or 5%") from None
    if not 0 <= fraction <= MAX_TOLERANCE:  # NaN fails this too
        raise BadInput(flag, value, f"must be from 0 to {MAX_TOLERANCE:.0%}")
    return fraction


def read_budget(value, flag: str) -> int:
    """Bytes: 80GB (1e9 bytes), 64GiB; a bare number is GB."""
    return parse_bytes(str(value), flag, bare_unit=10**9)


@dataclass
class FitSettings:
    """the search"""

    batch_tolerance: float | None = setting(None, parse=read_tolerance, metavar="X",
                                            default_text="5%")  # fmt: skip
    """How far the global batch may land from the target when that is faster: 0.05 or 5%;
    0 insists on the target."""
    memory_budget: int | None = setting(None, parse=read_budget, metavar="SIZE")
    """Memory a micro-batch may use: 1GB, 20GiB; a bare number is GB (default: the device's)."""
    max_seconds: float | None = setting(None, "float", above=True, metavar="T")
    """End probing and timing after this many seconds."""
    no_checkpointing: bool = setting(False, "bool")
    """Do not try activation checkpointing."""
