"""The rewards of RL fine-tuning: functions of text, their weighted sum per completion.

A reward function is called on a batch of completions:

    fn(prompts: list[str], completions: list[str], **columns) -> list[float]

one number per completion, prompts[i] the prompt completion i answers (repeated for the G
completions of a group), completions as text without EOS. The columns, lists as long as
completions, are:
- `stopped`: whether the completion ended with EOS within --max-completion-length (False when
  it was cut at the budget);
- the data's other columns for that prompt, when the data has them: `completion` (the
  reference answer), `task` for the built-in set, a user's own fields.
A function should take **kwargs for the columns it does not read. The reward of completion i
is sum over functions f of w_f * r_f[i] (`score`).

Where they come from (`load_rewards`): --reward "module:function,..." (a module importable
from the working directory, as `python -m` finds it, or from the Python path; a dotted path;
or a file, `path/to/file.py:function`), weighted by --reward-weights "w,..." (1 each when not
given). Without --reward, `builtin_rewards()`: for the built-in instruction set
(`gradaccum.data.sft.builtin`), exact match (weight 1), partial match (weight 1) and format
(weight 0.2).

Errors: before any sampling `probe` calls each function once on stand-in completions, so a
function that cannot work stops the run at once with one line naming it (BadInput, exit 2);
one that fails in the middle of a run raises `RewardError` (a RunFailed: one line, exit 1).
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Callable
from dataclasses import dataclass

from gradaccum.data.sft import builtin
from gradaccum.utils.errors import BadInput, RunFailed, first_line
from gradaccum.utils.imports import load_module

__all__ = [
    "RewardError",
    "RewardFn",
    "builtin_rewards",
    "format_reward",
    "exact_match_reward",
    "partial_match_reward",
    "load_rewards",
    "probe",
    "score",
]


@dataclass
class RewardFn:
    """One reward function and its weight in the sum."""

    name: str
    """How it is named in messages and metrics: "exact_match", or "module:function" as given
    to --reward."""
    fn: Callable
    """fn(prompts, completions, **columns) -> one number per completion (module docstring)."""
    weight: float = 1.0
    """Its weight w_f in the reward sum_f w_f r_f."""


class RewardError(RunFailed):
    """A reward function that failed during the run: raised, returned the wrong count or a
    value that is not a finite number. One line: "--reward NAME: WHY"."""

    def __init__(self, name: str, why: str):
        self.name = name
        self.why = why
        super().__init__(f"--reward {name}: {why}")


# -- the built-in instruction set's rewards -----------------------------------------------

ANSWER_ALPHABETS = {"reverse": set(builtin.LETTERS), "sort": set(builtin.LETTERS)}
"""Characters an answer is made of, by task; digits for add and count."""
DIGITS = set("0123456789")


def exact_match_reward(prompts: list[str], completions: list[str], **columns) -> list[float]:
    """1.0 where the completion is the built-in task's answer (`builtin.check`), else 0.0.
    ValueError for a prompt of no built-in task."""
    return [float(builtin.check(p, c)) for p, c in zip(prompts, completions, strict=True)]


def partial_match_reward(prompts: list[str], completions: list[str], **columns) -> list[float]:
    """The share of the answer's characters the completion has at their place: the positions
    i where completion[i] == answer[i], over the longer of the two lengths (so a completion
    too long or too short loses the positions it lacks or adds). 1.0 exactly where exact
    match is 1; "acb" for "abc" scores 1/3, "abcd" 3/4, "" 0. The partial credit makes most
    groups' rewards differ where few completions are right, so most prompts give a gradient.
    ValueError for a prompt of no built-in task."""
    found = []
    for p, c in zip(prompts, completions, strict=True):
        answer = builtin.solve(p)
        same = sum(a == b for a, b in zip(c, answer, strict=False))
        found.append(same / max(len(c), len(answer)))
    return found


def format_reward(
    prompts: list[str], completions: list[str], stopped: list[bool], **columns
) -> list[float]:
    """1.0 where the completion ended with EOS within the budget (`stopped`) and is a
    non-empty string of the task's answer alphabet (letters a-f for reverse and sort, digits
    for add and count), else 0.0: an answer of the right form, right or not. No answer of
    these tasks is empty, so an empty one does not count. ValueError for a prompt of no
    built-in task."""
    return [
        float(bool(s) and bool(c) and set(c) <= _alphabet(p))
        for p, c, s in zip(prompts, completions, stopped, strict=True)
    ]


def _alphabet(prompt: str) -> set[str]:
    builtin.solve(prompt)  # ValueError for a prompt of no built-in task
    task = prompt.partition(":")[0]
    return ANSWER_ALPHABETS.get(task, DIGITS)


def builtin_rewards() -> list[RewardFn]:
    """The rewards used without --reward: exact match (1.0), partial match (1.0) and format
    (0.2), so a completion that answers in the right form, or partly right, scores something
    before it answers right."""
    return [
        RewardFn("exact_match", exact_match_reward, 1.0),
        RewardFn("partial_match", partial_match_reward, 1.0),
        RewardFn("format", format_reward, 0.2),
    ]


# -- --reward and --reward-weights ---------------------------------------------------------


def load_rewards(spec: str | None, weights: str | None) -> list[RewardFn]:
    """The reward functions of --reward `spec` ("module:function,..."; None: the built-in
    ones) weighted by --reward-weights `weights` ("w,...", one finite number per function;
    None: 1 each). BadInput naming the flag for a spec that does not give a callable, or
    weights that do not fit."""
    if spec is None:
        if weights is not None:
            raise BadInput("--reward-weights", weights, "needs --reward")
        return builtin_rewards()
    names = [item.strip() for item in spec.split(",")]
    if not all(names):
        raise BadInput("--reward", spec, "an empty name in the list")
    if len(set(names)) < len(names):
        raise BadInput("--reward", spec, "names a function twice")
    values = _weights(weights, len(names))
    return [RewardFn(n, _import(n), w) for n, w in zip(names, values, strict=True)]


def portable(spec: str | None) -> str | None:
    """--reward as a run records it (config.yaml, its checkpoints): each module that the
    working directory holds (`my_rewards:digits`, which only that folder's imports find) as
    its file's absolute path (`/abs/my_rewards.py:digits`), each FILE.py absolute, so that
    `--config RUN/config.yaml` loads the same functions from any folder. A module found
    elsewhere on the path (installed), a package's module (its relative imports need the
    package) and a built-in name stay as given."""
    if spec is None:
        return None
    return ",".join(_portable(item.strip()) for item in spec.split(","))


def _portable(name: str) -> str:
    where, colon, attr = name.rpartition(":")
    if not colon or not where:
        return name  # a built-in name, or a malformed one `load_rewards` refuses
    if where.endswith(".py"):
        return f"{os.path.abspath(where)}:{attr}"
    path = os.path.join(os.getcwd(), f"{where}.py")
    return f"{path}:{attr}" if "." not in where and os.path.isfile(path) else name


def _weights(text: str | None, count: int) -> list[float]:
    if text is None:
        return [1.0] * count
    try:
        values = [float(w) for w in text.split(",")]
    except ValueError:
        raise BadInput("--reward-weights", text, "must be numbers separated by commas") from None
    if len(values) != count:
        raise BadInput(
            "--reward-weights", text, f"{len(values)} weights for {count} --reward functions"
        )
    if not all(math.isfinite(v) for v in values):
        raise BadInput("--reward-weights", text, "must be finite numbers")
    return values


def _import(name: str) -> Callable:
    """The function `name` ("module:function" or "path/file.py:function") names."""
    where, colon, attr = name.rpartition(":")
    if not colon or not where or not attr:
        raise BadInput("--reward", name, "must be MODULE:FUNCTION or FILE.py:FUNCTION")
    module = load_module("--reward", name, where)
    if not hasattr(module, attr):
        raise BadInput("--reward", name, f"module {where} has no attribute {attr}")
    fn = getattr(module, attr)
    if not callable(fn):
        raise BadInput("--reward", name, f"{attr} is not callable ({type(fn).__name__})")
    return fn


# -- calling them ----------------------------------------------------------------------------


class _Invalid(Exception):
    """What was wrong with one call of a reward function (a one-line reason)."""


def _call(
    reward: RewardFn, prompts: list[str], completions: list[str], columns: dict
) -> list[float]:
    """reward.fn's numbers for the completions, as floats; _Invalid when it raises or gives
    anything but one finite number per completion."""
    try:
        values = reward.fn(prompts, completions, **columns)
    except Exception as err:
        raise _Invalid(f"raised {type(err).__name__}: {first_line(err)}") from err
    try:
        values = list(values)
    except TypeError:
        raise _Invalid(f"returned a {type(values).__name__}, not a list of numbers") from None
    if len(values) != len(completions):
        raise _Invalid(f"returned {len(values)} values for {len(completions)} completions")
    out = []
    for i, v in enumerate(values):
        if hasattr(v, "item") and getattr(v, "ndim", None) == 0:
            v = v.item()  # a numpy or torch scalar
        if not isinstance(v, numbers.Real):
            raise _Invalid(f"returned {v!r} at {i}, not a number")
        if not math.isfinite(v):
            raise _Invalid(f"returned {v} at {i}, not a finite number")
        out.append(float(v))
    return out


def probe(rewards: list[RewardFn], prompts: list[str], columns: dict[str, list]) -> None:
    """Call each function once before anything is sampled: on the first two prompts (the
    first twice when there is one) with the stand-in completions "" and the second prompt's
    reference (its `completion` column; "a" without one), the columns cut to those rows and
    `stopped` [True, True]. BadInput("--reward", name, why) for a function that raises, or
    returns anything but two finite numbers."""
    if not prompts:
        raise ValueError("probe: no prompts to try the reward functions on")
    rows = [0, 1] if len(prompts) > 1 else [0, 0]
    cut = {key: [values[r] for r in rows] for key, values in columns.items()}
    cut["stopped"] = [True, True]
    second = str(cut["completion"][1]) if "completion" in cut else "a"
    for reward in rewards:
        try:
            _call(reward, [prompts[r] for r in rows], ["", second], cut)
        except _Invalid as err:
            raise BadInput("--reward", reward.name, str(err)) from None


def score(
    rewards: list[RewardFn], prompts: list[str], completions: list[str], columns: dict[str, list]
) -> tuple[list[float], dict[str, list[float]]]:
    """(the reward of each completion, sum_f w_f r_f[i]; each function's own values by name).
    `columns` as the module docstring says (`stopped` among them). RewardError for a function
    that raises or returns anything but one finite number per completion."""
    per_function = {}
    for reward in rewards:
        try:
            per_function[reward.name] = _call(reward, prompts, completions, columns)
        except _Invalid as err:
            raise RewardError(reward.name, str(err)) from err
    total = [
        sum(r.weight * per_function[r.name][i] for r in rewards) for i in range(len(completions))
    ]
    return total, per_function
