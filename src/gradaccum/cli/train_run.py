"""`gradaccum train` once its flags are read (`cli/train.py`): whether it continues the run
in --out (--resume, --resume auto, a torchrun restart), the TrainConfig (on a resume the
checkpoint's settings under the flags), the run, its summary."""

from __future__ import annotations

import argparse
import os
import sys

from gradaccum.cli.common import print_json
from gradaccum.settings.command import given
from gradaccum.train.config import TrainConfig
from gradaccum.train.loop import train
from gradaccum.train.rundir.resume import continues, settings_to_resume


def run(args: argparse.Namespace) -> int:
    values = given(args)
    values["resume"], restarted = continues(values)  # --resume auto settled here
    if values["resume"]:
        values = settings_to_resume(values)
    config = TrainConfig(**values)
    if restarted is not None and os.environ.get("RANK", "0") == "0":
        print(f"resume: {restarted}", file=sys.stderr if config.json else sys.stdout, flush=True)
    summary = train(config)
    if os.environ.get("RANK", "0") != "0":
        return 0
    if config.json:
        print_json(summary)
    else:
        print(_human(summary))
    return 130 if summary["stopped"] == "SIGINT" else 0


def _human(s: dict) -> str:
    def num(x, fmt=".4f"):
        return "n/a" if x is None else format(x, fmt)

    floor = f", entropy floor {s['entropy_floor']:.4f}" if s["entropy_floor"] is not None else ""
    if s.get("final_exact_match") is not None:
        floor += f"; held-out exact match {s['final_exact_match']:.3f}"
    lines = [
        f"{'stopped' if s['stopped'] else 'done'}: {s['steps']}/{s['total_steps']} steps, "
        f"{s['tokens']:,} tokens, {s['tokens_per_s']:,.0f} tokens/s, {s['wall_s']:.1f} s",
        f"loss {num(s['initial_loss'])} -> {num(s['final_loss'])} "
        f"(held out {num(s['final_eval_loss'])}); ln V {s['ln_vocab']:.4f}{floor}",
        f"out {s['out']}: {', '.join(s['files'])}"
        + "".join(f"; {name} not written ({why})" for name, why in s["not_written"].items()),
    ]
    return "\n".join(lines)
