"""The run's batch as it trains, in one object: micro-batch, k, tokens per step, where a
batch schedule stands (tokens seen), total steps.

k and the micro-batch are written in one place, `BatchState._set_k`, which these call:
- the plan (`BatchState.planned`): a run's first window, from `resolve_plan` (read once)
  and, with a --batch-schedule, the policy's k at 0 tokens seen;
- a resume (`load_state_dict`): the tokens the checkpoint had seen and, with a batch
  schedule, k from them (for `auto`, the growth the checkpoint holds) and the steps left;
- the batch schedule (`next_window`, `grow`): k of each window from the tokens seen, and
  `auto`'s growth toward the critical batch after a window; the policy
  (`gradaccum.train.batching`) decides each k, this object keeps it;
- the ranks' agreement on a window's micro-steps (`agreed`);
- out of memory mid-window (`shrink`): a smaller micro-batch, k up by the same factor.

`k` is the k of the window in progress, or of the last one until the next begins: after
`auto` grows, the new k (`next_k`) takes effect at the next window, and the metrics line,
the checkpoint's plan and the summary of the window just trained keep the k it had.
"""

from __future__ import annotations

from gradaccum.train.batching import Fixed, Layout, make_policy, token_schedule
from gradaccum.train.config import TrainConfig
from gradaccum.train.schedule import Schedule
from gradaccum.utils.sizes import fmt_count


def smaller_micro_batch(micro_batch: int) -> int | None:
    """The micro-batch to redo a window with after out of memory: the largest divisor of
    at most half of `micro_batch` (so k grows by a whole factor); None at 1."""
    return next((b for b in range(micro_batch // 2, 0, -1) if micro_batch % b == 0), None)


class BatchState:
    """micro_batch (sequences per forward/backward on each rank), k (micro-batches per
    optimizer step), total (optimizer steps of the whole run, as far as known) and tokens
    (tokens trained on, all ranks: where a batch schedule and its LR schedule stand)."""

    def __init__(self, policy: Fixed, config: TrainConfig, resolved, world_size: int):
        self.policy = policy
        """Decides k from window to window (`gradaccum.train.batching`)."""
        self.seq_len, self.world_size = config.seq_len, world_size
        self.total_tokens = config.total_tokens
        """Tokens a batch-schedule run trains on; it ends once it has seen them."""
        self.planned_tokens_per_step = resolved.tokens_per_step
        """Tokens per step as planned (a schedule's first): the checkpoint's record."""
        self.planned_steps = resolved.total_steps
        """Optimizer steps as planned: the checkpoint's record; `total` is the run's count."""
        self.tokens = 0
        self.total = resolved.total_steps
        layout = Layout(resolved.micro_batch * self.seq_len, world_size)
        self._set_k(policy.first_k(resolved.accum_steps, layout), resolved.micro_batch)
        if self.varies:
            self.total = policy.steps_left(self.k, 0, self.total_tokens, layout)

    @classmethod
    def planned(cls, config: TrainConfig, resolved, world_size: int) -> BatchState:
        """The batch of a run's first window, as `resolved` (`resolve_plan`) planned it;
        BadInput where `--batch-schedule auto` cannot estimate (`make_policy`)."""
        layout = Layout(resolved.micro_batch * config.seq_len, world_size)
        return cls(make_policy(config, layout), config, resolved, world_size)

    def _set_k(self, k: int, micro_batch: int | None = None, *, from_next: bool = False) -> None:
        """The one writer of k (and of the micro-batch, which only changes with it): k of the
        window about to run and of those after it; `from_next`: of the windows after it only
        (`auto`'s growth, decided after a window whose reports keep the k it trained at)."""
        self._next_k = k
        if not from_next:
            self.k = k
        if micro_batch is not None:
            self.micro_batch = micro_batch

    @property
    def varies(self) -> bool:
        """Whether k may change from window to window (a --batch-schedule run)."""
        return self.policy.varies

    @property
    def layout(self) -> Layout:
        """Tokens of one micro-batch on one rank, and the ranks."""
        return Layout(self.micro_batch * self.seq_len, self.world_size)

    @property
    def tokens_per_step(self) -> int:
        """Tokens of the window in progress (or the last) over all ranks: micro x seq x k x
        world."""
        return self.micro_batch * self.seq_len * self.k * self.world_size

    @property
    def next_k(self) -> int:
        """k of the next window: `k`, or what `auto` grew it to after the last window."""
        return self._next_k

    @property
    def next_tokens_per_step(self) -> int:
        """Tokens per step of the next window (over all ranks)."""
        return self.next_k * self.layout.per_micro_step

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

    def next_window(self, schedule: Schedule) -> float | None:
        """Before a window, with a batch schedule: its k, and the multiplier of the peak LR
        it trains at (both follow from the tokens seen, and for `auto` the checkpointed
        growth, so a resume repeats them); None with one batch throughout, where the
        scheduler steps the LR."""
        if not self.varies:
            return None
        seen = self.tokens
        self._set_k(self.policy.k_at(self.next_k, seen, self.layout))
        # In warmup, the lr reached by the window's end (as step-counted warmup's first step
        # takes lr / warmup_steps, not 0); after it, the decay where the window starts.
        at = seen + self.tokens_per_step - 1 if seen < schedule.warmup_steps else seen
        return schedule(at) * self.policy.lr_factor(self.k, self.layout)

    def agreed(self, micro_steps: int) -> None:
        """The window's micro-steps as the ranks agreed on them (under torchrun, the most
        micro-batches a rank has): the window's k."""
        self._set_k(micro_steps)

    def add_tokens(self, tokens: int) -> None:
        """A window trained on `tokens` more tokens (all ranks)."""
        self.tokens += tokens

    def grow(self, step: int, critical_tokens: float | None, steps: int) -> bool:
        """After optimizer step `step` of `--batch-schedule auto`, whose noise scale is
        `critical_tokens`: k of the next windows grown toward it when allowed, and the steps
        left with it (`steps` taken); whether k grew."""
        grown = self.policy.grown(self.next_k, step, critical_tokens, self.layout)
        if grown is None:
            return False
        self._set_k(grown, from_next=True)
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
        self._set_k(self.k * old // smaller, smaller)
        if self.varies:
            self._count_steps(steps)
        return smaller

    def _count_steps(self, steps: int) -> None:
        """A batch-schedule run's total steps from where it stands (they change only when
        `auto` grows k or the micro-batch shrinks)."""
        left = self.policy.steps_left(self.next_k, self.tokens, self.total_tokens, self.layout)
        self.total = steps + left

    # ---- checkpoint --------------------------------------------------------------------

    def state_dict(self) -> dict:
        """What a checkpoint keeps of the batch: `plan` (the batch as trained: micro-batch and
        k now, the layout, the planned tokens per step and steps), `batching` (k of the next
        window and the policy's own state) and `tokens` seen."""
        return {
            "plan": {
                "micro_batch": self.micro_batch,
                "accum_steps": self.k,
                "world_size": self.world_size,
                "seq_len": self.seq_len,
                "tokens_per_step": self.planned_tokens_per_step,
                "total_steps": self.planned_steps,
            },
            "batching": {"k": self.next_k, **self.policy.state_dict()},
            "tokens": self.tokens,
        }

    def load_state_dict(self, state: dict, steps: int) -> None:
        """After a resume at `steps` optimizer steps: the tokens seen and, with a batch
        schedule, k from them (`auto`: the k and growth in `batching`) and the steps left.
        The micro-batch and k of a fixed batch are the resumed plan's (`resume.batch_config`)."""
        self.tokens = state["tokens"]
        if not self.varies:
            return
        saved = state.get("batching") or {}
        self.policy.load_state_dict(saved)
        self._set_k(self.policy.k_at(int(saved.get("k", self.k)), self.tokens, self.layout))
        self._count_steps(steps)
