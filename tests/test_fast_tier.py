"""The fast tier (`pytest -m "not slow"`) starts no process: every test that starts one carries
the `slow` mark, on the test, its class or its module (`pytestmark`).

Read from the tests' source (ast), not by running them: a test starts a process when its body,
a helper it calls (in its module or another of tests/), or a fixture it takes (its module's or a
conftest's) calls subprocess, os.system/fork/spawn*, multiprocessing or torch.multiprocessing,
or the N-rank harness (`run_ranks`, `check_equivalence(s)` of `gradaccum.testing`). torchrun,
the CLI as a subprocess and the examples all go through one of those.
"""

from __future__ import annotations

import ast
import os
from functools import cache

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)

STARTERS = {
    *(f"subprocess.{f}" for f in ("run", "Popen", "call", "check_call", "check_output")),
    *(f"subprocess.{f}" for f in ("getoutput", "getstatusoutput")),
    *(f"os.{f}" for f in ("system", "popen", "fork", "forkpty", "posix_spawn", "posix_spawnp")),
    *(f"os.{f}" for f in ("spawnl", "spawnle", "spawnlp", "spawnv", "spawnve", "spawnvp")),
    *(f"multiprocessing.{f}" for f in ("Process", "Pool", "get_context")),
    *(f"torch.multiprocessing.{f}" for f in ("spawn", "start_processes", "Process", "Pool")),
}
"""What starts a process, by qualified name."""

HARNESS = {"run_ranks", "check_equivalence", "check_equivalences"}
"""The N-rank harness's entry points (`gradaccum.testing`, re-exported by tests/ helpers)."""


class Module:
    """One module of tests/: what its names refer to, its functions and fixtures, its mark."""

    def __init__(self, path: str):
        self.path = path
        rel = os.path.relpath(path, ROOT)[: -len(".py")].split(os.sep)
        self.name = ".".join(rel[:-1] if rel[-1] == "__init__" else rel)
        self.package = ".".join(rel[:-1])
        with open(path) as f:
            self.tree = ast.parse(f.read(), path)
        self.aliases: dict[str, str] = {}
        self.functions: dict[str, ast.FunctionDef] = {}
        self.fixtures: dict[str, ast.FunctionDef] = {}
        self.tests: list[tuple[str, ast.FunctionDef, bool]] = []  # (id, node, marked slow)
        self.slow = False
        for node in ast.walk(self.tree):  # imports anywhere (some are inside functions)
            if isinstance(node, ast.Import):
                for a in node.names:
                    self.aliases[a.asname or a.name.split(".")[0]] = (
                        a.asname and a.name or (a.name.split(".")[0])
                    )
            elif isinstance(node, ast.ImportFrom):
                base = self._absolute(node)
                for a in node.names:
                    self.aliases[a.asname or a.name] = f"{base}.{a.name}"
        for node in self.tree.body:
            self._top_level(node)

    def _absolute(self, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        parts = self.package.split(".")
        parts = parts[: len(parts) - node.level + 1]
        return ".".join([*parts, *([node.module] if node.module else [])])

    def _top_level(self, node: ast.stmt) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            self.functions[node.name] = node
            if any(_is_fixture(d) for d in node.decorator_list):
                self.fixtures[_fixture_name(node)] = node
            elif node.name.startswith("test"):
                self.tests.append((node.name, node, _marks_slow(node.decorator_list)))
        elif isinstance(node, ast.ClassDef):
            class_slow = _marks_slow(node.decorator_list)
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                    self.functions[f"{node.name}.{item.name}"] = item
                    if any(_is_fixture(d) for d in item.decorator_list):
                        self.fixtures[_fixture_name(item)] = item
                    elif node.name.startswith("Test") and item.name.startswith("test"):
                        slow = class_slow or _marks_slow(item.decorator_list)
                        self.tests.append((f"{node.name}::{item.name}", item, slow))
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in targets):
                value = node.value
                self.slow = _marks_slow(
                    value.elts if isinstance(value, ast.List | ast.Tuple) else [value]
                )

    def qualify(self, node: ast.expr) -> str | None:
        """The dotted name `node` refers to (a local function as module.name), or None."""
        if isinstance(node, ast.Name):
            if node.id in self.aliases:
                return self.aliases[node.id]
            return f"{self.name}.{node.id}" if node.id in self.functions else node.id
        if isinstance(node, ast.Attribute):
            base = self.qualify(node.value)
            return None if base is None else f"{base}.{node.attr}"
        return None


def _dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Call):
        return _dotted(node.func)
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return node.id if isinstance(node, ast.Name) else ""


def _marks_slow(decorators) -> bool:
    return any(_dotted(d).endswith("mark.slow") for d in decorators)


def _is_fixture(decorator: ast.expr) -> bool:
    return _dotted(decorator).split(".")[-1] == "fixture"


def _fixture_name(node: ast.FunctionDef) -> str:
    for d in node.decorator_list:
        if isinstance(d, ast.Call) and _is_fixture(d):
            for kw in d.keywords:
                if kw.arg == "name" and isinstance(kw.value, ast.Constant):
                    return kw.value.value
    return node.name


@cache
def module(name: str) -> Module | None:
    """tests/'s module `name` (dotted, from the repository root), or None if not one of them."""
    if not (name == "tests" or name.startswith("tests.")):
        return None
    path = os.path.join(ROOT, *name.split("."))
    for candidate in (f"{path}.py", os.path.join(path, "__init__.py")):
        if os.path.isfile(candidate):
            return Module(candidate)
    return None


def _resolve(qualified: str) -> tuple[Module, ast.FunctionDef] | None:
    """The tests/ function a dotted name refers to, through modules' imports, or None."""
    head, _, tail = qualified.rpartition(".")
    while head:
        mod = module(head)
        if mod is not None:
            if tail in mod.functions:
                return mod, mod.functions[tail]
            if tail in mod.aliases and mod.aliases[tail] != qualified:  # a re-export
                return _resolve(mod.aliases[tail])
            return None
        head, _, rest = head.rpartition(".")
        tail = f"{rest}.{tail}"
    return None


def _conftest_fixtures(mod: Module) -> list[Module]:
    """The conftest modules that serve `mod`: its folder's, then each parent's up to tests/."""
    found, parts = [], mod.package.split(".")
    while parts:
        conf = module(".".join([*parts, "conftest"]))
        if conf is not None:
            found.append(conf)
        parts = parts[:-1]
    return found


def starts_process(mod: Module, fn: ast.FunctionDef, seen: set | None = None) -> str | None:
    """What makes `fn` start a process (a dotted name, through helpers and fixtures), or None."""
    seen = set() if seen is None else seen
    if (mod.path, fn.lineno) in seen:
        return None
    seen.add((mod.path, fn.lineno))
    for node in ast.walk(fn):
        if not isinstance(node, ast.Name | ast.Attribute):
            continue
        q = mod.qualify(node)
        if q is None:
            continue
        if q in STARTERS or q.split(".")[-1] in HARNESS:
            return q
        target = _resolve(q)
        if target is not None and (why := starts_process(*target, seen)):
            return f"{q} -> {why}"
    args = fn.args
    for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]:
        for owner in [mod, *_conftest_fixtures(mod)]:
            if a.arg in owner.fixtures and owner.fixtures[a.arg] is not fn:
                if why := starts_process(owner, owner.fixtures[a.arg], seen):
                    return f"fixture {a.arg} -> {why}"
                break
    return None


def unmarked_starters(folder: str = TESTS) -> list[str]:
    """Every test under `folder` that starts a process and lacks the slow mark, with why."""
    out = []
    for dirpath, _, files in os.walk(folder):
        for f in sorted(files):
            if not (f.startswith("test_") and f.endswith(".py")):
                continue
            rel = os.path.relpath(os.path.join(dirpath, f), ROOT)[: -len(".py")]
            mod = module(rel.replace(os.sep, "."))
            for test_id, node, slow in mod.tests:
                if not (slow or mod.slow) and (why := starts_process(mod, node)):
                    out.append(f"{rel}.py::{test_id} ({why})")
    return sorted(out)


def test_every_test_that_starts_a_process_is_marked_slow():
    assert unmarked_starters() == [], "mark these @pytest.mark.slow"


def test_the_check_sees_a_process_started_through_a_helper_or_a_fixture():
    mod = module("tests.distributed.test_train_ddp")
    names = {test_id: starts_process(mod, node) for test_id, node, _ in mod.tests}
    assert any(why and "subprocess." in why for why in names.values()), names
    mod = module("tests.train.test_faults")
    through = [why for _, node, _ in mod.tests if (why := starts_process(mod, node))]
    assert any(" -> " in why for why in through), through
