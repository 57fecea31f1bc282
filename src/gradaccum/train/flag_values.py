"""How a `gradaccum train` setting is given and read: the flag a TrainConfig field stands for
(`Flag`, `flag_field`), its value read from text or a typed value (`read_value`), and the
settings layered and written as TOML (`merge_settings`, `to_toml`). No torch, no file."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..plan.sizes import parse_count
from ..utils.errors import BadInput, flag_name

EXCLUSIVE = (
    ("max_steps", "max_tokens"),
    ("model", "model_config", "init_from"),
    ("examples_per_step", "tokens_per_step"),
)
"""Fields of which a run takes at most one: where settings are layered (a TOML file under
the command line, a checkpoint's settings under a resume's flags), the upper layer's choice
replaces the lower layer's whole group."""


@dataclass(frozen=True)
class Flag:
    """How a field is given on the command line and read."""

    help: str
    """The --help line."""
    kind: str = "str"
    """count (4M, 262k, 1e6), micro (a count or auto), float, choice, path, str or bool."""
    metavar: str = "N"
    least: float = 0
    """Smallest allowed value of a count or a number (a float must exceed it if `above`)."""
    above: bool = False
    most: int | None = None
    """Largest allowed count (exclusive)."""
    choices: tuple = ()


def flag_field(default, help: str, kind: str = "count", **kw):
    metavar = kw.pop("metavar", None) or {
        "float": "X",
        "micro": "N|auto",
        "choice": "NAME",
        "path": "PATH",
        "str": "TEXT",
    }.get(kind, "N")
    return field(default=default, metadata={"flag": Flag(help, kind, metavar, **kw)})


def read_value(f, value):
    """The typed value of field `f` (see Flag.kind), or BadInput naming its flag."""
    spec, flag = f.metadata["flag"], flag_name(f.name)
    if value is None and f.default is None:
        return None
    if spec.kind == "bool":
        if not isinstance(value, bool):
            raise BadInput(flag, value, "must be true or false")
        return value
    if spec.kind in ("str", "path", "choice"):
        if not isinstance(value, str) or not value.strip():
            raise BadInput(
                flag,
                repr(value),
                "expected a path" if spec.kind == "path" else "expected a non-empty string",
            )
        if spec.choices and value not in spec.choices:
            raise BadInput(flag, value, f"choose one of {', '.join(spec.choices)}")
        return value
    if spec.kind == "float":
        return _number(flag, value, spec)
    if spec.kind == "micro" and isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    count = _whole(flag, value)
    if count < spec.least:
        more = " or auto" if spec.kind == "micro" else ""
        raise BadInput(flag, count, f"must be a whole number >= {spec.least}{more}")
    if spec.most is not None and count >= spec.most:
        raise BadInput(
            flag,
            count,
            "must be below 2**63" if spec.most == 2**63 else f"must be below {spec.most}",
        )
    return count


def _whole(flag: str, value) -> int:
    if isinstance(value, bool) or value is None:
        raise BadInput(flag, value, "expected a whole number")
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, int):
        return value
    return parse_count(str(value), flag, allow_zero=True)


def _number(flag: str, value, spec: Flag) -> float:
    try:
        if isinstance(value, bool):
            raise ValueError
        number = float(value)
    except (TypeError, ValueError):
        raise BadInput(flag, value, "not a number") from None
    if not math.isfinite(number) or number < spec.least or (spec.above and number == spec.least):
        why = "must be a positive number" if spec.above else f"must be a number >= {spec.least:g}"
        raise BadInput(flag, f"{number:g}" if math.isfinite(number) else number, why)
    return number


def merge_settings(lower: dict, upper: dict) -> dict:
    """`upper` over `lower`, where a field `upper` gives also replaces the fields it excludes
    (EXCLUSIVE): `--max-tokens` on the command line overrides `max_steps` in a TOML file."""
    lower = dict(lower)
    for group in EXCLUSIVE:
        if any(upper.get(name) is not None for name in group):
            for name in group:
                lower.pop(name, None)
    return {**lower, **upper}


def to_toml(values: dict) -> str:
    """Flat key = value TOML of the given fields (None values are left out)."""
    lines = []
    for key, value in values.items():
        if value is None:
            continue
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, (int, float)):
            text = repr(value)
        else:
            text = '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'
        lines.append(f"{key} = {text}")
    return "\n".join(lines) + "\n"
