"""How one setting is given and read: its flag (`Flag`, `setting`) and its value read from a
command line's text or a config file's typed value (`read_value`).

A field's help is its docstring (`gradaccum.settings.docs`); its default is stated by the
generator, from the field's default or the command's per-task table, so neither is written
twice. A bad value raises BadInput naming the flag and the value (exit 2, one line).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from gradaccum.utils.errors import BadInput, flag_name

_METAVARS = {"float": "X", "micro": "N|auto", "choice": "NAME", "path": "PATH", "str": "TEXT"}


@dataclass(frozen=True)
class Flag:
    """How a field is given on the command line and read."""

    kind: str = "count"
    """count (4M, 262k, 1e6), micro (a count or auto), float, choice, path, str, bool, or
    `parse`'s own."""
    metavar: str = "N"
    least: float = 0
    """Smallest allowed value of a count or a number (a float must exceed it if `above`)."""
    above: bool = False
    most: int | None = None
    """Largest allowed count (exclusive)."""
    choices: tuple = ()
    parse: Callable | None = None
    """parse(value, flag) -> the value, for values of their own kind (bytes, seconds, a
    schedule); it takes the command line's text and a config file's value alike."""
    aliases: tuple = ()
    """Other names of the flag (`--devices` for `--gpus`)."""
    default_text: str | None = None
    """How --help states a default the field leaves None ("a tenth of the run")."""
    bare: object = None
    """The value of the flag given without one (`--resume` alone), for a flag whose value may
    be left out; None: the value must be given."""


def setting(default, kind: str = "count", **kw):
    """A dataclass field that is a setting: its flag is `--` + its name with dashes."""
    if kw.get("parse") is not None:
        kind = "parsed"
    metavar = kw.pop("metavar", None) or _METAVARS.get(kind, "N")
    if kind == "choice" and kw.get("choices"):
        metavar = kw.get("metavar") or "{" + ",".join(kw["choices"]) + "}"
    return field(default=default, metadata={"flag": Flag(kind, metavar, **kw)})


def flag_of(f) -> Flag:
    return f.metadata["flag"]


def read_value(name: str, spec: Flag, value, default=None):
    """The typed value of setting `name` (see Flag.kind), or BadInput naming its flag."""
    flag = flag_name(name)
    if value is None and default is None:
        return None
    if spec.kind == "parsed":
        return spec.parse(value, flag)
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
    negative = not isinstance(value, bool) and str(value).strip().startswith("-")
    count = -_whole(flag, str(value).strip()[1:]) if negative else _whole(flag, value)
    if count < spec.least:  # -3 and 0 refused in the same words where the least is 1
        more = " or auto" if spec.kind == "micro" else ""
        why = (
            "must not be negative"
            if spec.least == 0
            else f"must be a whole number >= {spec.least}{more}"
        )
        raise BadInput(flag, str(value).strip() if negative else count, why)
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
    # here, not at the top: gradaccum.plan's own settings are read by this module
    from gradaccum.utils.sizes import parse_count

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
