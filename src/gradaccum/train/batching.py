"""How many micro-batches each window of a run holds: fixed, by a batch-size schedule over the
tokens seen, or grown toward the measured critical batch (`--batch-schedule auto`).

The micro-batch never changes with the schedule (only an out-of-memory recovery halves it):
k moves, at window boundaries only, so every window is a whole number of micro-batches and
the engine weighs each exactly. Everything k depends on (tokens seen, and for `auto` the
noise scale's averages and the last growth) is in the checkpoint, so a resumed run takes the
same k and the same LR from the same window on.

With a schedule the LR schedule (warmup, then decay) runs over tokens seen, not steps:
steps differ in size, and a ramp of the batch would otherwise stretch or squeeze the decay.
`--warmup-steps` then counts steps of the first phase's batch, and a window in warmup takes
the lr reached at its last token (with a fixed batch, what step-counted warmup gives). On top
of it `--lr-rule` scales the LR with the window's batch (`lr_multiplier`), relative to the
batch the recipe's LR belongs to: a schedule's last one, `auto`'s --max-tokens-per-step.

A policy (`Fixed`, `Scheduled`, `Auto`, from `make_policy`) decides k and returns it; it
keeps no k of its own. The run's batch, `gradaccum.train.batch_state.BatchState`, holds it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gradaccum.plan.batch_schedule import BatchSchedule, k_for, lr_multiplier, phases
from gradaccum.train.batch_request import BatchRequest
from gradaccum.train.config import AUTO, TrainConfig, read_schedule
from gradaccum.train.schedule import Schedule
from gradaccum.utils.errors import BadInput


@dataclass(frozen=True)
class Layout:
    """How a window's micro-steps are cut: `micro_tokens` tokens per micro-batch on each of
    `world` ranks."""

    micro_tokens: int
    world: int

    @property
    def per_micro_step(self) -> int:
        """Tokens all ranks take in one micro-step."""
        return self.micro_tokens * self.world

    def k_for(self, tokens_per_step: float) -> int:
        """The k closest to `tokens_per_step` (`plan.batch_schedule.k_for`)."""
        return k_for(tokens_per_step, self.per_micro_step)


class Fixed:
    """k stays as planned: a run without --batch-schedule (only out of memory changes it).

    A policy decides k and returns it; the run's batch (`BatchState`) holds it. Each method
    takes the k in force (`k`: the next window's as far as known) and the `Layout`."""

    varies = False
    """Whether k may change from window to window."""
    lr_rule = "none"

    def first_k(self, planned: int, layout: Layout) -> int:
        """k of the run's first window, the plan's being `planned`."""
        return planned

    def k_at(self, k: int, tokens_seen: int, layout: Layout) -> int:
        """k of the window that starts after `tokens_seen` tokens."""
        return k

    def grown(self, k: int, step: int, critical_tokens: float | None, layout: Layout) -> int | None:
        """After optimizer step `step`, whose noise scale is `critical_tokens`: the k the
        next windows take, or None where k stays (every policy but `auto`)."""
        return None

    def steps_left(self, k: int, tokens_seen: int, total_tokens: int, layout: Layout) -> int:
        """Optimizer steps from `tokens_seen` until `total_tokens` are trained on, at k."""
        per_step = k * layout.per_micro_step
        return max(0, -(-(total_tokens - tokens_seen) // per_step))

    def reference_tokens_per_step(self, k: int, layout: Layout) -> int:
        """The batch the given LR belongs to."""
        return k * layout.per_micro_step

    def lr_factor(self, k: int, layout: Layout) -> float:
        """The LR multiplier of a window of k micro-steps under --lr-rule."""
        if not self.varies:
            return 1.0
        ratio = k * layout.per_micro_step / self.reference_tokens_per_step(k, layout)
        return lr_multiplier(ratio, self.lr_rule)

    def state_dict(self) -> dict:
        """What a checkpoint keeps of the policy besides k (`BatchState.state_dict`)."""
        return {"last_growth": 0}

    def load_state_dict(self, state: dict) -> None:
        pass


class Scheduled(Fixed):
    """A batch schedule: k = round(target(tokens seen) / (micro tokens x world)), at least 1."""

    varies = True

    def __init__(self, schedule: BatchSchedule, lr_rule: str):
        self.schedule, self.lr_rule = schedule, lr_rule

    def first_k(self, planned: int, layout: Layout) -> int:
        return self.k_at(planned, 0, layout)

    def k_at(self, k: int, tokens_seen: int, layout: Layout) -> int:
        return self.schedule.accum_steps(tokens_seen, layout.micro_tokens, layout.world)

    def steps_left(self, k: int, tokens_seen: int, total_tokens: int, layout: Layout) -> int:
        """Exact, phase by phase, as `plan` counts them."""
        found = phases(self.schedule, total_tokens, layout.micro_tokens, layout.world, tokens_seen)
        return sum(p.steps for p in found)

    def reference_tokens_per_step(self, k: int, layout: Layout) -> int:
        """The schedule's last batch."""
        return self.schedule.final_tokens_per_step(layout.micro_tokens, layout.world)


class Auto(Fixed):
    """`auto`: k starts at the minimum batch and, after a window whose noise-scale estimate
    asks for more, grows to round(estimate / (micro tokens x world)) within the maximum, at
    most doubling once per `double_every` optimizer steps; it never shrinks. Its steps left
    are counted at the present k."""

    varies = True

    def __init__(self, low: int, high: int, double_every: int, lr_rule: str):
        self.low, self.high, self.double_every = low, high, double_every
        """Min and max tokens per step, and optimizer steps per doubling."""
        self.lr_rule = lr_rule
        self.last_growth = 0
        """The optimizer step at which k last grew."""

    def first_k(self, planned: int, layout: Layout) -> int:
        return layout.k_for(self.low)

    def grown(self, k: int, step: int, critical_tokens: float | None, layout: Layout) -> int | None:
        if critical_tokens is None or not math.isfinite(critical_tokens):
            return None
        wanted = layout.k_for(min(max(critical_tokens, self.low), self.high))
        wanted = min(wanted, layout.k_for(self.high))
        if wanted <= k or step - self.last_growth < self.double_every:
            return None
        self.last_growth = step
        return min(wanted, 2 * k)

    def reference_tokens_per_step(self, k: int, layout: Layout) -> int:
        """The largest batch `auto` may grow to."""
        return layout.k_for(self.high) * layout.per_micro_step

    def state_dict(self) -> dict:
        return {"last_growth": self.last_growth}

    def load_state_dict(self, state: dict) -> None:
        self.last_growth = int(state["last_growth"])


def targets(
    config: TrainConfig, request: BatchRequest | None = None
) -> tuple[int | None, int | None, str]:
    """(the first window's tokens per step, the smallest any window takes, the flag that
    set them): a batch schedule's first and smallest targets (`auto`: --min-tokens-per-step),
    else the tokens per step of `request` (a `BatchRequest`; None: the settings'), None when
    k alone sets the batch (`target_tokens_per_step`)."""
    schedule = read_schedule(config.batch_schedule)
    if schedule == AUTO:
        low = config.auto_batch[0]
        return low, low, f"--min-tokens-per-step {low}"
    if schedule is not None:
        flag = f"--batch-schedule {config.batch_schedule}"
        return int(schedule.target(0)), schedule.smallest_target(), flag
    target = (request or config).target_tokens_per_step
    return target, target, f"--tokens-per-step {target}"


def make_policy(config: TrainConfig, layout: Layout) -> Fixed:
    """The k policy of `config` for this layout; BadInput where `auto` cannot estimate."""
    schedule = read_schedule(config.batch_schedule)
    if schedule is None:
        return Fixed()
    if schedule != AUTO:
        return Scheduled(schedule, config.lr_rule)
    low, high, every = config.auto_batch
    if layout.k_for(low) * layout.world < 2:
        raise BadInput(
            "--min-tokens-per-step",
            low,
            f"--batch-schedule auto needs at least 2 micro-batches of {layout.micro_tokens} "
            "tokens per step (over all ranks) to measure the noise scale",
        )
    return Auto(low, high, every, config.lr_rule)


def token_schedule(config: TrainConfig, total_tokens: int, first_tokens_per_step: int) -> Schedule:
    """The LR schedule of a --batch-schedule run, over tokens seen (see the module doc); its
    warmup is --warmup-steps steps of the first window's batch, or as a fixed batch's
    default, a tenth of the run at most (`TrainConfig.warmup`)."""
    warmup = config.warmup(total_tokens, first_tokens_per_step)
    return Schedule(total_tokens, min(warmup, total_tokens), config.schedule)
