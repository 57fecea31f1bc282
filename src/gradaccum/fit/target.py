"""The global batch `gradaccum fit` aims at (`Target`: tokens per optimizer step, and the k a
micro-batch gives) and how far its choice may stray: from the target's tokens (EXACT,
BATCH_TOLERANCE), and from the fastest size within measurement noise (NOISE_FLOOR, MAX_NOISE).
No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass

from gradaccum.plan import accum_steps_for

NOISE_FLOOR = 0.03
"""Relative tokens/s difference under which two candidates count as equally fast."""
MAX_NOISE = 0.05
"""The most that measurement noise may excuse: a candidate 5% slower than the fastest never
counts as equally fast, however noisy the machine (so the choice runs at >= 0.95x it)."""

EXACT = 0.01
"""A global batch within 1% of the target lands on it (the plan warns past this)."""
BATCH_TOLERANCE = 0.05
"""--batch-tolerance by default: how far the global batch may be from the target when that
buys speed. Under the square-root LR rule a batch 5% off would want an LR 2.5% off, far
inside the resolution LR is tuned at (grids step by 2x or 3x), and 5% of a recipe's batch is
less than recipes round their own batches by (262k for 250k, 4M for 4Mi)."""


@dataclass(frozen=True)
class Target:
    """The tokens per optimizer step asked for, and what one sequence per rank adds to a
    micro-step: k = round(tokens / (micro x per_micro)), at least 1, `gradaccum plan`'s rule."""

    tokens: int
    """Tokens per optimizer step, all ranks together."""
    per_micro: int
    """seq_len x world: tokens one sequence on every rank adds to a micro-step."""

    def accum_steps(self, micro_batch: int) -> int:
        return accum_steps_for(self.tokens, micro_batch * self.per_micro)

    def global_tokens(self, micro_batch: int) -> int:
        """micro x seq_len x k x world: the tokens per step this micro-batch gives."""
        return micro_batch * self.per_micro * self.accum_steps(micro_batch)

    def deviation(self, micro_batch: int) -> float:
        """(global - target) / target, a signed fraction."""
        return (self.global_tokens(micro_batch) - self.tokens) / self.tokens

    def lands(self, micro_batch: int) -> bool:
        """Whether the global batch is within EXACT of the target."""
        return abs(self.deviation(micro_batch)) <= EXACT

    def landing_near(self, size: int, top: int) -> list[int]:
        """The sizes that land on the target nearest to `size`: the largest below it and the
        smallest above it up to `top`, where there are such sizes."""
        below = next((m for m in range(size - 1, 0, -1) if self.lands(m)), None)
        above = next((m for m in range(size + 1, top + 1) if self.lands(m)), None)
        return [m for m in (below, above) if m is not None]
