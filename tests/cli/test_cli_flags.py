"""The five commands' flags: generated from the settings components (`gradaccum.settings`),
each flag defined once, help grouped by component, read alike in every command that offers
them; the parsers build, and bad flags are refused, without torch."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import traceback
from dataclasses import fields

import pytest

from gradaccum.bench import BenchConfig
from gradaccum.bench.settings import BENCH_DEFAULTS
from gradaccum.cli import COMMANDS, build_parser, main
from gradaccum.fit import BATCH_TOLERANCE
from gradaccum.settings.docs import title

SRC = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GENERATOR = os.path.join("gradaccum", "settings", "command.py")


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


def test_no_add_argument_outside_the_generator():
    calls = []
    for folder, _, files in os.walk(os.path.join(SRC, "src", "gradaccum")):
        for name in files:
            path = os.path.join(folder, name)
            if name.endswith(".py") and not path.endswith(GENERATOR):
                text = open(path).read()
                calls += [path for _ in re.finditer(r"\badd_argument\(", text)]
    assert calls == []


def test_every_flag_of_the_five_commands_is_one_field_added_in_one_place(monkeypatch):
    sites: dict[str, set] = {}
    add = argparse._ActionsContainer.add_argument

    def traced(self, *names, **kw):
        frame = [f for f in traceback.extract_stack()[:-1] if "gradaccum" in f.filename][-1]
        for name in names:
            sites.setdefault(name, set()).add((os.path.basename(frame.filename), frame.lineno))
        return add(self, *names, **kw)

    monkeypatch.setattr(argparse._ActionsContainer, "add_argument", traced)
    parsers = commands()
    assert set(parsers) == set(COMMANDS) == {"plan", "train", "fit", "verify", "bench"}
    for flag, where in sites.items():
        assert {w[0] for w in where} == {"command.py"}, (flag, where)
    # one field per flag: a flag several commands take comes from the same component field
    owners: dict[str, set] = {}
    for parser in parsers.values():
        command = parser.get_default("command_spec")
        for name, (component, _) in command.fields().items():
            owners.setdefault(name, set()).add(component)
    assert all(len(o) == 1 for o in owners.values()), {
        n: o for n, o in owners.items() if len(o) > 1
    }
    shared = [n for n in owners if sum(n in p.get_default("command_spec").fields()
                                       for p in parsers.values()) > 1]  # fmt: skip
    assert {"model", "precision", "seq_len", "json", "device", "micro_batch"} <= set(shared)


@pytest.mark.parametrize("name", ["plan", "train", "fit", "verify", "bench"])
def test_help_is_grouped_by_component(name):
    parser = commands()[name]
    command = parser.get_default("command_spec")
    titles = {title(c) for c, _ in command.fields().values()}
    groups = {g.title: g for g in parser._action_groups}
    assert titles <= set(groups) and len(titles) >= 3
    for component, f in command.fields().values():
        group = groups[title(component)]
        assert any(a.dest == f.name for a in group._group_actions), f.name
    assert not [a for a in groups["options"]._group_actions if a.dest != "help"]


def test_bench_help_shows_the_sft_defaults_beside_the_pretraining_ones(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--task", "sft", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    sft, pretrain = BENCH_DEFAULTS["sft"], BENCH_DEFAULTS["pretrain"]
    assert f"(default {pretrain['micro_batch']}; --task sft {sft['micro_batch']})" in text
    assert f"(default {pretrain['seq_len']}; --task sft {sft['seq_len']})" in text


@pytest.mark.parametrize(
    "flag, value, why",
    [
        ("--seq-len", "abc", "not a number or size (examples: 4M, 262k, 7B, 1e6)"),
        ("--seq-len", "1.5", "not a whole number"),
        ("--micro-batch", "0", "must be a whole number >= 1 or auto"),
        ("--seed", "-1", "must not be negative"),
    ],
)
def test_a_bad_value_of_a_shared_flag_is_refused_in_the_same_words_everywhere(
    capsys, flag, value, why
):
    offering = [n for n, p in commands().items() if n != "plan" and flag in options(p)]
    assert len(offering) >= 3
    for name in offering:
        code = main([name, f"{flag}={value}", "--out", "/nonexistent/x"] if name == "train"
                    else [name, f"{flag}={value}"])  # fmt: skip
        out, err = capsys.readouterr()
        assert (code, out, err) == (2, "", f"gradaccum: error: {flag} {value}: {why}\n"), name


def test_an_unknown_preset_is_refused_in_the_same_words_everywhere(capsys):
    why = "unknown preset; choose one of tiny, small, gpt2-124m, tiny-moe"
    for name in ("fit", "verify", "bench"):
        assert main([name, "--model", "tiny2"]) == 2
        assert capsys.readouterr().err == f"gradaccum: error: --model tiny2: {why}\n", name


@pytest.mark.slow  # a Python process
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
    bench, fit = options(commands()["bench"]), options(commands()["fit"])
    defaults = {f.name: f.default for f in fields(BenchConfig)}
    for dest in ("micro_batch", "accum_steps", "seq_len", "rounds", "windows"):
        flag = "--" + dest.replace("_", "-")
        assert f"(default {defaults[dest]}" in " ".join(bench[flag].help.split()), flag
    assert f"(default {BATCH_TOLERANCE:.0%}%)" in fit["--batch-tolerance"].help
