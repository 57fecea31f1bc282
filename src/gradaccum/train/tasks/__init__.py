"""The tasks of `gradaccum train`: pretraining, supervised fine-tuning and GRPO, three
implementations of one protocol (`protocol.Task`), and any task of a user's own given as
--task MODULE:CLASS (docs/tasks.md). The registry (`registry`) is the one place a task's name
is looked up; the rules (`rules`) are what a config is checked against, without torch."""

from gradaccum.train.batch_request import BatchRequest
from gradaccum.train.tasks.protocol import Begin, Stream, Task, TaskBase, TaskData, TaskWindow
from gradaccum.train.tasks.registry import NAMES, rules_of, task_class
from gradaccum.train.tasks.rules import GRPO_STEP, GRPORules, PretrainRules, SFTRules, TaskRules

__all__ = [
    "GRPO_STEP",
    "NAMES",
    "BatchRequest",
    "Begin",
    "GRPORules",
    "PretrainRules",
    "SFTRules",
    "Stream",
    "Task",
    "TaskBase",
    "TaskData",
    "TaskRules",
    "TaskWindow",
    "check_task",
    "rules_of",
    "task_class",
]


def check_task(config) -> None:
    """BadInput for a setting of `config` (a TrainConfig) that its task does not take."""
    rules_of(config.task).check(config)
