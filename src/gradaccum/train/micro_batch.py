"""`--micro-batch`: sequences per forward/backward on each rank, and how `auto` is settled.

This is the one place `--micro-batch auto` is decided:

- a new run whose batch is left to choose (no --accum-steps) measures it (`measures`,
  `measure`): `gradaccum.fit` runs forward, backward and the optimizer step at growing sizes
  for at most AUTO_FIT_SECONDS (on CPU at most CPU_MICRO_TOKENS tokens per micro-batch) and
  takes the size that fits and trains fastest; k then follows from the tokens per step (a
  schedule's smallest batch);
- with --accum-steps and a tokens per step, the micro-batch is what they leave: tokens /
  (seq_len x k x world), which must be whole (`unmeasured`);
- with --accum-steps alone, the plan's memory estimate picks it: on an accelerator, the
  largest that fits in the device's memory and lands closest to the target (the plan's own
  choice); on CPU, where memory is rarely the limit and bigger matmuls stop paying off early,
  the largest power of two of at most CPU_MICRO_TOKENS tokens that still leaves k >= 1
  (`unmeasured`, which `resolve_plan` also takes for an `auto` it is given unmeasured);
- on --resume, `auto` (or the checkpoint's own value) keeps the micro-batch the run trained
  with, or the largest below it that divides the sequences per device of a step
  (`changed_on_resume`, `on_resume`).

Whatever is settled here reaches the run through its plan only: the run's batch
(`gradaccum.train.batch_state.BatchState`) takes it once, and afterwards only out of memory
changes it (`BatchState.shrink`).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from gradaccum import fit
from gradaccum.data.batches import as_batch
from gradaccum.models.loss import causal_lm_loss
from gradaccum.parallel import devices
from gradaccum.parallel.process_group import RankInfo
from gradaccum.plan import PlanInputs, make_plan
from gradaccum.train import parts
from gradaccum.train.batch_request import BatchRequest
from gradaccum.train.batching import targets
from gradaccum.train.config import AUTO, TrainConfig
from gradaccum.train.rundir import checkpoint
from gradaccum.utils.errors import BadInput

AUTO_FIT_SECONDS = 4.0
"""Seconds `--micro-batch auto` spends probing and timing micro-batch sizes."""

CPU_MICRO_TOKENS = 2048
"""Most tokens per micro-batch `--micro-batch auto` takes on CPU: on two cores, throughput
of the tiny model is flat from about 1k to 2k tokens per micro-batch and falls beyond."""


def measures(config: TrainConfig, world_size: int) -> bool:
    """Whether a new run measures its micro-batch: `auto` with the batch left to choose.
    A target below one sequence per rank is not measured: `resolve_plan` refuses it."""
    smallest = targets(config)[1]
    return (
        config.micro_batch == AUTO
        and config.accum_steps is None
        and smallest >= config.seq_len * world_size
    )


def measure(
    config: TrainConfig,
    model: torch.nn.Module,
    data: parts.Data,
    rank_info: RankInfo,
    say: Callable[[str], None],
) -> BatchRequest:
    """The batch of `config` with the micro-batch that fits and trains fastest here, probed for at most
    AUTO_FIT_SECONDS (forward, backward and the run's optimizer step at growing sizes,
    bounded on CPU by CPU_MICRO_TOKENS per micro-batch); its table is printed through `say`.
    The model's weights and the RNG are left as they were, so the run trains as if nothing
    was probed. With --document-mask (`data.eod_id`) it probes masked batches, as the run
    trains (a masked attention may take another kernel and more memory)."""
    device, train_set = rank_info.device, data.train

    def make_batch(micro_batch: int) -> dict:
        rows = train_set.batch(np.arange(micro_batch) % len(train_set))
        return {k: v.to(device) for k, v in as_batch(rows, data.eod_id).items()}

    micro = _probe(config, model, make_batch, targets(config)[1], rank_info, say)
    return BatchRequest.of(config).but(micro_batch=micro)


def measure_sft(
    config: TrainConfig,
    model: torch.nn.Module,
    vocab_size: int,
    examples_per_step: float,
    rank_info: RankInfo,
    say: Callable[[str], None],
) -> int:
    """The examples per micro-batch of a --task sft run with `--micro-batch auto`, probed as
    `measure` does at the widest micro-batch a window can hold: rows of --seq-len tokens, every
    position a target (ids drawn from a generator of their own, so the run's RNG is
    untouched). A micro-batch padded to a shorter longest example needs less, so the size
    chosen fits whatever the windows hold. With --lora-rank the model probed is the adapted
    one: gradients and optimizer state for the adapters only."""
    device = rank_info.device
    generator = torch.Generator().manual_seed(config.seed)

    def make_batch(micro_batch: int) -> dict:
        ids = torch.randint(vocab_size, (micro_batch, config.seq_len), generator=generator)
        return {"input_ids": ids.to(device), "labels": ids.roll(-1, dims=1).to(device)}

    tokens = max(1, round(examples_per_step)) * config.seq_len
    return _probe(config, model, make_batch, tokens, rank_info, say, fixed_k=False)


def _probe(config, model, make_batch, tokens_per_step: int, rank_info, say, fixed_k=True) -> int:
    """`fit.find_micro_batch` on the run's model, optimizer and precision; the RNG restored."""
    device = rank_info.device
    model.to(device)
    on_cpu = devices.total_memory_bytes(device) is None
    rng = checkpoint.rng_state()
    result = fit.find_micro_batch(
        model,
        make_batch,
        causal_lm_loss,
        seq_len=config.seq_len,
        tokens_per_step=tokens_per_step,
        world_size=rank_info.world_size,
        precision=config.precision,
        max_micro_batch=max(1, CPU_MICRO_TOKENS // config.seq_len) if on_cpu else None,
        try_checkpointing=False,
        max_seconds=AUTO_FIT_SECONDS,
        make_optimizer=lambda m: parts.optimizer(m, config),
    )
    checkpoint.set_rng_state(rng)
    say(fit.render_table(result, fixed_k).rstrip("\n"))
    return result.micro_batch


def unmeasured(
    seq_len: int, k: int | None, target: int | None, per_rank_seq: int | None, base: dict, device
) -> int:
    """An `auto` micro-batch settled without measuring: from k (--accum-steps) and the tokens
    per step `target` when both are there, else by the plan's estimate. `base`: the plan's
    inputs but the batch (`resolve_plan`'s); `per_rank_seq`: sequences per rank of the
    smallest step."""
    world = base["gpus"]
    if target is not None and k is not None:
        micro, rest = divmod(target, seq_len * k * world)
        if rest or micro < 1:
            raise BadInput(
                f"--tokens-per-step {target}: not a whole number of micro-batches of "
                f"{seq_len}-token sequences x --accum-steps {k} x {world} rank(s)"
            )
        return micro
    return _estimated(base, target, per_rank_seq, device)


def _largest_power_of_two(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def _estimated(base: dict, target: int | None, per_rank_seq: int | None, device) -> int:
    if base["device_memory"] is None:  # CPU (and MPS): no memory figure to fit into
        cap = max(1, CPU_MICRO_TOKENS // base["seq_len"])
        return _largest_power_of_two(min(cap, per_rank_seq or cap))
    if target is not None:
        chosen = make_plan(PlanInputs(target_tokens=target, **base)).micro_batch
        if chosen:
            return chosen
    fit_max = make_plan(PlanInputs(**base)).memory.max_micro_batch
    if not fit_max:
        raise BadInput(
            f"--micro-batch auto: not even one sequence of {base['seq_len']} tokens fits in "
            f"{device}'s memory by the estimate; try --activation-checkpointing or a smaller "
            "--seq-len"
        )
    return _largest_power_of_two(min(fit_max, per_rank_seq or fit_max))


def changed_on_resume(config: TrainConfig, saved: dict) -> bool:
    """Whether a resume asks for another micro-batch than the checkpoint's run had: `auto`,
    or the value the checkpoint's settings hold, keep the trained one."""
    return config.micro_batch not in (AUTO, saved.get("micro_batch"))


def on_resume(config: TrainConfig, saved: dict, plan: dict, per_rank: int) -> int:
    """The micro-batch of a resume without a batch schedule, where a step is `per_rank`
    sequences per device: from a changed --accum-steps, a changed --micro-batch, or else the
    trained one (the largest up to it that divides `per_rank`, for another number of
    devices). `saved`: the checkpoint's settings; `plan`: its batch as trained."""
    k_given = config.accum_steps not in (None, saved.get("accum_steps"))
    micro_given = changed_on_resume(config, saved)
    if k_given:
        micro, rest = divmod(per_rank, config.accum_steps)
        if rest or micro < 1 or (micro_given and micro != config.micro_batch):
            raise BadInput(
                "--accum-steps",
                config.accum_steps,
                f"{per_rank} sequences per device per step (the checkpoint's tokens per step) "
                "are not a whole number of micro-batches"
                + (f" of --micro-batch {config.micro_batch}" if micro_given else ""),
            )
        return micro
    if micro_given:
        if per_rank % config.micro_batch:
            raise BadInput(
                "--micro-batch",
                config.micro_batch,
                f"does not divide the {per_rank} sequences per device of a step",
            )
        return config.micro_batch
    micro = min(plan["micro_batch"], per_rank)
    while per_rank % micro:  # the largest micro-batch up to the trained one that divides
        micro -= 1
    return micro
