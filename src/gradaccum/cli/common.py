"""What every subcommand shares: bad input as one line and exit 2, JSON or a table."""

from __future__ import annotations

import argparse
import json
import math
import sys


class UsageError(Exception):
    """Bad input from the user: printed as one line, exit code 2, no traceback."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse that reports bad flags as one line with exit code 2 (argparse's own code)."""

    def error(self, message: str):  # noqa: D401 - argparse API
        raise UsageError(f"{self.prog}: {message}")


def bad(flag: str, value, why: str) -> UsageError:
    """A UsageError that names the flag and the value: `--micro-batch 0: must be at least 1`."""
    return UsageError(f"{flag} {value}: {why}")


def print_json(obj) -> None:
    def clean(x):
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        return x

    json.dump(clean(obj), sys.stdout, indent=2)
    sys.stdout.write("\n")
