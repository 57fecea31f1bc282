"""What every subcommand shares: bad input as one line and exit 2, flags read as they are
parsed, the run loaded on dispatch, JSON or a table."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Callable

from ..utils.errors import BadInput
from ..utils.jsonable import finite


class _Refused(Exception):
    """A flag's reader refused its text: carries the BadInput past argparse, which would turn
    a ValueError (BadInput is one) into its own "invalid value" line without the reason."""

    def __init__(self, err: BadInput):
        super().__init__(str(err))
        self.err = err


class ArgumentParser(argparse.ArgumentParser):
    """argparse that reports bad flags as one line with exit code 2 (argparse's own code)."""

    def error(self, message: str):  # noqa: D401 - argparse API
        err = BadInput(message)
        err.prog = self.prog  # "gradaccum train": the line starts with the command that failed
        raise err

    def parse_known_args(self, args=None, namespace=None):
        try:
            return super().parse_known_args(args, namespace)
        except _Refused as refused:
            raise refused.err from None


def reader(parse: Callable, flag: str) -> Callable[[str], object]:
    """argparse's `type=` for a flag: `parse(text, flag)`, whose BadInput names the flag and
    the value and reaches the user as it is."""

    def read(text: str):
        try:
            return parse(text, flag)
        except BadInput as err:
            raise _Refused(err) from None

    return read


def run_of(module: str) -> Callable[[argparse.Namespace], int]:
    """A command's `run(args)`, from `gradaccum.cli.<module>` imported only when the command
    runs: building the parser imports no torch, so `gradaccum plan` starts without it."""

    def run(args: argparse.Namespace) -> int:
        return importlib.import_module(f"gradaccum.cli.{module}").run(args)

    return run


def print_json(obj) -> None:
    json.dump(finite(obj), sys.stdout, indent=2)
    sys.stdout.write("\n")
