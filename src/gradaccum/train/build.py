"""A run built from its checked settings: everything that can still reject the input, before
anything is written to --out.

`fresh` makes a new run: its task, the task's data, a new model, the batch planned from the
request the task makes (`BatchRequest`: `--micro-batch auto` measured where it is left to
choose); the settings themselves are never changed.
`resumed` continues the run in --out from its newest intact checkpoint: its model as trained,
the plan the checkpoint's batch gives on this number of ranks, the changes a resume allows
judged and named (`notes`), the rest restored. Both hand `Run` the same parts, so both train
the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gradaccum.parallel.process_group import RankInfo
from gradaccum.train import parts
from gradaccum.train.batch_state import BatchState
from gradaccum.train.config import TrainConfig
from gradaccum.train.console import Console
from gradaccum.train.resolve import Resolved, resolve_run
from gradaccum.train.rundir import resume
from gradaccum.train.rundir.outputs import Outputs
from gradaccum.train.schedule import Schedule
from gradaccum.train.tasks import Task, TaskData, task_class


@dataclass
class Built:
    """What a run is made of before it trains (`Run`'s arguments)."""

    config: TrainConfig
    rank_info: RankInfo
    console: Console
    task: Task
    data: TaskData
    model: torch.nn.Module
    model_info: object
    resolved: Resolved
    batch: BatchState
    schedule: Schedule
    outputs: Outputs
    notes: list[str]
    """What a resume changed, one line each."""
    trainer_state: dict | None = None
    """The checkpoint's payload a resumed run restores (`payload.restore`); None: new."""


def fresh(config: TrainConfig, rank_info: RankInfo) -> Built:
    """A new run: its data, a new model, the batch planned."""
    console = Console(enabled=rank_info.rank == 0, quiet=config.json)
    task = task_class(config.task)(config, rank_info)
    torch.manual_seed(config.seed)
    data = task.load_data()
    model, model_info = parts.new_model(config, data.info, rank_info.device)
    request = task.batch_request(data, model, console.say)
    resolved = resolve_run(config, request, model_info, rank_info, task.epoch_tokens(data))
    batch = BatchState.planned(config, resolved, rank_info.world_size)
    schedule = batch.lr_schedule(config, resolved)
    outputs = Outputs(config, rank_info, resolved.shards_model)
    return Built(config, rank_info, console, task, data, model, model_info, resolved, batch,
                 schedule, outputs, [])  # fmt: skip


def resumed(config: TrainConfig, rank_info: RankInfo) -> Built:
    """The run in --out continued from its newest intact checkpoint, exactly, with the
    changes `resume` allows applied and named in `notes`."""
    console = Console(enabled=rank_info.rank == 0, quiet=config.json)
    task = task_class(config.task)(config, rank_info)
    ckpt = resume.open_checkpoint(config, console.say)
    resume.check_metrics(config, ckpt)
    torch.manual_seed(config.seed)
    data = task.load_data()
    model, model_info = parts.checkpoint_model(config, data.info, ckpt.path, rank_info.device)
    notes = resume.check_data(config, ckpt, data.info)
    request = task.resume_batch_request(data, ckpt)
    if request is None:  # the checkpoint's batch
        request = resume.batch_request(config, ckpt, rank_info.world_size)
    resolved = resolve_run(config, request, model_info, rank_info, task.epoch_tokens(data))
    batch = BatchState.planned(config, resolved, rank_info.world_size)
    schedule, length_notes = resume.lr_schedule(config, ckpt, resolved, batch)
    notes += length_notes + resume.batch_lines(ckpt, batch)
    notes += resume.applied_changes(config, ckpt)
    outputs = Outputs.resuming(config, rank_info, resolved.shards_model, ckpt)
    return Built(config, rank_info, console, task, data, model, model_info, resolved, batch,
                 schedule, outputs, notes, ckpt.trainer_state)  # fmt: skip
