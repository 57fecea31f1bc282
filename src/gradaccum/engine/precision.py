"""Precision as an object: which autocast dtype a window runs in, and the fp16 loss scaler."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from gradaccum.utils.choices import PRECISIONS

_AUTOCAST = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def autocast_dtype(precision: str) -> torch.dtype | None:
    """The autocast dtype for a precision name; None for fp32 (no autocast)."""
    if precision not in _AUTOCAST:
        raise ValueError(f"precision {precision!r}: expected one of {', '.join(PRECISIONS)}")
    return _AUTOCAST[precision]


@dataclass
class LossScaler:
    """Dynamic loss scaling for fp16, the same rule as `torch.amp.GradScaler`.

    Every backward runs on `loss * scale`. The engine unscales the window's summed gradient
    once, checks it for inf/NaN, and calls `update`: a window with a non-finite gradient
    multiplies the scale by `backoff_factor` (and is skipped); `growth_interval` finite
    windows in a row multiply it by `growth_factor`. The engine owns unscaling because its
    fp32 accumulation buffers are not `.grad` tensors that GradScaler could see.
    """

    scale: float = 2.0**16
    """Current multiplier applied to the loss before backward."""
    growth_factor: float = 2.0
    """Multiplier after `growth_interval` finite windows in a row."""
    backoff_factor: float = 0.5
    """Multiplier after a window with a non-finite gradient."""
    growth_interval: int = 2000
    """Finite windows in a row before the scale grows."""
    enabled: bool = True
    """When False the scale stays 1 and update() does nothing (fp32/bf16)."""
    _good_windows: int = field(default=0, repr=False)

    def __post_init__(self):
        if not self.enabled:
            self.scale = 1.0
        if self.scale <= 0 or self.growth_factor <= 1 or not 0 < self.backoff_factor < 1:
            raise ValueError(
                f"loss scaler: scale {self.scale} must be > 0, growth_factor "
                f"{self.growth_factor} > 1, backoff_factor {self.backoff_factor} in (0, 1)"
            )

    def update(self, found_inf: bool) -> None:
        if not self.enabled:
            return
        if found_inf:
            self.scale *= self.backoff_factor
            self._good_windows = 0
            return
        self._good_windows += 1
        if self._good_windows >= self.growth_interval:
            self.scale *= self.growth_factor
            self._good_windows = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_windows": self._good_windows}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self._good_windows = int(state["good_windows"])


def is_low_precision(dtype: torch.dtype) -> bool:
    return dtype in (torch.bfloat16, torch.float16)
