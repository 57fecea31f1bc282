"""grpo.rewards: the built-in rewards on hand-written completions (values worked out by hand),
loading --reward functions from modules and files written here, every bad spec's one-line
message, the probe before sampling and the weighted sum."""

from __future__ import annotations

import math
import sys

import pytest

from gradaccum.grpo.rewards import (
    RewardError,
    RewardFn,
    builtin_rewards,
    load_rewards,
    probe,
    score,
)
from gradaccum.utils.errors import BadInput

# (prompt, completion, stopped with EOS, exact match, partial match, format: each by hand)
CASES = [
    ("reverse: cab\n", "bac", True, 1, 1, 1),
    ("sort: cab\n", "abc", True, 1, 1, 1),
    ("add: 37+5\n", "42", False, 1, 1, 0),  # right, but cut at the budget
    ("count b: abcbba\n", "3", True, 1, 1, 1),
    ("add: 1+1\n", "2x", True, 0, 1 / 2, 0),  # x is no digit; "2" right, one too many
    ("reverse: ab\n", "", True, 0, 0, 0),  # empty
    ("reverse: ab\n", "ab", True, 0, 0, 1),  # wrong, well formed
    ("sort: cab\n", "12", True, 0, 0, 0),  # digits for a letters task
    ("count a: aa\n", "b", True, 0, 0, 0),  # a letter for a count
    ("add: 9+9\n", "17", True, 0, 1 / 2, 1),  # 18: the 1 right
    ("sort: cab\n", "abcd", True, 0, 3 / 4, 1),  # one letter too many
    ("reverse: abc\n", "cb", True, 0, 2 / 3, 1),  # cba: one letter short
]


def test_builtin_rewards_by_hand():
    prompts, completions, stopped, exact, partial, form = (
        list(x) for x in zip(*CASES, strict=True)
    )
    rewards = builtin_rewards()
    assert [(r.name, r.weight) for r in rewards] == [
        ("exact_match", 1.0), ("partial_match", 1.0), ("format", 0.2)]  # fmt: skip
    total, per = score(rewards, prompts, completions, {"stopped": stopped})
    assert per["exact_match"] == exact and per["format"] == form
    assert per["partial_match"] == pytest.approx(partial, abs=1e-12)
    by_hand = [2.2, 2.2, 2.0, 2.2, 0.5, 0.0, 0.2, 0.0, 0.0, 0.7, 0.95, 2 / 3 + 0.2]
    assert total == pytest.approx(by_hand, abs=1e-12)


OK_MODULE = """
def length(prompts, completions, **columns):
    return [float(len(c)) for c in completions]

def const(prompts, completions, **columns):
    return [2.0] * len(completions)

NOT_CALLABLE = 3
"""


@pytest.fixture
def reward_dir(tmp_path, monkeypatch):
    """tmp_path as the working directory, holding modules rw_ok, rw_raises, rw_bad_import,
    the package rw_pkg (rw_pkg.inner) and the file sub/rw_file.py; the rw_ modules imported
    are forgotten afterwards."""
    (tmp_path / "rw_ok.py").write_text(OK_MODULE)
    (tmp_path / "rw_raises.py").write_text("raise RuntimeError('boom\\nsecond line')\n")
    (tmp_path / "rw_bad_import.py").write_text("import rw_not_a_module_q\n")
    (tmp_path / "rw_pkg").mkdir()
    (tmp_path / "rw_pkg" / "__init__.py").write_text("")
    (tmp_path / "rw_pkg" / "inner.py").write_text(OK_MODULE)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "rw_file.py").write_text(OK_MODULE)
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    for name in [m for m in sys.modules if m.startswith("rw_")]:
        del sys.modules[name]


def test_load_rewards_from_the_working_directory_and_weighted_sum(reward_dir):
    path = list(sys.path)
    rewards = load_rewards("rw_ok:length, rw_pkg.inner:const,sub/rw_file.py:length", "0.5,-1,2")
    assert sys.path == path
    assert [(r.name, r.weight) for r in rewards] == [
        ("rw_ok:length", 0.5),
        ("rw_pkg.inner:const", -1.0),
        ("sub/rw_file.py:length", 2.0),
    ]
    total, per = score(rewards, ["p", "q"], ["ab", "abcd"], {"stopped": [True, False]})
    # 0.5 * len - 2 + 2 * len
    assert total == [0.5 * 2 - 2 + 2 * 2, 0.5 * 4 - 2 + 2 * 4]
    assert per == {
        "rw_ok:length": [2.0, 4.0],
        "rw_pkg.inner:const": [2.0, 2.0],
        "sub/rw_file.py:length": [2.0, 4.0],
    }
    assert [r.weight for r in load_rewards("rw_ok:const", None)] == [1.0]


@pytest.mark.parametrize(
    "spec, why",
    [
        ("rw_ok", "must be MODULE:FUNCTION or FILE.py:FUNCTION"),
        ("rw_nowhere_zz:f", "No module named 'rw_nowhere_zz'"),
        ("rw_raises:f", "importing rw_raises raised RuntimeError: boom"),
        (
            "rw_bad_import:f",
            "importing rw_bad_import raised ModuleNotFoundError: "
            "No module named 'rw_not_a_module_q'",
        ),
        ("rw_ok:missing", "module rw_ok has no attribute missing"),
        ("rw_ok:NOT_CALLABLE", "NOT_CALLABLE is not callable (int)"),
        ("sub/none.py:f", "no file sub/none.py"),
    ],
)
def test_bad_reward_spec(reward_dir, spec, why):
    with pytest.raises(BadInput) as err:
        load_rewards(spec, None)
    assert str(err.value) == f"--reward {spec}: {why}"
    assert err.value.flag == "--reward"


@pytest.mark.parametrize(
    "spec, why",
    [
        ("rw_ok:length,,rw_ok:const", "an empty name in the list"),
        ("rw_ok:length,rw_ok:length", "names a function twice"),
    ],
)
def test_bad_reward_list(reward_dir, spec, why):
    with pytest.raises(BadInput, match=f"^--reward {spec}: {why}$"):
        load_rewards(spec, None)


@pytest.mark.parametrize(
    "spec, weights, why",
    [
        (None, "1", "needs --reward"),
        ("rw_ok:length,rw_ok:const", "1", "1 weights for 2 --reward functions"),
        ("rw_ok:length,rw_ok:const", "1,x", "must be numbers separated by commas"),
        ("rw_ok:length,rw_ok:const", "1,nan", "must be finite numbers"),
        ("rw_ok:length", "inf", "must be finite numbers"),
    ],
)
def test_bad_reward_weights(reward_dir, spec, weights, why):
    with pytest.raises(BadInput) as err:
        load_rewards(spec, weights)
    assert str(err.value) == f"--reward-weights {weights}: {why}"


def test_probe_calls_with_stand_ins_and_cut_columns():
    seen = {}

    def record(prompts, completions, **columns):
        seen.update(prompts=prompts, completions=completions, columns=columns)
        return [0.0, 1]

    prompts = ["p0", "p1", "p2"]
    columns = {"completion": ["r0", "r1", "r2"], "task": ["a", "b", "c"]}
    probe([RewardFn("rec", record)], prompts, columns)
    assert seen == {
        "prompts": ["p0", "p1"],
        "completions": ["", "r1"],
        "columns": {"completion": ["r0", "r1"], "task": ["a", "b"], "stopped": [True, True]},
    }
    probe([RewardFn("rec", record)], ["only"], {})
    assert seen["prompts"] == ["only", "only"] and seen["completions"] == ["", "a"]
    # the built-in rewards on the built-in set's rows pass
    probe(builtin_rewards(), ["add: 1+2\n", "sort: ba\n"], {"completion": ["3", "ab"]})


def _raises(prompts, completions, **columns):
    raise ValueError("bad value\nmore detail")


@pytest.mark.parametrize(
    "fn, why",
    [
        (_raises, "raised ValueError: bad value"),
        (lambda p, c, **k: [1.0, 2.0, 3.0], "returned 3 values for 2 completions"),
        (lambda p, c, **k: None, "returned a NoneType, not a list of numbers"),
        (lambda p, c, **k: ["x", 1.0], "returned 'x' at 0, not a number"),
        (lambda p, c, **k: [1.0, math.nan], "returned nan at 1, not a finite number"),
        (lambda p, c, **k: [math.inf, 1.0], "returned inf at 0, not a finite number"),
    ],
)
def test_probe_refuses(fn, why):
    with pytest.raises(BadInput) as err:
        probe([RewardFn("m:f", lambda p, c, **k: [0.0, 0.0]), RewardFn("m:g", fn)], ["a", "b"], {})
    assert str(err.value) == f"--reward m:g: {why}"


def test_probe_names_a_builtin_reward_on_other_prompts():
    with pytest.raises(BadInput, match="^--reward exact_match: raised ValueError: not a built-in"):
        probe(builtin_rewards(), ["Tell me a story\n", "hello\n"], {})


@pytest.mark.parametrize(
    "fn, why",
    [
        (_raises, "raised ValueError: bad value"),
        (lambda p, c, **k: [1.0], "returned 1 values for 3 completions"),
        (lambda p, c, **k: [1.0, math.inf, 0.0], "returned inf at 1, not a finite number"),
    ],
)
def test_score_stops_on_a_failing_function(fn, why):
    with pytest.raises(RewardError) as err:
        score([RewardFn("m:f", fn)], ["a"] * 3, ["x"] * 3, {"stopped": [True] * 3})
    assert isinstance(err.value, RuntimeError)
    assert str(err.value) == f"--reward m:f: {why}"
