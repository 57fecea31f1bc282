"""Learning-rate schedules counted in optimizer steps: linear warmup, then a decay.

The engine steps the scheduler once per window (never per micro-batch), so step s below is the
number of optimizer steps already taken, and the lr used by optimizer step s+1 is `lr_at(s)`.
Changing k changes how many micro-batches make a step, never the schedule.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

SCHEDULES = ("cosine", "linear", "constant")


@dataclass(frozen=True)
class Schedule:
    """Warmup then decay to `min_ratio` of the peak, as a multiplier of the peak lr."""

    total_steps: int
    """Optimizer steps in the whole run; the decay ends here."""
    warmup_steps: int = 0
    """Optimizer steps of linear warmup from lr/warmup_steps up to lr."""
    kind: str = "cosine"
    """"cosine", "linear" (decay to min_ratio) or "constant" (no decay after warmup)."""
    min_ratio: float = 0.1
    """Fraction of the peak lr reached at the last step (cosine and linear)."""
    stretches: tuple = ()
    """(at_step, old_end, new_end) per resume that changed the run's length, oldest first:
    steps before at_step keep the schedule they were trained with; the rest of it, from
    at_step to old_end, is stretched (or squeezed) to end at new_end instead."""

    def __post_init__(self):
        if self.kind not in SCHEDULES:
            raise ValueError(f"schedule {self.kind!r}: choose one of {', '.join(SCHEDULES)}")
        if self.total_steps < 1:
            raise ValueError(f"total_steps {self.total_steps}: must be at least 1")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps {self.warmup_steps}: must be at least 0")
        if not 0.0 <= self.min_ratio <= 1.0:
            raise ValueError(f"min_ratio {self.min_ratio}: must be in [0, 1]")

    def __call__(self, step: int) -> float:
        """The multiplier of the peak lr for the optimizer step after `step` steps taken."""
        t = float(step)
        for at, old_end, new_end in reversed(self.stretches):
            if t > at:  # map this step back onto the curve as it was before the stretch
                t = old_end if old_end <= at else at + (t - at) * (old_end - at) / (new_end - at)
        return lr_at(t, 1.0, self.total_steps, self.warmup_steps, self.kind, self.min_ratio)

    @property
    def end(self) -> int:
        """The step the decay ends at, after every stretch."""
        return self.stretches[-1][2] if self.stretches else self.total_steps

    def stretched(self, at_step: int, new_end: int) -> Schedule:
        """This schedule for a run whose length changes to `new_end` steps at `at_step`."""
        if new_end == self.end:
            return self
        return replace(self, stretches=(*self.stretches, (at_step, self.end, new_end)))

    def state_dict(self) -> dict:
        return {**asdict(self), "stretches": [list(s) for s in self.stretches]}

    @classmethod
    def from_state_dict(cls, state: dict) -> Schedule:
        return cls(**{**state, "stretches": tuple(tuple(s) for s in state["stretches"])})


def lr_at(
    step: float,
    lr: float,
    total_steps: int,
    warmup_steps: int = 0,
    kind: str = "cosine",
    min_ratio: float = 0.1,
) -> float:
    """The learning rate after `step` optimizer steps, for a peak `lr`.

    Warmup: lr * (step + 1) / warmup_steps for step < warmup_steps, so the first step is not
    taken at lr 0. Then, with p = (step - warmup_steps) / (total_steps - warmup_steps) in
    [0, 1]: cosine lr * (m + (1 - m) * (1 + cos(pi p)) / 2), linear lr * (m + (1 - m)(1 - p)),
    constant lr. Past total_steps the lr stays at the end value.
    """
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if kind == "constant":
        return lr
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    if kind == "cosine":
        return lr * (min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress)))
    if kind == "linear":
        return lr * (min_ratio + (1.0 - min_ratio) * (1.0 - progress))
    raise ValueError(f"schedule {kind!r}: choose one of {', '.join(SCHEDULES)}")


def make_scheduler(optimizer, schedule: Schedule):
    """A torch LambdaLR following `schedule`; its state_dict holds only numbers.

    The multiplier is passed as a plain function, which LambdaLR leaves out of its state_dict:
    on resume the schedule comes from the run's config, and the state restores only the step
    count (so a resumed run with a longer --max-steps stretches the decay, as it asks).
    """
    import torch

    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: schedule(step))
