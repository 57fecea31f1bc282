"""`gradaccum bench` once its flags are read (`cli/bench.py`): the BenchConfig, the rounds, the
table or JSON."""

from __future__ import annotations

import argparse
import sys

from ..bench import PEERS, BenchConfig, render_table, run_bench, to_json
from ..utils.errors import BadInput
from .bench import COUNTS
from .common import print_json


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """The BenchConfig of the flags given (its own defaults for the rest)."""
    values = {dest: getattr(args, dest) for dest in COUNTS if getattr(args, dest) is not None}
    if args.peers is not None:
        names = [n.strip() for n in args.peers.split(",") if n.strip()]
        values["peers"] = () if names == ["none"] else tuple(names)
        if not names:
            raise BadInput("--peers", repr(args.peers), f"name some of {', '.join(PEERS)} or none")
    return BenchConfig(
        model=args.model, model_config=args.model_config, device=args.device, **values
    )


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args)

    def progress(line: str) -> None:  # stderr, so that --json keeps stdout to the object
        print(line, file=sys.stderr, flush=True)

    entries, summary = run_bench(config, progress=progress)
    if args.json:
        print_json(to_json(entries, summary))
    else:
        sys.stdout.write(render_table(entries, summary))
    return 0
