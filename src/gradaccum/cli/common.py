"""What every subcommand shares: bad input as one line and exit 2, JSON or a table."""

from __future__ import annotations

import argparse
import json
import sys

from gradaccum.utils.errors import BadInput
from gradaccum.utils.jsonable import finite


class ArgumentParser(argparse.ArgumentParser):
    """argparse that reports bad flags as one line with exit code 2 (argparse's own code)."""

    def error(self, message: str):  # noqa: D401 - argparse API
        err = BadInput(message)
        err.prog = self.prog  # "gradaccum train": the line starts with the command that failed
        raise err


def print_json(obj) -> None:
    json.dump(finite(obj), sys.stdout, indent=2)
    sys.stdout.write("\n")
