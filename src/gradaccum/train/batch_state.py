"""The run's batch as it trains: micro-batch, k, total steps and tokens seen, in one object.

Four things change them, each a method here and nothing else:
- the plan (`BatchState.planned`): a run's first window, from `resolve_plan` and, with a
  --batch-schedule, the schedule's k at 0 tokens seen;
- a resume (`resumed`): the tokens the checkpoint had seen and, with a batch schedule, k
  from them (for `auto`, the growth the checkpoint holds) and the steps left;
- the batch schedule (`next_window`, `grow`): k of each window from the tokens seen, and
  `auto`'s growth toward the critical batch after a window;
- out of memory mid-window (`shrink`): a smaller micro-batch, k up by the same factor.

`k` is the k of the window in progress, or of the last one until the next begins: after
`auto` grows, the new k (`next_k`) takes effect at the next window, and the metrics line,
the checkpoint's plan and the summary of the window just trained keep the k it had.
"""

from __future__ import annotations

from ..plan.sizes import fmt_count
from .batching import Batching, make_batching, token_schedule
from .config import TrainConfig
from .schedule import Schedule


def smaller_micro_batch(micro_batch: int) -> int | None:
    """The micro-batch to redo a window with after out of memory: the largest divisor of
    at most half of `micro_batch` (so k grows by a whole factor); None at 1."""
    return next((b for b in range(micro_batch // 2, 0, -1) if micro_batch % b == 0), None)


class BatchState:
    """micro_batch (sequences per forward/backward on each rank), k (micro-batches per
    optimizer step), total (optimizer steps of the whole run, as far as known) and tokens
    (tokens trained on, all ranks: where a batch schedule and its LR schedule stand)."""

    def __init__(self, batching: Batching, micro_batch: int, k: int, total: int, config):
        self._batching = batching
        self._seq_len = config.seq_len
        self.total_tokens = config.total_tokens
        """Tokens a batch-schedule run trains on; it ends once it has seen them."""
        self.micro_batch, self.k, self.total = micro_batch, k, total
        self.tokens = 0
        if batching.varies:
            self.k = batching.next_k(0)
            self.total = batching.steps_left(0, self.total_tokens)

    @classmethod
    def planned(cls, config: TrainConfig, resolved, world_size: int) -> BatchState:
        """The batch of a run's first window, as `resolved` (`resolve_plan`) planned it;
        BadInput where `--batch-schedule auto` cannot estimate (`make_batching`)."""
        micro, k = resolved.micro_batch, resolved.accum_steps
        batching = make_batching(config, micro, world_size, k)
        return cls(batching, micro, k, resolved.total_steps, config)

    @property
    def varies(self) -> bool:
        """Whether k may change from window to window (a --batch-schedule run)."""
        return self._batching.varies

    @property
    def world_size(self) -> int:
        return self._batching.world

    @property
    def tokens_per_step(self) -> int:
        """Tokens of the window in progress (or the last) over all ranks: micro x seq x k x
        world."""
        return self.micro_batch * self._seq_len * self.k * self.world_size

    @property
    def next_k(self) -> int:
        """k of the next window: `k`, or what `auto` grew it to after the last window."""
        return self._batching.k

    @property
    def next_tokens_per_step(self) -> int:
        """Tokens per step of the next window (over all ranks)."""
        return self._batching.k * self._batching.per_micro_step

    def lr_schedule(self, config: TrainConfig, resolved) -> Schedule:
        """A new run's LR schedule: over optimizer steps, or over tokens seen when the batch
        varies (see `gradaccum.train.batching`)."""
        if self.varies:
            return token_schedule(config, self.total_tokens, self.tokens_per_step)
        return Schedule(resolved.total_steps, resolved.warmup_steps, config.schedule)

    def finished(self, steps: int) -> bool:
        """Whether the run is done after `steps` optimizer steps: its steps, or with a batch
        schedule its tokens."""
        if self.varies:
            return self.tokens >= self.total_tokens
        return steps >= self.total

    def resumed(self, tokens: int, steps: int, batching_state: dict | None) -> None:
        """After a resume at `steps` optimizer steps and `tokens` tokens seen: with a batch
        schedule, k from them (and `auto`'s growth in `batching_state`), and the steps left."""
        self.tokens = tokens
        if self.varies:
            self._batching.load_state_dict(batching_state)
            self.k = self._batching.next_k(tokens)
            self._count_steps(steps)

    def next_window(self, schedule: Schedule) -> float | None:
        """Before a window, with a batch schedule: its k, and the multiplier of the peak LR
        it trains at (both follow from the tokens seen, and for `auto` the checkpointed
        growth, so a resume repeats them); None with one batch throughout, where the
        scheduler steps the LR."""
        if not self.varies:
            return None
        seen = self.tokens
        self.k = self._batching.next_k(seen)
        # In warmup, the lr reached by the window's end (as step-counted warmup's first step
        # takes lr / warmup_steps, not 0); after it, the decay where the window starts.
        at = seen + self.tokens_per_step - 1 if seen < schedule.warmup_steps else seen
        return schedule(at) * self._batching.lr_factor()

    def add_tokens(self, tokens: int) -> None:
        """A window trained on `tokens` more tokens (all ranks)."""
        self.tokens += tokens

    def grow(self, step: int, critical_tokens: float | None, steps: int) -> bool:
        """After optimizer step `step` of `--batch-schedule auto`, whose noise scale is
        `critical_tokens`: k of the next windows grown toward it when allowed, and the steps
        left with it (`steps` taken); whether k grew."""
        if not self._batching.after_window(step, critical_tokens):
            return False
        self._count_steps(steps)
        return True

    def follow_noise(self, result, steps: int) -> str | None:
        """After a window (`result`, its StepResult; `steps` optimizer steps taken) of
        `--batch-schedule auto`: k grown toward the noise scale's critical batch when allowed
        (`grow`); the line that says so, None when k stays."""
        noise, old = result.noise, self.k
        critical = noise.b_simple_tokens if noise else None
        if not self.grow(result.step, critical, steps):
            return None
        return (
            f"step {result.step}: critical batch about {fmt_count(critical)} tokens: k {old} "
            f"-> {self.next_k} ({fmt_count(self.next_tokens_per_step)} tokens per step)"
        )

    def shrink(self, steps: int) -> int | None:
        """After out of memory mid-window (`steps` optimizer steps taken): the micro-batch of
        `smaller_micro_batch`, k up by the same factor (tokens per step unchanged), and with
        a batch schedule the steps left; the new micro-batch, or None at 1 (nothing changed)."""
        old = self.micro_batch
        smaller = smaller_micro_batch(old)
        if smaller is None:
            return None
        self.k = self.k * old // smaller
        self.micro_batch = smaller
        self._batching.set_micro_tokens(smaller * self._seq_len, self.k)
        if self.varies:
            self._count_steps(steps)
        return smaller

    def _count_steps(self, steps: int) -> None:
        """A batch-schedule run's total steps from where it stands (they change only when
        `auto` grows k or the micro-batch shrinks)."""
        self.total = steps + self._batching.steps_left(self.tokens, self.total_tokens)

    def batching_state(self) -> dict:
        """What a checkpoint keeps of the schedule's k (`Batching.state_dict`)."""
        return self._batching.state_dict()
