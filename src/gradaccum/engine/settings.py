"""The precision the engine trains in: settings component (no torch)."""

from __future__ import annotations

from dataclasses import dataclass

from gradaccum.settings.field import setting
from gradaccum.utils.choices import PRECISIONS


@dataclass
class PrecisionSettings:
    """precision"""

    precision: str = setting("fp32", "choice", choices=PRECISIONS)
    """fp32; bf16 or fp16 mixed precision (autocast; fp16 adds loss scaling); gradients
    always accumulate in fp32."""
