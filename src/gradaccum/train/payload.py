"""trainer.pt: everything but the weights that a run needs to continue exactly, and how a
resume puts it back.

The payload holds the optimizer, the LR scheduler, the accumulator (loss scaler, noise-scale
averages), the data position, the RNG states, the settings, the batch as trained (the plan,
the micro-batch and k now, the batch schedule's growth), the LR schedule, how many
metrics.jsonl lines the checkpoint saw, the run's progress (tokens seen, seconds) and a
mixture of experts' balance (its mode and the previous window's f, `train.moe`). Only
tensors and plain containers, so it loads with torch.load(weights_only=True).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from ..engine.accumulator import Accumulator
from ..utils.errors import BadInput
from . import checkpoint
from .batch_state import BatchState
from .config import TrainConfig
from .moe import STATE_KEY as MOE_STATE
from .schedule import Schedule


@dataclass
class RunState:
    """What a run has done so far besides its batch (`BatchState.tokens`), saved with each
    checkpoint."""

    elapsed_s: float = 0.0
    """Seconds since the loop started, over every resume."""
    train_s: float = 0.0
    """Seconds inside training windows only (not eval, saving or start-up)."""
    initial_loss: float | None = None
    """Loss of the run's first window, nats per token."""


def trainer_state(
    *,
    config: TrainConfig,
    acc: Accumulator,
    optimizer: torch.optim.Optimizer,
    scheduler,
    batches,
    data_fingerprint: str | None,
    plan: dict,
    batch: BatchState,
    schedule: Schedule,
    metrics_lines: int,
    state: RunState,
    moe=None,
) -> dict:
    """The payload of a checkpoint after `acc.steps` optimizer steps. `plan`: the planned
    batch (`Resolved.summary`), which the batch as trained now overrides. `moe`: the run's
    `moe.MoETraining`, None for a dense model."""
    payload = {
        "step": acc.steps,
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "accumulator": acc.state_dict(),
        "data": batches.state_dict(),
        "data_fingerprint": data_fingerprint,
        "rng": checkpoint.rng_state(),
        "config": config.to_dict(),
        "plan": {**plan, "micro_batch": batch.micro_batch, "accum_steps": batch.k},
        "schedule": schedule.state_dict(),
        "batching": batch.batching_state(),
        "metrics_lines": metrics_lines,
        "progress": {"tokens": batch.tokens, **asdict(state)},
    }
    if moe is not None:
        payload[MOE_STATE] = moe.state_dict()
    return payload


def restore(
    payload: dict,
    *,
    config: TrainConfig,
    acc: Accumulator,
    optimizer: torch.optim.Optimizer,
    scheduler,
    batches,
    batch: BatchState,
    schedule: Schedule,
) -> RunState:
    """Put `payload` back into a run built for it, with the settings of `config` where a
    resume changed them on purpose (lr, weight decay: `resume.applied_changes`); the run's
    progress."""
    optimizer.load_state_dict(payload["optimizer"])
    scheduler.load_state_dict(payload["scheduler"])
    # The optimizer's saved hyperparameters give way to the settings as (re)given.
    scheduler.base_lrs = [config.lr] * len(optimizer.param_groups)
    for group in optimizer.param_groups:
        group["initial_lr"] = config.lr
        group["lr"] = config.lr * schedule(scheduler.last_epoch)
    optimizer.param_groups[0]["weight_decay"] = config.weight_decay
    acc.load_state_dict(payload["accumulator"])
    try:
        batches.load_state_dict(payload["data"], other_data=config.allow_data_change)
    except ValueError as err:
        raise BadInput("--resume", config.out, str(err)) from None
    checkpoint.set_rng_state(payload["rng"])
    progress = dict(payload["progress"])
    batch.resumed(progress.pop("tokens"), acc.steps, payload.get("batching"))
    return RunState(**progress)
