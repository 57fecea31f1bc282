"""Every command fuzzed with bad values: exit 2, one line, no traceback, nothing written
outside --out.

Values are drawn from lists of values that cannot work (sizes, counts, paths, precisions,
devices), flag combinations that exclude each other and TOML files with wrong types. The
flags come from each command's own parser, so a flag added later is fuzzed too. A fixed seed
and a bounded number of examples keep this in the normal suite; commands run in-process,
and a handful more in a subprocess to see what a user's terminal would.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gradaccum.cli import COMMANDS, build_parser, main

# Bad for every numeric flag of every command: no count, size, time or number reads them.
NUMBERS = ["-3", "abc", "nan", "4Q", "", "1e999", "1.5.2", "0x10"]
PRECISIONS = ["fp8", "FP64", "int4", ""]
DEVICES = ["tpu", "cuda:x", "", "gpu0"]
MISSING = "/nonexistent/gradaccum-fuzz/x.json"
NUMERIC_METAVARS = {"N", "K", "X", "T", "SIZE", "N|auto", "SECONDS"}
# Paths read as input (a missing one is an error; --out is made when missing).
INPUT_PATHS = {"model_config", "init_from", "data", "config_file"}
# Values that are fine for one flag and not another: the generic lists leave them out.
NOT_FOR = {"--seed": {"1e999"}}


def subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def bad_pairs(name: str) -> list[tuple[str, str]]:
    """(flag, value) pairs that must be refused, read off the command's parser."""
    pairs = []
    for action in subparsers()[name]._actions:
        flags = [f for f in action.option_strings if f.startswith("--")]
        if not flags or action.nargs == 0 or flags[0] in ("--help", "--out", "--config"):
            continue
        flag = flags[0]
        if action.choices:
            pairs += [(flag, v) for v in ["bogus", "", "0.5"] if v not in action.choices]
        elif action.metavar in NUMERIC_METAVARS:
            pairs += [(flag, v) for v in NUMBERS if v not in NOT_FOR.get(flag, ())]
        elif action.metavar == "DEVICE":
            pairs += [(flag, v) for v in DEVICES]
        elif action.metavar in ("PRESET", "NAME") and "precision" not in action.dest:
            pairs += [(flag, "no-such-preset")]
        elif action.metavar in ("PATH", "DIR") and action.dest in INPUT_PATHS:
            pairs += [(flag, MISSING)]
        elif action.metavar == "NAMES":
            pairs += [(flag, v) for v in ["deepspeed", ",", "none,deepspeed"]]
        if "precision" in action.dest and not action.choices:
            pairs += [(flag, v) for v in PRECISIONS]
    return pairs


def run_in(folder: str, argv: list[str]) -> tuple[int, str, str]:
    """main(argv) with `folder` as the working directory; (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    here = os.getcwd()
    os.chdir(folder)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(argv)
    finally:
        os.chdir(here)
    return code, out.getvalue(), err.getvalue()


def check_refused(argv: list[str], setup=None) -> None:
    """Run argv in a fresh folder: exit 2, one line on stderr, no traceback, and nothing new
    in the folder but --out (the files `setup` wrote are the user's)."""
    with tempfile.TemporaryDirectory() as folder:
        theirs = set(setup(folder)) if setup else set()
        argv = [a.replace("{tmp}", folder) for a in argv]
        code, out, err = run_in(folder, argv)
        lines = err.strip().splitlines()
        assert code == 2, (argv, code, out[-500:], err[-500:])
        assert len(lines) == 1 and ": error: " in lines[0], (argv, err)
        assert "Traceback" not in out + err
        written = set(os.listdir(folder)) - theirs - {"out"}
        assert not written, (argv, written)


def flatten(pairs) -> list[str]:
    return [f"{flag}={value}" for flag, value in pairs]


FUZZ = settings(
    derandomize=True,
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


# ---- plan -------------------------------------------------------------------------------

PLAN_COMBOS = [
    ["--target-tokens", "1M", "--accum-steps", "4", "--seq-len", "128", "--micro-batch", "4"],
    ["--target-tokens", "1M", "--target-sequences", "8", "--seq-len", "128"],
    ["--target-tokens", "1M", "--seq-len", "128", "--micro-batch", "4", "--micro-tokens", "512"],
    [
        "--target-tokens",
        "1M",
        "--seq-len",
        "128",
        "--micro-batch",
        "4",
        "--params",
        "7B",
        "--model",
        "llama2-7b",
    ],
    ["--target-tokens", "1M", "--seq-len", "128", "--micro-batch", "4", "--layers", "2"],
    ["--target-tokens", "100", "--seq-len", "128", "--micro-batch", "4"],
    ["--target-tokens", "1M", "--seq-len", "128", "--micro-batch", "4", "--base-lr", "1e-3"],
    [
        "--target-tokens",
        "1M",
        "--seq-len",
        "128",
        "--micro-batch",
        "4",
        "--steps",
        "10",
        "--total-tokens",
        "1B",
    ],
    ["--target-tokens", "1M", "--seq-len", "128", "--micro-batch", "4", "--mfu", "150%"],
    [
        "--target-tokens",
        "1M",
        "--seq-len",
        "128",
        "--micro-batch",
        "4",
        "--hidden",
        "64",
        "--heads",
        "3",
        "--layers",
        "2",
        "--vocab",
        "100",
    ],
]


@FUZZ
@given(st.data())
def test_plan_refuses_bad_values(data):
    pairs = data.draw(st.lists(st.sampled_from(bad_pairs("plan")), min_size=1, max_size=3))
    check_refused(["plan", *flatten(pairs)])


@FUZZ
@given(st.sampled_from(PLAN_COMBOS), st.booleans())
def test_plan_refuses_flags_that_exclude_each_other(argv, as_json):
    check_refused(["plan", *argv] + (["--json"] if as_json else []))


# ---- train ------------------------------------------------------------------------------

# A short valid run around the fuzzed flags, so that a value wrongly accepted ends in one
# small step inside --out rather than in a long default run; the fuzzed flags come after and win.
TRAIN_AROUND = ["--out", "{tmp}/out", "--seq-len", "8", "--tokens-per-step", "64"]

TOML_FILES = {
    "type.toml": 'seq_len = "abc"\n',
    "float.toml": "seq_len = 1.5\n",
    "bool.toml": "lr = true\n",
    "number.toml": "precision = 3\n",
    "yes.toml": 'json = "yes"\n',
    "list.toml": 'model = ["tiny"]\n',
    "table.toml": "[device]\nkind = 'cpu'\n",
    "unknown.toml": "no_such_key = 1\n",
    "syntax.toml": "seq_len = = 3\n",
    "negative.toml": "micro_batch = -4\n",
    "zero.toml": "max_steps = 0\n",
    "huge.toml": "tokens_per_step = 1e30\n",
    "nan.toml": "accum_steps = nan\n",
    "both.toml": "max_steps = 1\nmax_tokens = 100\n",
    "empty-out.toml": 'out = ""\n',
}
TRAIN_COMBOS = [
    ["--resume"],
    ["--resume", "--out", "{tmp}/out"],
    ["--model", "tiny", "--model-config", MISSING],
    ["--model", "tiny", "--init-from", "{tmp}"],
    ["--max-steps", "1", "--max-tokens", "1M"],
    ["--micro-batch", "4", "--accum-steps", "2", "--tokens-per-step", "100"],
    ["--seq-len", "100000"],
    ["--tokens-per-step", "7", "--seq-len", "8"],
    ["--config", "{tmp}/no-such.toml"],
    ["--config", "{tmp}"],
    ["--config", "{tmp}/binary.toml"],
    ["--data", "{tmp}"],
    ["--model-config", "{tmp}/bad.json"],
] + [["--config", "{tmp}/" + name] for name in TOML_FILES]


def train_files(folder: str) -> list[str]:
    for name, text in TOML_FILES.items():
        with open(os.path.join(folder, name), "w") as f:
            f.write(text)
    with open(os.path.join(folder, "binary.toml"), "wb") as f:
        f.write(b"\xff\xfe\x00 not text")
    with open(os.path.join(folder, "bad.json"), "w") as f:
        f.write("{ not json")
    return [*TOML_FILES, "binary.toml", "bad.json"]


@FUZZ
@given(st.data())
def test_train_refuses_bad_values(data):
    pairs = data.draw(st.lists(st.sampled_from(bad_pairs("train")), min_size=1, max_size=3))
    around = list(TRAIN_AROUND)
    if not any(flag == "--max-tokens" for flag, _ in pairs):
        around += ["--max-steps", "1"]
    check_refused(["train", *around, *flatten(pairs)])


@FUZZ
@given(st.sampled_from(TRAIN_COMBOS), st.lists(st.sampled_from(bad_pairs("train")), max_size=1))
def test_train_refuses_combinations_and_bad_toml(argv, extra):
    check_refused(["train", *argv, *flatten(extra)], setup=train_files)


# ---- bench ------------------------------------------------------------------------------

BENCH_COMBOS = [
    ["--model", "tiny", "--model-config", "{tmp}/gpt2.json"],
    ["--model-config", "{tmp}/gpt2.json", "--seq-len", "4096"],
    ["--model-config", "{tmp}/bad.json"],
    ["--model-config", "{tmp}"],
    ["--peers", "deepspeed"],
    ["--peers", ","],
    ["--peers", "none,accelerate"],
    ["--seq-len", "1"],
    ["--micro-batch", "2M"],
    ["--rounds", "0"],
    ["--windows", "0", "--json"],
    ["--device", "cuda:99"],
]


def bench_files(folder: str) -> list[str]:
    gpt2 = {
        "model_type": "gpt2",
        "n_layer": 1,
        "n_embd": 16,
        "n_head": 2,
        "vocab_size": 32,
        "n_positions": 16,
        "bos_token_id": 0,
        "eos_token_id": 0,
    }
    with open(os.path.join(folder, "gpt2.json"), "w") as f:
        json.dump(gpt2, f)
    with open(os.path.join(folder, "bad.json"), "w") as f:
        f.write("{ not json")
    return ["gpt2.json", "bad.json"]


@FUZZ
@given(st.data())
def test_bench_refuses_bad_values(data):
    pairs = data.draw(st.lists(st.sampled_from(bad_pairs("bench")), min_size=1, max_size=3))
    check_refused(["bench", "--peers", "none", *flatten(pairs)])


@FUZZ
@given(st.sampled_from(BENCH_COMBOS))
def test_bench_refuses_combinations(argv):
    check_refused(["bench", *argv], setup=bench_files)


# ---- the rest: whatever else is registered, from its parser alone ------------------------

OTHERS = [n for n in COMMANDS if n not in ("plan", "train", "bench")]


@pytest.mark.parametrize("name", OTHERS)
def test_other_commands_refuse_bad_values(name):
    pairs = bad_pairs(name) or [("--no-such-flag", "1")]

    @settings(derandomize=True, max_examples=15, deadline=None)
    @given(st.lists(st.sampled_from(pairs), min_size=1, max_size=2))
    def fuzz(chosen):
        check_refused([name, *flatten(chosen)])

    fuzz()


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_unknown_flags_and_values_are_refused(name):
    check_refused([name, "--no-such-flag", "3"])


# ---- as a user's terminal sees it --------------------------------------------------------

TERMINAL = {
    "plan": ["--seq-len", "-4"],
    "train": ["--precision", "fp8"],
    "bench": ["--micro-batch", "0"],
    "fit": ["--seq-len", "abc"],
    "verify": ["--seq-len", "0"],
}


@pytest.mark.slow  # a process per command
@pytest.mark.parametrize("name", sorted(TERMINAL))
def test_a_subprocess_exits_2_with_one_line(name, tmp_path):
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [sys.executable, "-m", "gradaccum", name, *TERMINAL[name]],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert not list(tmp_path.iterdir())
