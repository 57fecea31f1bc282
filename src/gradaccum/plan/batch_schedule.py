"""A batch-size schedule: tokens per step as a function of tokens seen, realised through k.

`--batch-schedule "0:32k,1B:256k,10B:4M"` reads as: from 0 tokens seen, 32k tokens per
optimizer step; from 1B, 256k; from 10B, 4M (step-wise). With a `linear:` prefix the tokens
per step ramp linearly between the points and stay at the last one after it. The micro-batch
never changes: at every window boundary k = round(target / (micro tokens x world)), at least
1, so the batch a window really has is a whole number of micro-batches. Pure arithmetic, no
torch.

LR rule when the batch changes (`--lr-rule`): `none` keeps the LR; `linear` multiplies it by
batch / final batch (SGD), `sqrt` by its square root (Adam). The given LR belongs to the
schedule's last (largest) batch, the one the recipe's LR is usually tuned for.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gradaccum.utils.errors import BadInput
from gradaccum.utils.sizes import fmt_count_exact, parse_count

LR_RULES = ("none", "linear", "sqrt")


def lr_multiplier(batch_ratio: float, rule: str) -> float:
    """The LR's multiplier when the batch is `batch_ratio` times the one the LR was tuned at:
    1 (none), the ratio (linear) or its square root (sqrt)."""
    if rule not in LR_RULES:
        raise BadInput("--lr-rule", rule, f"choose one of {', '.join(LR_RULES)}")
    if rule == "none":
        return 1.0
    return batch_ratio if rule == "linear" else math.sqrt(batch_ratio)


def k_for(tokens_per_step: float, per_micro_step: int) -> int:
    """Micro-batches per rank that come closest to `tokens_per_step` when each micro-step
    takes `per_micro_step` tokens over all ranks: round(tokens / per micro-step), at least 1."""
    return max(1, math.floor(tokens_per_step / per_micro_step + 0.5))


@dataclass(frozen=True)
class BatchSchedule:
    """Points (tokens seen, tokens per step), sorted by tokens seen, the first at 0."""

    points: tuple[tuple[int, int], ...]
    """(tokens seen from which it applies, target tokens per optimizer step)."""
    linear: bool = False
    """Ramp linearly between points instead of stepping."""

    def target(self, tokens_seen: int) -> float:
        """Target tokens per step once `tokens_seen` tokens have been trained on."""
        pts = self.points
        i = max(j for j, (start, _) in enumerate(pts) if start <= tokens_seen)
        if not self.linear or i == len(pts) - 1:
            return float(pts[i][1])
        (x0, y0), (x1, y1) = pts[i], pts[i + 1]
        return y0 + (y1 - y0) * (tokens_seen - x0) / (x1 - x0)

    def accum_steps(self, tokens_seen: int, micro_tokens: int, world: int = 1) -> int:
        """k for the next window: round(target / (micro tokens x world)), at least 1."""
        return k_for(self.target(tokens_seen), micro_tokens * world)

    def final_tokens_per_step(self, micro_tokens: int, world: int = 1) -> int:
        """Tokens per step after the last point: the batch the given LR belongs to."""
        return self.accum_steps(self.points[-1][0], micro_tokens, world) * micro_tokens * world

    def lr_factor(self, tokens_per_step: int, rule: str, micro_tokens: int, world: int) -> float:
        """The LR multiplier for a window of `tokens_per_step` tokens (see the module doc)."""
        return lr_multiplier(
            tokens_per_step / self.final_tokens_per_step(micro_tokens, world), rule
        )

    def smallest_target(self) -> int:
        """The smallest target tokens per step anywhere in the run (a ramp's ends bound it)."""
        return min(per_step for _, per_step in self.points)

    def __str__(self) -> str:
        """The schedule as the flag reads it: `0:32k,1B:256k` (`linear:` first for a ramp)."""
        text = ",".join(f"{fmt_count_exact(a)}:{fmt_count_exact(b)}" for a, b in self.points)
        return ("linear:" if self.linear else "") + text


def parse_batch_schedule(text: str, flag: str = "--batch-schedule") -> BatchSchedule:
    """`0:32k,1B:256k,10B:4M` or `linear:0:32k,10B:4M`; BadInput naming the flag if not."""
    body = str(text).strip()
    linear = body.startswith("linear:")
    if linear:
        body = body[len("linear:") :]
    points = []
    for part in body.split(","):
        seen, sep, per_step = part.strip().partition(":")
        if not sep:
            raise BadInput(flag, text, f"'{part.strip()}' is not TOKENS_SEEN:TOKENS_PER_STEP")
        points.append((parse_count(seen, flag, allow_zero=True), parse_count(per_step, flag)))
    starts = [seen for seen, _ in points]
    if starts[0] != 0:
        raise BadInput(flag, text, "the first point must start at 0 tokens seen")
    if any(b <= a for a, b in zip(starts, starts[1:], strict=False)):
        raise BadInput(flag, text, "tokens seen must increase from point to point")
    return BatchSchedule(tuple(points), linear)


@dataclass(frozen=True)
class Phase:
    """A stretch of the run with one k (step-wise schedules: one point to the next)."""

    start_tokens: int
    """Tokens seen when the phase begins."""
    end_tokens: int
    """Tokens seen when it ends (the run's end for the last phase)."""
    accum_steps: int
    """k in the phase (the first window's, for a linear ramp)."""
    tokens_per_step: int
    """Tokens per optimizer step in the phase (micro tokens x k x world)."""
    steps: int
    """Optimizer steps in the phase."""


def phases(
    schedule: BatchSchedule, total_tokens: int, micro_tokens: int, world: int = 1, start: int = 0
) -> list[Phase]:
    """The run's phases of equal k from `start` tokens seen (a run's beginning, or where a
    run stands), with their steps and tokens: window by window on a linear ramp, in one jump
    where the target is constant up to the next point."""
    out: list[Phase] = []
    seen = start
    while seen < total_tokens:
        k = schedule.accum_steps(seen, micro_tokens, world)
        tps = k * micro_tokens * world
        start, steps = seen, 0
        while seen < total_tokens and schedule.accum_steps(seen, micro_tokens, world) == k:
            limit = min(total_tokens, _constant_until(schedule, seen, k, micro_tokens * world))
            jump = max(1, -(-(limit - seen) // tps))
            seen += jump * tps
            steps += jump
        out.append(Phase(start, seen, k, tps, steps))
    return out


def _constant_until(schedule: BatchSchedule, seen: int, k: int, per_micro_step: int) -> int:
    """Tokens seen up to which k stays `k`: the next point, or on a ramp the point where
    the rounded target reaches k +- 1 (found in closed form, so a long ramp costs little)."""
    later = [start for start, _ in schedule.points if start > seen]
    if not later:
        return 2**62
    if not schedule.linear:
        return later[0]
    i = max(j for j, (start, _) in enumerate(schedule.points) if start <= seen)
    (x0, y0), (x1, y1) = schedule.points[i], schedule.points[i + 1]
    if y1 == y0:
        return x1
    slope = (y1 - y0) / (x1 - x0)
    edge = (k + 0.5 if slope > 0 else k - 0.5) * per_micro_step
    crossing = x0 + (edge - y0) / slope
    return max(seen + 1, min(x1, math.floor(crossing)))
