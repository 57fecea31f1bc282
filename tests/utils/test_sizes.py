import pytest
from hypothesis import given
from hypothesis import strategies as st

from gradaccum.utils.errors import BadInput
from gradaccum.utils.sizes import (
    fmt_count,
    fmt_count_exact,
    parse_bytes,
    parse_count,
    parse_float,
    parse_seconds,
)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("4M", 4 * 1000 * 1000),
        ("4Mi", 4 * 1024 * 1024),  # 4,194,304
        ("262k", 262 * 1000),
        ("262K", 262 * 1000),
        ("1T", 1000**4),
        ("7B", 7 * 1000**3),
        ("7b", 7 * 1000**3),
        ("2Gi", 2 * 1024**3),
        ("1e6", 1000 * 1000),
        ("1.5k", 1500),
        ("4.194304M", 4194304),  # exact, no float rounding
        ("1,048,576", 1048576),
        ("1_048_576", 1048576),
        (" 64 ", 64),
        ("512", 512),
    ],
)
def test_parse_count(text, expected):
    assert parse_count(text, "--n") == expected


@pytest.mark.parametrize(
    "text, why",
    [
        ("0", "greater than zero"),
        ("-4", "negative"),
        ("abc", "not a number"),
        ("1.5", "whole number"),
        ("4X", "unknown suffix"),
        ("", "not a number"),
        ("nan", "not a number"),
        ("inf", "not a number"),
        ("4 M M", "not a number"),
    ],
)
def test_parse_count_rejects_with_flag_and_value(text, why):
    with pytest.raises(BadInput) as err:
        parse_count(text, "--micro-batch")
    message = str(err.value)
    assert message.startswith(f"--micro-batch {text}:")
    assert why in message
    assert "\n" not in message


def test_parse_count_zero_when_allowed():
    assert parse_count("0", "--n", allow_zero=True) == 0


@pytest.mark.parametrize(
    "text, expected",
    [
        ("80GB", 80 * 10**9),
        ("80gb", 80 * 10**9),
        ("80G", 80 * 10**9),
        ("80GiB", 80 * 2**30),
        ("512MB", 512 * 10**6),
        ("1.5TB", 1500 * 10**9),
        ("64KiB", 64 * 1024),
        ("100B", 100),
        ("100", 100),
    ],
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text, "--device-memory") == expected


def test_parse_bytes_bare_unit():
    assert parse_bytes("80", "--device-memory", bare_unit=10**9) == 80 * 10**9


@pytest.mark.parametrize("text", ["80XB", "0GB", "-1GB", "GB"])
def test_parse_bytes_rejects(text):
    with pytest.raises(BadInput, match=f"^--device-memory {text}:"):
        parse_bytes(text, "--device-memory")


@pytest.mark.parametrize(
    "text, expected",
    [
        ("80ms", 0.080),
        ("1.5s", 1.5),
        ("2m", 120.0),
        ("2min", 120.0),
        ("1h", 3600.0),
        ("300", 300.0),
        ("250us", 250e-6),
    ],
)
def test_parse_seconds(text, expected):
    assert parse_seconds(text, "--micro-step-time") == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("text", ["0s", "3parsec", "-1s"])
def test_parse_seconds_rejects(text):
    with pytest.raises(BadInput, match=f"^--micro-step-time {text}:"):
        parse_seconds(text, "--micro-step-time")


def test_parse_float():
    assert parse_float("3e-4", "--base-lr") == pytest.approx(0.0003)
    assert parse_float("40%", "--mfu", allow_percent=True) == pytest.approx(0.4)
    with pytest.raises(BadInput, match="^--base-lr 40%:"):
        parse_float("40%", "--base-lr")


@pytest.mark.parametrize(
    "n, text",
    [
        (262144, "262k"),
        (6738415616, "6.74B"),
        (999_999, "1M"),
        (1_048_576, "1.05M"),
        (12, "12"),
        (10**12, "1T"),
    ],
)
def test_fmt_count(n, text):
    assert fmt_count(n) == text


@pytest.mark.parametrize(
    "n, text",
    [
        (4_000_000, "4M"),
        (262_144, "256Ki"),
        (4_194_304, "4Mi"),
        (12_345, "12345"),
        (7 * 10**9, "7B"),
    ],
)
def test_fmt_count_exact(n, text):
    assert fmt_count_exact(n) == text


@given(st.integers(min_value=1, max_value=10**15))
def test_count_round_trips(n):
    assert parse_count(fmt_count_exact(n), "--n") == n
    assert parse_count(f"{n:,}", "--n") == n
    assert parse_count(f"{n:_}", "--n") == n
    assert parse_count(str(n), "--n") == n


_MULTIPLIERS = {"k": 1000, "M": 1000**2, "B": 1000**3, "T": 1000**4, "Ki": 1024, "Mi": 1024**2}


@given(st.integers(min_value=1, max_value=10**6), st.sampled_from(sorted(_MULTIPLIERS)))
def test_count_suffixes(m, suffix):
    assert parse_count(f"{m}{suffix}", "--n") == m * _MULTIPLIERS[suffix]


@given(st.integers(min_value=1, max_value=10**4), st.sampled_from(["GB", "GiB", "MB", "MiB"]))
def test_byte_suffixes(m, unit):
    scale = {"GB": 10**9, "GiB": 2**30, "MB": 10**6, "MiB": 2**20}[unit]
    assert parse_bytes(f"{m}{unit}", "--device-memory") == m * scale
