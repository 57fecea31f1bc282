"""Sizes as people type them: 4M tokens, 4Mi tokens, 7B parameters, 80GB, 80GiB, 300ms.

Counts: k = 1e3, M = 1e6, B or G = 1e9 (B is "billion", as in 7B parameters), T = 1e12;
Ki, Mi, Gi, Ti are powers of 1024. Bytes: the same prefixes with an optional B
(80GB = 80e9 bytes, 80GiB = 80 x 2**30). Durations: ns, us, ms, s, m or min, h, d.
Underscores and thousands commas are ignored (1_048_576, 1,048,576); 1e6 works.

Parsing is exact (decimal arithmetic), so 4.194304M is 4,194,304 and not 4,194,303.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from gradaccum.utils.errors import BadInput

_NUMBER = re.compile(r"^([+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)\s*([A-Za-z%]*)$")

_DECIMAL = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}
_BINARY = {"ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
_SECONDS = {
    "": Decimal(1),
    "ns": Decimal("1e-9"),
    "us": Decimal("1e-6"),
    "ms": Decimal("1e-3"),
    "s": Decimal(1),
    "sec": Decimal(1),
    "m": Decimal(60),
    "min": Decimal(60),
    "h": Decimal(3600),
    "d": Decimal(86400),
}


def _split(text: str, flag: str) -> tuple[Decimal, str]:
    cleaned = str(text).strip().replace("_", "").replace(",", "")
    match = _NUMBER.match(cleaned)
    if match is None:
        raise BadInput(f"{flag} {text}: not a number or size (examples: 4M, 262k, 7B, 1e6)")
    try:
        number = Decimal(match.group(1))
    except InvalidOperation as err:  # the pattern admits only valid decimals; kept for safety
        raise BadInput(f"{flag} {text}: not a number") from err
    return number, match.group(2)


LARGEST = Decimal("1e18")
"""No size past 1e18 (an exa-token run, an exabyte device) means anything; bigger values
would overflow float arithmetic further on."""


def _check_sign(value, text: str, flag: str, allow_zero: bool) -> None:
    if value > LARGEST:
        raise BadInput(f"{flag} {text}: too large (at most 1e18)")
    if value < 0:
        raise BadInput(f"{flag} {text}: must not be negative")
    if value == 0 and not allow_zero:
        raise BadInput(f"{flag} {text}: must be greater than zero")


def _whole(value: Decimal, text: str, flag: str, what: str) -> int:
    if value != value.to_integral_value():
        raise BadInput(f"{flag} {text}: not a whole number" + (f" of {what}" if what else ""))
    return int(value)


def parse_count(text: str, flag: str, *, allow_zero: bool = False) -> int:
    """A whole count (tokens, sequences, parameters, steps): 4M, 4Mi, 262k, 7B, 1e6, 1,024."""
    number, unit = _split(text, flag)
    key = unit.lower()
    if key in _BINARY:
        scale = _BINARY[key]
    elif key in _DECIMAL:
        scale = _DECIMAL[key]
    else:
        raise BadInput(f"{flag} {text}: unknown suffix {unit!r} (use k, M, B, T or Ki, Mi, Gi)")
    value = _whole(number * scale, text, flag, "")
    _check_sign(value, text, flag, allow_zero)
    return value


def parse_bytes(text: str, flag: str, *, bare_unit: int = 1) -> int:
    """Bytes: 80GB = 80e9, 80GiB = 80 x 2**30, 512MB, 80G. A bare number is `bare_unit` bytes."""
    number, unit = _split(text, flag)
    key = unit.lower()
    if key.endswith("b"):
        key = key[:-1]
    if unit == "":
        scale = bare_unit
    elif key in _BINARY:
        scale = _BINARY[key]
    elif key in _DECIMAL and key != "b":
        scale = _DECIMAL[key]
    else:
        raise BadInput(f"{flag} {text}: unknown unit {unit!r} (use GB, GiB, MB, MiB, TB)")
    value = _whole(number * scale, text, flag, "bytes")
    _check_sign(value, text, flag, allow_zero=False)
    return value


def parse_seconds(text: str, flag: str) -> float:
    """A duration in seconds: 300ms, 1.5s, 2m (minutes), 1h, or a bare number of seconds."""
    number, unit = _split(text, flag)
    key = unit.lower()
    if key not in _SECONDS:
        raise BadInput(f"{flag} {text}: unknown unit {unit!r} (use ms, s, min, h)")
    value = number * _SECONDS[key]
    _check_sign(value, text, flag, allow_zero=False)
    return float(value)


def parse_float(text: str, flag: str, *, allow_percent: bool = False) -> float:
    """A plain positive number (a learning rate, TFLOP/s); 40% is 0.4 where allowed."""
    number, unit = _split(text, flag)
    if unit == "%" and allow_percent:
        number = number / 100
    elif unit != "":
        raise BadInput(f"{flag} {text}: expected a plain number")
    _check_sign(number, text, flag, allow_zero=False)
    return float(number)


def parse_bandwidth(text: str, flag: str) -> float:
    """Bytes per second: 300GB/s, 25GiB/s; a small b counts bits, so 400Gb/s is 50 GB/s; a
    bare number is GB/s; the /s may be left out (300GB)."""
    raw = str(text).strip()
    body = raw[:-2] if raw.lower().endswith("/s") else raw
    examples = "(examples: 300GB/s, 400Gb/s, 25GiB/s, 50)"
    try:
        number, unit = _split(body, flag)
    except BadInput:
        raise BadInput(f"{flag} {text}: not a bandwidth {examples}") from None
    bits = unit.endswith("b")
    prefix = unit[:-1].lower() if unit[-1:] in ("b", "B") else None
    if unit == "":
        scale = Decimal(10**9)
    elif prefix in _BINARY:
        scale = Decimal(_BINARY[prefix])
    elif prefix in _DECIMAL and prefix != "b":
        scale = Decimal(_DECIMAL[prefix])
    else:
        raise BadInput(f"{flag} {text}: unknown unit {unit!r} {examples}")
    value = number * scale / (8 if bits else 1)
    _check_sign(value, text, flag, allow_zero=False)
    return float(value)


def fmt_bandwidth(bytes_per_s: float) -> str:
    """Bytes per second for people: '300 GB/s', '50 GB/s', '1.5 TB/s'."""
    for scale, unit in ((1e12, "TB/s"), (1e9, "GB/s"), (1e6, "MB/s")):
        if bytes_per_s >= scale:
            return f"{_significant(bytes_per_s / scale, 3)} {unit}"
    return f"{bytes_per_s:.0f} B/s"


# Formatting for tables ---------------------------------------------------------------------------

_SHORT = ((10**12, "T"), (10**9, "B"), (10**6, "M"), (10**3, "k"))


def fmt_count(n: int | float, digits: int = 3) -> str:
    """Short form with `digits` significant digits: 262144 -> '262k', 6738415616 -> '6.74B'."""
    for index, (scale, suffix) in enumerate(_SHORT):
        if abs(n) >= scale:
            text = _significant(n / scale, digits)
            if abs(float(text)) >= 1000 and index > 0:  # 999,999 reads '1M', not '1000k'
                scale, suffix = _SHORT[index - 1]
                text = _significant(n / scale, digits)
            return f"{text}{suffix}"
    if isinstance(n, float):
        return _significant(n, digits)
    return str(n)


def fmt_count_exact(n: int) -> str:
    """Lossless short form that parse_count reads back: 4000000 -> '4M', 262144 -> '256Ki'."""
    for scale, suffix in _SHORT:
        if n != 0 and n % scale == 0:
            return f"{n // scale}{suffix}"
    for suffix, scale in sorted(_BINARY.items(), key=lambda item: -item[1]):
        if n != 0 and n % scale == 0:
            return f"{n // scale}{suffix.capitalize()}"
    return str(n)


def fmt_int(n: int) -> str:
    """Thousands separators: 1048576 -> '1,048,576'."""
    return f"{n:,}"


def fmt_bytes(n_bytes: float) -> str:
    """Bytes with a decimal unit: '512 B', '1.50 MB', '13.48 GB', '2.10 TB'."""
    for scale, unit in ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if abs(n_bytes) >= scale:
            return f"{n_bytes / scale:,.2f} {unit}"
    return f"{n_bytes:.0f} B"


def fmt_seconds(seconds: float) -> str:
    """A duration for people: '850 ms', '2.40 s', '12.5 min', '3.20 h', '4.1 d'."""
    if seconds < 1:
        return f"{seconds * 1e3:.3g} ms"
    if seconds < 120:
        return f"{seconds:.3g} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.3g} min"
    if seconds < 3 * 86400:
        return f"{seconds / 3600:.3g} h"
    return f"{seconds / 86400:,.1f} d"


def _significant(x: float, digits: int) -> str:
    text = f"{x:.{digits}g}"
    if "e" in text:  # keep plain notation: 1000 stays '1000', never '1e+03'
        text = f"{x:.0f}"
    return text
