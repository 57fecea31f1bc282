"""trainer.pt: everything but the weights that a run needs to continue exactly, and how a
resume puts it back.

Each piece saves and loads itself (`state_dict` / `load_state_dict`): the optimizer, the LR
scheduler, the accumulator (loss scaler, noise-scale averages), the data position, the
batch as trained (`BatchState`: the plan, the micro-batch and k now, the batch schedule's
growth, tokens seen), the LR schedule, the run's progress (`RunState`: seconds, first loss),
--save-best's best so far (`best.Best`: step, eval loss, eval set) and a mixture of experts'
balance (its mode and the previous window's f, `train.moe`); with them the RNG states, the
settings and how many metrics.jsonl lines the checkpoint saw. A model sharded with FSDP2
(--sync micro, hsdp) keeps the optimizer's tensors out of it: they and the weights are
each rank's shards, keyed by parameter name (`sharded_contents`, written through
torch.distributed.checkpoint), and trainer.pt holds the optimizer's param_groups alone. Any
run resumes from either kind of checkpoint: a sharded one resharded to the run's layout
(`sharding.load_sharded`), a whole one (format 1, or an unsharded run's) as before. Only
tensors and plain containers, so it loads with torch.load(weights_only=True).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Protocol

from gradaccum.parallel import sharding
from gradaccum.train.moe import STATE_KEY as MOE_STATE
from gradaccum.train.parts import unwrapped
from gradaccum.train.rundir import best, checkpoint
from gradaccum.utils.errors import BadInput

if TYPE_CHECKING:
    import torch

    from gradaccum.engine.accumulator import Accumulator
    from gradaccum.train.batch_state import BatchState
    from gradaccum.train.config import TrainConfig
    from gradaccum.train.moe import MoETraining
    from gradaccum.train.rundir.outputs import Outputs
    from gradaccum.train.schedule import Schedule
    from gradaccum.train.tasks import Stream, Task, TaskData


class Checkpointed(Protocol):
    """What a checkpoint saves of a run and a resume puts back into it (`train.loop.Run` is
    one): its parts, each saving and loading itself."""

    config: TrainConfig
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    acc: Accumulator
    batches: Stream
    data: TaskData
    batch: BatchState
    schedule: Schedule
    outputs: Outputs
    state: RunState
    task: Task
    moe: MoETraining | None
    sharded: bool
    """The model is sharded with FSDP2 (--sync micro or hsdp)."""
    is_main: bool


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

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        loaded = RunState(**state)  # an unknown field refused, a missing one at its default
        for name, value in asdict(loaded).items():
            setattr(self, name, value)


def trainer_state(run: Checkpointed) -> dict:
    """The payload of a checkpoint of `run` after its `acc.steps` optimizer steps."""
    batch = run.batch.state_dict()
    payload = {
        "step": run.acc.steps,
        "optimizer": optimizer_state(run),
        "scheduler": run.scheduler.state_dict(),
        "accumulator": run.acc.state_dict(),
        "data": run.batches.state_dict(),
        "data_fingerprint": run.data.info.fingerprint,
        "rng": checkpoint.rng_state(),
        "config": run.config.to_dict(),
        "plan": batch["plan"],
        "schedule": run.schedule.state_dict(),
        "batching": batch["batching"],
        "metrics_lines": run.outputs.metrics.lines,
        "progress": {"tokens": batch["tokens"], **run.state.state_dict()},
        best.STATE_KEY: run.outputs.best.state_dict(),
        "task": run.task.state_dict(),
    }
    if run.moe is not None:
        payload[MOE_STATE] = run.moe.state_dict()
    return payload


def checkpoint_contents(run: Checkpointed) -> tuple[dict, dict]:
    """What a checkpoint of the run as it stands holds: (model state_dict, trainer state);
    a sharded model's: (each rank's own shards, the trainer state on rank 0,
    `sharded_contents`)."""
    if run.sharded:
        return sharded_contents(run)
    return unwrapped(run.model).state_dict(), trainer_state(run)


def optimizer_state(run: Checkpointed) -> dict:
    """The optimizer's state as an unsharded run's optimizer holds it; for a sharded model
    its param_groups alone (the hyperparameters: its tensors are in the shards,
    `sharded_contents`)."""
    if run.sharded:
        return {"param_groups": run.optimizer.state_dict()["param_groups"]}
    return run.optimizer.state_dict()


def sharded_contents(run: Checkpointed) -> tuple[dict, dict | None]:
    """What a checkpoint of a sharded `run` holds: (this rank's shards of the model's and the
    optimizer's state, `sharding.sharded_state`; the trainer state on rank 0, None on the
    others). Nothing is gathered."""
    shards = sharding.sharded_state(run.model, run.optimizer)
    return shards, trainer_state(run) if run.is_main else None


def restore(run: Checkpointed, payload: dict) -> list[str]:
    """Put `payload` back into `run`, built for it, with the settings of `run.config` where a
    resume changed them on purpose (lr, weight decay: `resume.applied_changes`); the lines
    that say what else changed (a best checkpoint looked for anew, a mixture of experts'
    balance mode)."""
    config, optimizer, scheduler = run.config, run.optimizer, run.scheduler
    if payload.get(checkpoint.FORMAT_KEY, 1) > checkpoint.FORMAT:
        raise BadInput("--resume", config.out, f"its checkpoint is of format "
                       f"{payload[checkpoint.FORMAT_KEY]}, newer than this gradaccum's "
                       f"{checkpoint.FORMAT}: upgrade gradaccum to resume it")  # fmt: skip
    folder = checkpoint.folder_of(config.out, payload["step"])
    if checkpoint.is_sharded(folder):  # weights and optimizer resharded to the run's layout
        sharding.load_sharded(run.model, optimizer, os.path.join(folder, checkpoint.SHARDED))
    elif run.sharded:  # each tensor laid out as its parameter
        sharding.load_optimizer_state(optimizer, payload["optimizer"])
    else:
        optimizer.load_state_dict(payload["optimizer"])
    scheduler.load_state_dict(payload["scheduler"])
    # The optimizer's saved hyperparameters give way to the settings as (re)given.
    scheduler.base_lrs = [config.lr] * len(optimizer.param_groups)
    for group in optimizer.param_groups:
        group["initial_lr"] = config.lr
        group["lr"] = config.lr * run.schedule(scheduler.last_epoch)
    optimizer.param_groups[0]["weight_decay"] = config.weight_decay
    run.acc.load_state_dict(payload["accumulator"])
    try:
        run.batches.load_state_dict(payload["data"], other_data=config.allow_data_change)
    except ValueError as err:
        raise BadInput("--resume", config.out, str(err)) from None
    checkpoint.set_rng_state(payload["rng"])
    progress = dict(payload["progress"])
    batch = {"tokens": progress.pop("tokens"), "batching": payload.get("batching")}
    run.batch.load_state_dict(batch, run.acc.steps)
    run.state.load_state_dict(progress)
    run.task.load_state_dict(payload.get("task", {}))  # none in a checkpoint from before
    fingerprint = run.task.eval_fingerprint(run.data)
    run.outputs.best, lines = best.restored(run.config, run.acc.steps, fingerprint,
                                            payload.get(best.STATE_KEY))  # fmt: skip
    if run.moe is None:
        return lines
    return lines + run.moe.load_state_dict(payload, run.acc.steps)  # the previous window's f
