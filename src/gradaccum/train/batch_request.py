"""The batch a run asks the planner for: `BatchRequest`, frozen.

The settings say what the user asked (--micro-batch, --tokens-per-step, --accum-steps,
--max-steps, --max-tokens); a task that counts its windows another way (SFT in examples, GRPO
in prompts x completions), a measured `--micro-batch auto`, a resume (the checkpoint's batch on
this number of ranks) and --epochs (a length in passes over the data) each derive the batch
the run is planned with from them. What they derive is a new request, never a changed copy
of the settings: the `TrainConfig` stays as the user gave it, and `resolve_plan` reads the
batch from the request and everything else (sequence length, precision, sync, warmup, the
schedule) from the settings.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class BatchRequest:
    """What the planner is asked to plan: a micro-batch (a number or "auto"), the tokens per
    step and/or k, and the run's length (steps, or tokens)."""

    micro_batch: int | str
    tokens_per_step: int | None = None
    """The step's size in tokens; None with `accum_steps`, or for the default."""
    accum_steps: int | None = None
    """k when given (with `tokens_per_step`, the micro-batch follows)."""
    max_steps: int | None = None
    """The run's length in optimizer steps; None: `total_tokens` sets it."""
    total_tokens: int | None = None
    """The run's length in tokens when `max_steps` is None."""

    @classmethod
    def of(cls, config) -> BatchRequest:
        """The request the settings make as given (`TrainConfig.total_tokens`: --max-tokens or
        its default, None when --max-steps or --epochs sets the length)."""
        return cls(
            micro_batch=config.micro_batch,
            tokens_per_step=config.tokens_per_step,
            accum_steps=config.accum_steps,
            max_steps=config.max_steps,
            total_tokens=config.total_tokens,
        )

    def but(self, **changes) -> BatchRequest:
        """This request with `changes` (a new one: requests are frozen)."""
        return replace(self, **changes)

    @property
    def target_tokens_per_step(self) -> int | None:
        """Tokens per optimizer step: `tokens_per_step`, or DEFAULT_TOKENS_PER_STEP; None
        when k alone sets the batch (as `TrainConfig.target_tokens_per_step`)."""
        from gradaccum.train.settings import DEFAULT_TOKENS_PER_STEP  # settings import tasks

        if self.tokens_per_step is None and self.accum_steps is None:
            return DEFAULT_TOKENS_PER_STEP
        return self.tokens_per_step
