"""--task NAME or --task MODULE:CLASS: the one place a task's name is looked up.

The built-in tasks are registered by name (`BUILTIN`: their rules, and where their `Task`
lives, imported only when a run is built, so that a config is checked without torch). Any
other value is `module:Class` or `file.py:Class`, imported as --reward's functions are (from
the working folder first), and refused in one line when it is not a task
(`check_task_class`)."""

from __future__ import annotations

import importlib

from gradaccum.train.tasks.rules import GRPORules, PretrainRules, SFTRules, TaskRules
from gradaccum.utils.errors import BadInput
from gradaccum.utils.imports import load_module

BUILTIN = {
    "pretrain": (PretrainRules, "gradaccum.train.tasks.pretrain:Pretraining"),
    "sft": (SFTRules, "gradaccum.train.tasks.sft:FineTuning"),
    "grpo": (GRPORules, "gradaccum.train.tasks.grpo:PolicyOptimization"),
}
"""The tasks --task names: pretraining on a token stream, supervised fine-tuning on
examples, RL fine-tuning (the GRPO family) on prompts with sampled completions."""

NAMES = tuple(BUILTIN)

REQUIRED = ("rules", "load_data", "stream", "next_window", "loss", "evaluate")
"""What a class must have to be a task (`protocol.Task`; `protocol.TaskBase` gives the rest)."""


def is_builtin(task: str) -> bool:
    return task in BUILTIN


def rules_of(task: str) -> type[TaskRules]:
    """The rules of --task `task` (a name, or module:Class: its class's `rules`)."""
    if task in BUILTIN:
        return BUILTIN[task][0]
    return task_class(task).rules


def task_class(task: str) -> type:
    """The `Task` class of --task `task`; BadInput naming --task when there is none."""
    target = BUILTIN[task][1] if task in BUILTIN else task
    where, sep, name = target.rpartition(":")
    if not sep or not where or not name:
        raise BadInput(
            "--task",
            task,
            f"choose one of {', '.join(NAMES)}, or give MODULE:CLASS or FILE.py:CLASS (a task "
            "of your own)",
        )
    if task in BUILTIN:
        module = importlib.import_module(where)
    else:
        module = load_module("--task", task, where)
    cls = getattr(module, name, None)
    if cls is None:
        raise BadInput("--task", task, f"module {where} has no attribute {name}")
    check_task_class(task, cls)
    return cls


def check_task_class(task: str, cls) -> None:
    """BadInput naming --task unless `cls` is a class with what a task supplies."""
    if not isinstance(cls, type):
        raise BadInput("--task", task, f"{cls!r} is not a class (a Task: see docs/tasks.md)")
    missing = [name for name in REQUIRED if not hasattr(cls, name)]
    if missing:
        raise BadInput(
            "--task",
            task,
            f"{cls.__name__} is not a task: it has no {', '.join(missing)} (see docs/tasks.md)",
        )
    rules = cls.rules
    if not (isinstance(rules, type) and issubclass(rules, TaskRules)):
        raise BadInput("--task", task, f"{cls.__name__}.rules is not a TaskRules class")
