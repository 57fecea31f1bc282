"""The package's import layers, as docs/design.md writes them: each package (or module at the
root) imports only from the lines above its own, and no two modules import each other, even
through others. Every import counts: at a module's top, inside a function and under
`TYPE_CHECKING`."""

from __future__ import annotations

import ast
import os
import re
from collections.abc import Iterator

import pytest

import gradaccum

SRC = os.path.dirname(os.path.abspath(gradaccum.__file__))
DESIGN = os.path.join(SRC, "..", "..", "docs", "design.md")
BLOCK_OPENS = "Import layers:"


def layers() -> list[list[str]]:
    """The units of each line of the layer block in docs/design.md, top line first."""
    with open(DESIGN, encoding="utf-8") as f:
        text = f.read()
    after = text[text.index(BLOCK_OPENS) :]
    block = re.search(r"```\n(.*?)```", after, re.S).group(1)
    return [line.split() for line in block.splitlines() if line.strip()]


def modules() -> dict[str, str]:
    """Every module of the package by its dotted name (a package by its own), to its file."""
    found = {}
    for folder, _, files in os.walk(SRC):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            parts = os.path.relpath(path, os.path.dirname(SRC))[:-3].split(os.sep)
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def unit(module: str) -> str:
    """The layer unit a module belongs to: its top package, or itself at the root
    ("gradaccum" for the package's own __init__)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def imports(module: str, path: str, known: dict[str, str]) -> Iterator[tuple[str, int]]:
    """(module imported, line) for each import of a gradaccum module in `path`, wherever it
    stands; `from gradaccum.x import y` is module x.y when y is a module, else x."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "gradaccum":
                    yield _existing(alias.name, known), node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            if base.split(".")[0] != "gradaccum":
                continue
            for alias in node.names:
                full = f"{base}.{alias.name}"
                yield (full if full in known else _existing(base, known)), node.lineno


def _existing(name: str, known: dict[str, str]) -> str:
    while name not in known and "." in name:
        name = name.rpartition(".")[0]
    return name


def graph() -> dict[str, set[tuple[str, int]]]:
    known = modules()
    return {m: set(imports(m, path, known)) for m, path in known.items()}


def against_layers(order: list[list[str]], edges) -> list[str]:
    """Each import of a unit from its own line's other units or from a line below."""
    line_of = {name: i for i, line in enumerate(order) for name in line}
    wrong = []
    for module, targets in sorted(edges.items()):
        for target, lineno in sorted(targets):
            a, b = unit(module), unit(target)
            if a != b and line_of[b] >= line_of[a]:
                where = "beside" if line_of[b] == line_of[a] else "below"
                wrong.append(f"{module}:{lineno} imports {target} ({b}: {where} {a})")
    return wrong


def cycles(edges) -> list[list[str]]:
    """The groups of modules that import each other (Tarjan's strongly connected components
    of more than one module, or a module importing itself)."""
    succ = {m: {t for t, _ in ts if t != m} for m, ts in edges.items()}
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in succ.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(succ):
        if v not in index:
            visit(v)
    return found


def test_every_unit_of_the_package_is_on_one_line_of_the_layers():
    order = layers()
    named = [name for line in order for name in line]
    units = {unit(m) for m in modules()}
    assert sorted(named) == sorted(set(named)), "a unit on two lines"
    assert set(named) == units, (set(named) - units, units - set(named))


def test_no_import_goes_beside_or_below():
    assert against_layers(layers(), graph()) == []


def test_no_two_modules_import_each_other():
    assert cycles(graph()) == []


@pytest.mark.parametrize(
    "source, wrong",
    [
        # an upward import inside a function, and one under TYPE_CHECKING: both found
        ("def f():\n    from gradaccum.train import loop\n", "imports gradaccum.train.loop"),
        (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from gradaccum.cli import x\n",
            "imports gradaccum.cli",
        ),
        ("from ..bench import report\n", "imports gradaccum.bench"),  # relative
        ("from gradaccum import moe\n", "imports gradaccum.moe (moe: beside fit)"),
    ],
)
def test_the_check_sees_each_way_of_writing_an_import(tmp_path, source, wrong):
    path = tmp_path / "probe.py"
    path.write_text(source)
    known = modules()
    edges = {"gradaccum.fit.probe": set(imports("gradaccum.fit.probe", str(path), known))}
    found = against_layers(layers(), edges)
    assert len(found) == 1 and wrong in found[0], found


def test_the_check_sees_a_cycle_through_three_modules():
    edges = {"a": {("b", 1)}, "b": {("c", 1)}, "c": {("a", 1)}, "d": {("a", 1)}}
    assert cycles(edges) == [["a", "b", "c"]]
