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
the lr reached at its last token (with a fixed batch, what step-counted warmup gives). On top of it `--lr-rule`
scales the LR with the window's batch (`lr_multiplier`), relative to the batch the recipe's
LR belongs to: a schedule's last one, `auto`'s --max-tokens-per-step.
"""

from __future__ import annotations

import math

from ..plan.batch_schedule import BatchSchedule, k_for, lr_multiplier, phases
from ..utils.errors import BadInput
from .config import AUTO, TrainConfig, read_schedule
from .schedule import Schedule


class Batching:
    """k for the next window. `fixed`: k stays (a run without --batch-schedule). A schedule:
    k = round(target(tokens seen) / (micro tokens x world)), at least 1. `auto`: k starts at
    the minimum batch and, after a window whose noise-scale estimate asks for more, grows to
    round(estimate / (micro tokens x world)) within the maximum, at most doubling once per
    `double_every` optimizer steps; it never shrinks."""

    def __init__(
        self,
        *,
        micro_tokens: int,
        world: int,
        k: int,
        schedule: BatchSchedule | None = None,
        auto: tuple[int, int, int] | None = None,
        lr_rule: str = "none",
    ):
        self.micro_tokens, self.world = micro_tokens, world
        self.schedule, self.lr_rule = schedule, lr_rule
        self.auto = auto
        """(min tokens per step, max tokens per step, steps per doubling) of `auto`."""
        self.k = k
        self.last_growth = 0
        """The optimizer step at which `auto` last grew k."""
        if auto is not None:
            self.k = self._k_for(auto[0])

    @property
    def varies(self) -> bool:
        """Whether k may change from window to window."""
        return self.schedule is not None or self.auto is not None

    @property
    def per_micro_step(self) -> int:
        """Tokens all ranks take in one micro-step."""
        return self.micro_tokens * self.world

    def _k_for(self, tokens_per_step: float) -> int:
        return k_for(tokens_per_step, self.per_micro_step)

    def next_k(self, tokens_seen: int) -> int:
        """k of the window that starts after `tokens_seen` tokens."""
        if self.schedule is not None:
            self.k = self.schedule.accum_steps(tokens_seen, self.micro_tokens, self.world)
        return self.k

    def after_window(self, step: int, critical_tokens: float | None) -> bool:
        """`auto`: grow k toward `critical_tokens` (the noise scale after optimizer step
        `step`) when allowed; whether k changed."""
        if self.auto is None or critical_tokens is None or not math.isfinite(critical_tokens):
            return False
        low, high, every = self.auto
        wanted = min(self._k_for(min(max(critical_tokens, low), high)), self._k_for(high))
        if wanted <= self.k or step - self.last_growth < every:
            return False
        self.k, self.last_growth = min(wanted, 2 * self.k), step
        return True

    def reference_tokens_per_step(self) -> int:
        """The batch the given LR belongs to: a schedule's last, `auto`'s largest."""
        if self.auto is not None:
            return self._k_for(self.auto[1]) * self.per_micro_step
        if self.schedule is not None:
            return self.schedule.final_tokens_per_step(self.micro_tokens, self.world)
        return self.k * self.per_micro_step

    def lr_factor(self) -> float:
        """The LR multiplier of the next window's batch under --lr-rule."""
        if not self.varies:
            return 1.0
        ratio = self.k * self.per_micro_step / self.reference_tokens_per_step()
        return lr_multiplier(ratio, self.lr_rule)

    def set_micro_tokens(self, micro_tokens: int, k: int) -> None:
        """After out of memory: a smaller micro-batch, and k for the same tokens per step."""
        self.micro_tokens, self.k = micro_tokens, k

    def steps_left(self, tokens_seen: int, total_tokens: int) -> int:
        """Optimizer steps from `tokens_seen` until `total_tokens` are trained on: exact for
        a schedule (phase by phase, as `plan` counts them), at the present k for `auto`."""
        if self.schedule is not None:
            found = phases(self.schedule, total_tokens, self.micro_tokens, self.world, tokens_seen)
            return sum(p.steps for p in found)
        per_step = self.k * self.per_micro_step
        return max(0, -(-(total_tokens - tokens_seen) // per_step))

    def state_dict(self) -> dict:
        return {"k": self.k, "last_growth": self.last_growth}

    def load_state_dict(self, state: dict) -> None:
        if self.auto is not None:
            self.k, self.last_growth = int(state["k"]), int(state["last_growth"])


def targets(config: TrainConfig) -> tuple[int | None, int | None, str]:
    """(the first window's tokens per step, the smallest any window takes, the flag that
    set them): a batch schedule's first and smallest targets (`auto`: --min-tokens-per-step),
    else --tokens-per-step (`TrainConfig.target_tokens_per_step`: None when --accum-steps
    alone sets the batch)."""
    schedule = read_schedule(config.batch_schedule)
    if schedule == AUTO:
        low = config.auto_batch[0]
        return low, low, f"--min-tokens-per-step {low}"
    if schedule is not None:
        flag = f"--batch-schedule {config.batch_schedule}"
        return int(schedule.target(0)), schedule.smallest_target(), flag
    target = config.target_tokens_per_step
    return target, target, f"--tokens-per-step {target}"


def make_batching(config: TrainConfig, micro_batch: int, world: int, k: int) -> Batching:
    """The Batching of `config` for this layout; BadInput where `auto` cannot estimate."""
    schedule = read_schedule(config.batch_schedule)
    micro_tokens = micro_batch * config.seq_len
    if schedule is None:
        return Batching(micro_tokens=micro_tokens, world=world, k=k)
    if schedule != AUTO:
        return Batching(
            micro_tokens=micro_tokens, world=world, k=k, schedule=schedule, lr_rule=config.lr_rule
        )
    auto = config.auto_batch
    low = auto[0]
    batching = Batching(
        micro_tokens=micro_tokens, world=world, k=k, auto=auto, lr_rule=config.lr_rule
    )
    if batching.k * world < 2:
        raise BadInput(
            "--min-tokens-per-step",
            low,
            f"--batch-schedule auto needs at least 2 micro-batches of {micro_tokens} tokens per "
            "step (over all ranks) to measure the noise scale",
        )
    return batching


def token_schedule(config: TrainConfig, total_tokens: int, first_tokens_per_step: int) -> Schedule:
    """The LR schedule of a --batch-schedule run, over tokens seen (see the module doc); its
    warmup is --warmup-steps steps of the first window's batch, or as a fixed batch's
    default, a tenth of the run at most (`TrainConfig.warmup`)."""
    warmup = config.warmup(total_tokens, first_tokens_per_step)
    return Schedule(total_tokens, min(warmup, total_tokens), config.schedule)
