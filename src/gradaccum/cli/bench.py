"""`gradaccum bench`: the engine against a hand-written loop and its peers, side by side."""

from __future__ import annotations

import argparse

from . import flags
from .common import run_of

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
--task sft: a ragged instruction set with a long tail (its length distribution is printed),
one Hugging Face model (a tiny Llama from config, or --model-config) for every contestant,
the same examples per step: gradaccum in each --packing mode, the hand loop (pad, mean / k),
TRL's SFTTrainer padded and padding-free, the Trainer with a padding collator (--peers trl,
trl-padding-free, trainer). Its defaults: --micro-batch 8, --accum-steps 8, --seq-len 512
(the longest example and the padding-free row), --micro-batch-tokens = --seq-len, --rounds 5,
--windows 3. Figures: target tokens/s, padding share, peak memory, update error.
"""

COUNTS = ("micro_batch", "accum_steps", "seq_len", "rounds", "windows", "seed")
SFT_COUNTS = COUNTS + ("micro_batch_tokens",)
"""The counts `gradaccum bench` takes (4k, 1M work); None when not given: BenchConfig's
defaults, which the help states, fill them in."""


def add_parser(sub, name: str) -> None:
    p = sub.add_parser(
        name,
        help="the engine against a hand-written loop, Accelerate, the Trainer and Lightning",
        description="One model, one data set of ragged rows, one (micro-batch, k) through every\n"
        "contestant: tokens/s and the update's error against the exact big batch.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    flags.task(
        p,
        help="pretrain (random token rows) or sft (ragged instruction examples, "
        "packing modes, TRL) (default pretrain)",
    )
    flags.model(p)
    flags.model_config(p)
    flags.micro_batch(p, default=4, filled_in=True)
    flags.accum_steps(p, default=8, filled_in=True)
    flags.seq_len(p, default=128, filled_in=True)
    flags.count(p, "--rounds", help="timing rounds, order alternating", default=5, filled_in=True)
    flags.count(
        p,
        "--windows",
        help="optimizer steps timed per round, after one untimed",
        default=3,
        filled_in=True,
    )
    flags.seed(p, of="the weights and the data", filled_in=True)
    flags.device(p)
    flags.micro_batch_tokens(
        p,
        help="--task sft: positions per micro-batch of gradaccum's window and padding-free "
        "modes, padding included (default: --seq-len)",
    )
    flags.packing(p, several=True)
    p.add_argument(
        "--peers",
        metavar="NAMES",
        help="comma list of accelerate, trainer, lightning (--task sft: trl, trl-padding-free, "
        "trainer), or none (default: all)",
    )
    flags.json_output(p)
    p.set_defaults(run=run_of("bench_run"))
