"""`gradaccum bench`: the engine against a hand-written loop and its peers, side by side."""

from __future__ import annotations

import argparse
import sys

from ..plan.sizes import parse_count
from ..utils.errors import BadInput, flag_name
from .common import print_json

_EPILOG = """\
Before the first step it says what it will run; after the first contestant's step, about how
long the rest takes; then each contestant's figures as they come (on stderr).
tokens/s: valid tokens per second, median of the rounds (order alternating), its spread
(largest - smallest) / median, and the ratio to the hand loop in the same round.
update err: one SGD step at lr 1 from the same weights, so the update is the gradient,
against the exact big batch (one float64 forward over the window's rows, loss / N).
Peers: pip install 'gradaccum[bench]'. A Hugging Face model from its config, e.g. GPT-2:
  python -c "from transformers import GPT2Config; GPT2Config().save_pretrained('gpt2')"
  gradaccum bench --model-config gpt2/config.json --seq-len 128 --micro-batch 2 \\
      --accum-steps 4 --rounds 3 --windows 1
"""

# counts (4k, 1M work), by dest -> help
_COUNTS = {
    "micro_batch": "sequences per micro-batch (default 4)",
    "accum_steps": "micro-batches per optimizer step, k (default 8)",
    "seq_len": "tokens per sequence (default 128)",
    "rounds": "timing rounds, order alternating (default 5)",
    "windows": "optimizer steps timed per round, after one untimed (default 3)",
    "seed": "seed of the weights and the data (default 0)",
}


def add_parser(sub, name: str) -> None:
    p = sub.add_parser(
        name,
        help="the engine against a hand-written loop, Accelerate, the Trainer and Lightning",
        description="One model, one data set of ragged rows, one (micro-batch, k) through every\n"
        "contestant: tokens/s and the update's error against the exact big batch.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model", metavar="PRESET", help="built-in GPT: tiny, small, gpt2-124m (default tiny)"
    )
    p.add_argument("--model-config", metavar="PATH", help="a Hugging Face config.json")
    for dest, text in _COUNTS.items():
        p.add_argument(flag_name(dest), dest=dest, metavar="N", help=text)
    p.add_argument("--device", metavar="DEVICE", default="auto", help="cpu, cuda, ... (auto)")
    p.add_argument(
        "--peers",
        metavar="NAMES",
        help="comma list of accelerate, trainer, lightning, or none (default: all)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


def config_from_args(args: argparse.Namespace):
    from ..bench import PEERS, BenchConfig

    values = {}
    for dest in _COUNTS:
        text = getattr(args, dest)
        if text is not None:
            values[dest] = parse_count(text, flag_name(dest), allow_zero=dest == "seed")
    if args.peers is not None:
        names = [n.strip() for n in args.peers.split(",") if n.strip()]
        values["peers"] = () if names == ["none"] else tuple(names)
        if not names:
            raise BadInput("--peers", repr(args.peers), f"name some of {', '.join(PEERS)} or none")
    return BenchConfig(
        model=args.model, model_config=args.model_config, device=args.device, **values
    )


def run(args: argparse.Namespace) -> int:
    from ..bench import render_table, run_bench, to_json

    config = config_from_args(args)

    def progress(line: str) -> None:  # stderr, so that --json keeps stdout to the object
        print(line, file=sys.stderr, flush=True)

    entries, summary = run_bench(config, progress=progress)
    if args.json:
        print_json(to_json(entries, summary))
    else:
        sys.stdout.write(render_table(entries, summary))
    return 0
