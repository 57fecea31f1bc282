"""From a TrainConfig to the numbers a run trains with: micro-batch, k, steps, warmup.

The batch arithmetic is gradaccum.plan's, the same `gradaccum plan` prints: k =
round(tokens_per_step / (micro_batch x seq_len x world)), at least 1, and the table says how
far the real batch lands from the target. `--micro-batch auto` picks the micro-batch here:

- on an accelerator, the largest the plan's memory estimate fits in the device's memory that
  lands closest to the target (the plan's own choice);
- on CPU, where memory is rarely the limit and bigger matmuls stop paying off early, the
  largest power of two of at most CPU_MICRO_TOKENS tokens that still leaves k >= 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..parallel import devices
from ..plan import Plan, PlanInputs, make_plan, render_table
from ..utils.errors import BadInput
from .batching import AUTO, first_target, smallest_target
from .config import DEFAULT_MAX_TOKENS, DEFAULT_TOKENS_PER_STEP, TrainConfig

MAX_ACCUM_STEPS = 65536
"""Most micro-batches one window may hold: the trainer fetches a window's micro-batches
before the first backward (to count its tokens), so k bounds host memory."""

CPU_MICRO_TOKENS = 2048
"""Most tokens per micro-batch `--micro-batch auto` takes on CPU: on two cores, throughput
of the tiny model is flat from about 1k to 2k tokens per micro-batch and falls beyond."""


@dataclass
class Resolved:
    """The run's batch and length, as trained: the plan's numbers, plus the warmup."""

    plan: Plan
    """The plan `gradaccum plan` would print for this run (memory estimate included)."""
    warmup_steps: int
    """Optimizer steps of LR warmup."""

    @property
    def micro_batch(self) -> int:
        """Sequences per forward/backward on each rank."""
        return self.plan.micro_batch

    @property
    def accum_steps(self) -> int:
        """Micro-batches per optimizer step (k)."""
        return self.plan.accum_steps

    @property
    def world_size(self) -> int:
        """Ranks (torchrun processes)."""
        return self.plan.world_size

    @property
    def seq_len(self) -> int:
        """Tokens per sequence."""
        return self.plan.seq_len

    @property
    def tokens_per_step(self) -> int:
        """micro_batch x seq_len x k x world: tokens per optimizer step, as trained."""
        return self.plan.global_batch_tokens

    @property
    def total_steps(self) -> int:
        """Optimizer steps of the whole run."""
        return self.plan.steps

    @property
    def table(self) -> str:
        """The plan as `gradaccum plan` shows it."""
        return render_table(self.plan)

    def summary(self) -> dict:
        """The batch a checkpoint records: a resume keeps its tokens per step and sequence length."""
        return {
            "micro_batch": self.micro_batch,
            "accum_steps": self.accum_steps,
            "world_size": self.world_size,
            "seq_len": self.seq_len,
            "tokens_per_step": self.tokens_per_step,
            "total_steps": self.total_steps,
        }


def _largest_power_of_two(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def _targets(config: TrainConfig) -> tuple[int | None, int | None, str]:
    """(the first window's tokens per step, the smallest any window takes, the flag that
    set them): a batch schedule's first and smallest targets (`auto`: --min-tokens-per-step),
    else --tokens-per-step (8192 unless --accum-steps sets the batch)."""
    if config.batch_schedule == AUTO:
        low = first_target(config)
        return low, low, f"--min-tokens-per-step {low}"
    if config.batch_schedule is not None:
        schedule = f"--batch-schedule {config.batch_schedule}"
        return first_target(config), smallest_target(config), schedule
    target = config.tokens_per_step
    if target is None and config.accum_steps is None:
        target = DEFAULT_TOKENS_PER_STEP
    return target, target, f"--tokens-per-step {target}"


def resolve_plan(
    config: TrainConfig,
    model_info,
    world_size: int,
    device: torch.device,
    batch_schedule: str | None = None,
) -> Resolved:
    """Micro-batch, k, steps and warmup for `config` on `device`; BadInput if none. A
    --batch-schedule run's batch rows are its first window's. With a (fixed)
    `batch_schedule`, the plan covers the whole run phase by phase with its --lr-rule and
    --lr, as `gradaccum plan --batch-schedule ... --base-lr ... --lr-rule ...` prints it."""
    seq_len, k = config.seq_len, config.accum_steps
    target, smallest, flag = _targets(config)
    base = dict(
        seq_len=seq_len,
        gpus=world_size,
        params=model_info.params,
        layers=model_info.layers,
        hidden=model_info.hidden,
        heads=model_info.heads,
        vocab=model_info.vocab_size,
        precision=config.precision,
        checkpointing="full" if config.activation_checkpointing else "none",
        flash_attention=device.type == "cuda",
        device_memory=devices.total_memory_bytes(device),
    )
    per_rank_seq = None if target is None else smallest // (seq_len * world_size)
    if target is not None and per_rank_seq < 1:
        what = ""
        if config.batch_schedule not in (None, AUTO):  # name the point, not a flag not given
            what = f"its smallest target, {smallest} tokens per step, is "
        raise BadInput(
            f"{flag}: {what}below one sequence of --seq-len {seq_len} on each of "
            f"{world_size} rank(s)"
        )

    micro = config.micro_batch
    if micro == "auto" and target is not None and k is not None:
        micro, rest = divmod(target, seq_len * k * world_size)
        if rest or micro < 1:
            raise BadInput(
                f"--tokens-per-step {target}: not a whole number of micro-batches of "
                f"{seq_len}-token sequences x --accum-steps {k} x {world_size} rank(s)"
            )
    elif micro == "auto":
        micro = _auto_micro_batch(base, target, per_rank_seq, device)
    elif target is not None and k is not None and micro * seq_len * k * world_size != target:
        raise BadInput(
            f"--accum-steps {k}: --micro-batch {micro} x --seq-len {seq_len} x k x "
            f"{world_size} rank(s) is {micro * seq_len * k * world_size} tokens, not "
            f"--tokens-per-step {target}; give two of the three"
        )

    length = (
        {"steps": config.max_steps}
        if config.max_steps is not None
        else {"total_tokens": config.max_tokens or DEFAULT_MAX_TOKENS}
    )
    batch = {"accum_steps": k} if k is not None else {"target_tokens": target}
    if batch_schedule is not None:
        batch = {"batch_schedule": batch_schedule, "lr_rule": config.lr_rule, "base_lr": config.lr}
    plan = make_plan(PlanInputs(micro_batch=micro, **batch, **length, **base))
    if plan.accum_steps > MAX_ACCUM_STEPS:
        raise BadInput(
            f"--tokens-per-step {plan.global_batch_tokens}: {plan.accum_steps:,} micro-batches "
            f"of {micro} x {seq_len} tokens per step, more than {MAX_ACCUM_STEPS:,}; "
            "use a larger --micro-batch or more ranks"
        )
    steps = plan.steps
    warmup = config.warmup_steps
    if warmup is None:
        warmup = min(100, steps // 10)
    elif warmup > steps:
        raise BadInput(f"--warmup-steps {warmup}: longer than the run ({steps} steps)")
    return Resolved(plan=plan, warmup_steps=warmup)


def _auto_micro_batch(
    base: dict, target: int | None, per_rank_seq: int | None, device: torch.device
) -> int:
    if base["device_memory"] is None:  # CPU (and MPS): no memory figure to fit into
        cap = max(1, CPU_MICRO_TOKENS // base["seq_len"])
        return _largest_power_of_two(min(cap, per_rank_seq or cap))
    if target is not None:
        chosen = make_plan(PlanInputs(target_tokens=target, **base)).micro_batch
        if chosen:
            return chosen
    fit = make_plan(PlanInputs(**base)).memory.max_micro_batch
    if not fit:
        raise BadInput(
            f"--micro-batch auto: not even one sequence of {base['seq_len']} tokens fits in "
            f"{device}'s memory by the estimate; try --activation-checkpointing or a smaller "
            "--seq-len"
        )
    return _largest_power_of_two(min(fit, per_rank_seq or fit))
