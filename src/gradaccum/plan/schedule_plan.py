"""A batch-size schedule planned: each phase's steps, tokens, time and LR. Pure arithmetic.

The phases come from `batch_schedule.phases` (one k each); here each gets the time of its
steps at that k, from the plan's own time per step, and the LR its batch calls for under the
chosen rule (the given LR belongs to the schedule's last batch).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gradaccum.plan.batch_schedule import BatchSchedule, phases


@dataclass
class PhasePlan:
    """One phase of equal k, with its cost; tokens are counted over all devices."""

    start_tokens: int
    """Tokens seen when the phase begins."""
    end_tokens: int
    """Tokens seen when it ends: start_tokens + tokens."""
    accum_steps: int
    """k: micro-batches per device per optimizer step."""
    tokens_per_step: int
    """micro tokens x k x world."""
    steps: int
    """Optimizer steps in the phase."""
    tokens: int
    """Tokens trained on in the phase: steps x tokens_per_step."""
    time_s: float | None
    """Wall-clock seconds: steps x the time of one step at this k; None when no time is known."""
    lr_factor: float
    """The given LR's multiplier in this phase (1 under rule none)."""
    lr: float | None
    """--base-lr x lr_factor; None without --base-lr."""


@dataclass
class SchedulePlan:
    """A whole scheduled run, phase by phase, and its totals."""

    schedule: str
    """The schedule as `--batch-schedule` reads it."""
    linear: bool
    """A linear ramp between the points rather than steps."""
    lr_rule: str
    """none | linear | sqrt."""
    phases: list[PhasePlan]
    total_steps: int
    """Optimizer steps of the run: the phases' steps summed."""
    total_tokens: int
    """Tokens of the run: at least the tokens asked for, less than that plus one last step."""
    total_time_s: float | None
    """Wall-clock seconds of the run; None when no time is known."""


StepTime = Callable[[int, int], float | None]
"""(k, tokens per step) -> seconds per optimizer step, or None when no time is known."""


def plan_schedule(
    schedule: BatchSchedule,
    total_tokens: int,
    micro_tokens: int,
    world: int,
    *,
    lr_rule: str,
    base_lr: float | None,
    step_time: StepTime,
) -> SchedulePlan:
    """The run's phases with their tokens, time and LR; `total_tokens` rounds up to whole
    steps, as a plan's --total-tokens does."""
    out = []
    for p in phases(schedule, total_tokens, micro_tokens, world):
        seconds = step_time(p.accum_steps, p.tokens_per_step)
        factor = schedule.lr_factor(p.tokens_per_step, lr_rule, micro_tokens, world)
        out.append(
            PhasePlan(
                start_tokens=p.start_tokens,
                end_tokens=p.end_tokens,
                accum_steps=p.accum_steps,
                tokens_per_step=p.tokens_per_step,
                steps=p.steps,
                tokens=p.steps * p.tokens_per_step,
                time_s=None if seconds is None else p.steps * seconds,
                lr_factor=factor,
                lr=None if base_lr is None else base_lr * factor,
            )
        )
    times = [p.time_s for p in out]
    return SchedulePlan(
        schedule=str(schedule),
        linear=schedule.linear,
        lr_rule=lr_rule,
        phases=out,
        total_steps=sum(p.steps for p in out),
        total_tokens=sum(p.tokens for p in out),
        total_time_s=None if None in times else sum(times),
    )
