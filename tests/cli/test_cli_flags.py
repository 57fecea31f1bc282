"""The flags several commands share: one definition each (`gradaccum.cli.flags`), read alike in
every command that offers them; the parsers build, and bad flags are refused, without torch."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import traceback
from dataclasses import fields

import pytest

from gradaccum.bench import BenchConfig
from gradaccum.cli import build_parser, main
from gradaccum.cli.bench import COUNTS
from gradaccum.fit import BATCH_TOLERANCE
from gradaccum.utils.choices import BUILTIN_MODELS, PRECISIONS

FLAGS_PY = os.path.join("gradaccum", "cli", "flags.py")
GENERIC = {"_add", "count", "size", "seconds", "number"}
"""cli/flags.py's helpers for a command's own numbers: the flag is defined where they are
called."""


def commands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {
        s: a
        for a in parser._actions
        for s in a.option_strings
        if s.startswith("--") and s != "--help"
    }


def shared_flags() -> list[str]:
    offered = [set(options(p)) for p in commands().values()]
    return sorted(f for f in set().union(*offered) if sum(f in o for o in offered) > 1)


def definition_sites(monkeypatch) -> dict[str, set]:
    """Flag -> where it is defined: the `add_argument` call's place in gradaccum.cli, or the
    function of cli/flags.py that adds it."""
    sites: dict[str, set] = {}
    add = argparse._ActionsContainer.add_argument

    def traced(self, *names, **kw):
        frames = [f for f in traceback.extract_stack()[:-1] if "gradaccum" in f.filename]
        frame = next(
            f for f in reversed(frames) if not (f.filename.endswith(FLAGS_PY) and f.name in GENERIC)
        )
        site = frame.name if frame.filename.endswith(FLAGS_PY) else frame.lineno
        for name in names:
            sites.setdefault(name, set()).add((os.path.basename(frame.filename), site))
        return add(self, *names, **kw)

    monkeypatch.setattr(argparse._ActionsContainer, "add_argument", traced)
    build_parser()
    return sites


def test_a_flag_of_several_commands_is_defined_once_in_flags_py(monkeypatch):
    shared = shared_flags()
    assert {"--model", "--precision", "--seq-len", "--json", "--device"} <= set(shared)
    sites = definition_sites(monkeypatch)
    for flag in shared:
        assert len(sites[flag]) == 1, (flag, sites[flag])
        (where,) = sites[flag]
        assert where[0] == "flags.py", (flag, where)


@pytest.mark.parametrize("flag", shared_flags())
def test_a_shared_flag_has_one_metavar_and_one_set_of_choices(flag):
    # train's values go to TrainConfig as typed (it reads the same keys from TOML): its
    # flags take the field's help and metavar, and TrainConfig checks the choices
    seen = {
        name: options(p)[flag]
        for name, p in commands().items()
        if name != "train" and flag in options(p)
    }
    assert len({a.metavar for a in seen.values()}) == 1, {n: a.metavar for n, a in seen.items()}
    assert len({tuple(a.choices or ()) for a in seen.values()}) == 1


def test_precisions_and_built_in_presets_are_the_listed_ones():
    for name, parser in commands().items():
        opts = options(parser)
        if name != "train" and "--precision" in opts:
            assert tuple(opts["--precision"].choices) == PRECISIONS
        if name in ("fit", "verify", "bench"):
            assert (
                f"built-in GPT: {', '.join(BUILTIN_MODELS)} (default tiny)" in opts["--model"].help
            )


@pytest.mark.parametrize(
    "flag, value, why",
    [
        ("--seq-len", "abc", "not a number or size (examples: 4M, 262k, 7B, 1e6)"),
        ("--seq-len", "1.5", "not a whole number"),
        ("--micro-batch", "0", "must be greater than zero"),
        ("--seed", "-1", "must not be negative"),
        ("--model", "tiny2", "unknown preset; choose one of tiny, small, gpt2-124m, tiny-moe"),
    ],
)
def test_a_bad_value_of_a_shared_flag_is_refused_in_the_same_words_everywhere(
    capsys, flag, value, why
):
    offering = [
        n for n, p in commands().items() if n not in ("train", "plan") and flag in options(p)
    ]
    assert offering
    for name in offering:
        code = main([name, f"{flag}={value}"])
        out, err = capsys.readouterr()
        assert (code, out, err) == (2, "", f"gradaccum: error: {flag} {value}: {why}\n"), name


def test_parsers_build_plans_run_and_bad_flags_are_refused_without_torch():
    script = (
        "import sys\n"
        "from gradaccum.cli import build_parser, main\n"
        "build_parser()\n"
        "assert main(['plan', '--target-tokens', '1M', '--seq-len', '128', '--micro-batch', "
        "'4', '--json']) == 0\n"
        "for argv in (['fit', '--seq-len', 'abc'], ['verify', '--k', 'abc'],\n"
        "             ['bench', '--micro-batch', '0'], ['train', '--no-such-flag']):\n"
        "    assert main(argv) == 2, argv\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_defaults_the_help_states_are_the_ones_that_apply():
    # bench's and fit's parsers build without torch, so their help states defaults that
    # BenchConfig and the fit search hold: the same numbers
    bench, fit = options(commands()["bench"]), options(commands()["fit"])
    defaults = {f.name: f.default for f in fields(BenchConfig)}
    for dest in COUNTS:
        flag = "--" + dest.replace("_", "-")
        assert bench[flag].default is None  # BenchConfig fills it in
        assert f"(default {defaults[dest]})" in bench[flag].help, flag
    assert f"(default {BATCH_TOLERANCE:.0%}%)" in fit["--batch-tolerance"].help
