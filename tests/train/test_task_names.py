"""A task's name is looked up in one place, the registry (`gradaccum.train.tasks.registry`):
no other module of the package compares anything with a task's name (a branch on the task
is what the `Task` protocol replaces)."""

from __future__ import annotations

import ast
import os

import gradaccum
from gradaccum.train.tasks.registry import NAMES

SRC = os.path.dirname(os.path.abspath(gradaccum.__file__))
REGISTRY = os.path.join(SRC, "train", "tasks", "registry.py")


def _names_in(node: ast.AST) -> set[str]:
    """The task names `node` spells: a string constant, or a tuple, list or set of them."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value} & set(NAMES)
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return set().union(*(_names_in(x) for x in node.elts)) if node.elts else set()
    return set()


def comparisons(path: str) -> list[str]:
    """`file:line` of each comparison in `path` of a task (an expression that says "task":
    `config.task`, `saved.get("task")`) with a task's name (`loss_type == "grpo"` is not one:
    a loss's name)."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
        elif isinstance(node, ast.Match):
            sides = [case.pattern.value for case in node.cases
                     if isinstance(case.pattern, ast.MatchValue)]  # fmt: skip
        else:
            continue
        subject = node.subject if isinstance(node, ast.Match) else None
        named = [i for i, side in enumerate(sides) if _names_in(side)]
        others = (
            [subject] if subject is not None else [s for i, s in enumerate(sides) if i not in named]
        )
        if named and any("task" in ast.unparse(other) for other in others):
            found.append(f"{os.path.relpath(path, SRC)}:{node.lineno}")
    return found


def test_no_module_but_the_registry_compares_with_a_task_name():
    found = []
    for folder, _, files in os.walk(SRC):
        for name in files:
            path = os.path.join(folder, name)
            if name.endswith(".py") and path != REGISTRY:
                found += comparisons(path)
    assert found == []


def test_the_check_sees_a_comparison(tmp_path):
    """The check itself: each way of writing one is found."""
    path = tmp_path / "branchy.py"
    path.write_text(
        'if task == "sft": pass\n'
        'if config.task in ("sft", "grpo"): pass\n'
        'x = "pretrain" != self.task\n'
        'match task:\n    case "grpo": pass\n'
        'if mode == "add": pass\n'
        'if loss_type == "grpo": pass\n'
        'if saved.get("task") in ("sft",): pass\n'
    )
    lines = sorted(int(x.rsplit(":", 1)[1]) for x in comparisons(str(path)))
    assert lines == [1, 2, 3, 4, 8]
