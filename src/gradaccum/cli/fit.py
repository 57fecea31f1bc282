"""`gradaccum fit`: the micro-batch that fits and runs fastest on this device, measured, and
the k that keeps the tokens per step.

Same model and data flags as `gradaccum train`: the built-in `tiny` GPT and corpus by default.
Under torchrun every rank probes and all agree on one micro-batch.
"""

from __future__ import annotations

import argparse
import dataclasses

from ..train.config import DEFAULT_TOKENS_PER_STEP, TrainConfig
from ..utils.errors import BadInput
from . import flags
from .common import reader, run_of

TRAIN_DEFAULTS = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
"""`gradaccum train`'s defaults: fit's model and data flags default as train's do."""

MAX_TOLERANCE = 0.5
"""The most --batch-tolerance takes: a batch half again or half the target is another recipe."""

_EPILOG = """\
Probes forward + backward + optimizer step at micro-batch 1, 2, 4, ... until one runs out
of memory (or over --memory-budget), bisects, then times the sizes that fit with activation
checkpointing off and on, then the sizes nearest the fastest whose global batch lands on the
target (within 1%). Of the sizes whose global batch is within --batch-tolerance (default 5%)
of the target it picks the fastest; among those within measurement noise of it (at most 5%),
one that lands on the target, then the one with the most headroom. The table says what a
choice off the target buys, and which faster size the tolerance left out.
Memory is measured: the allocator's peak on accelerators; on CPU the bytes of parameters,
gradients, buffers and optimizer state plus the tensors autograd saves for backward.
Examples:
  gradaccum fit --memory-budget 1GB
  gradaccum fit --lora-rank 8 --memory-budget 1GB      # the base frozen, as train's LoRA
  gradaccum fit --model-config gpt2/config.json --seq-len 1024 --precision bf16 \\
      --tokens-per-step 512k --device cuda
"""


def add_parser(sub, name: str) -> None:
    p = sub.add_parser(
        name,
        help="find the micro-batch that fits and runs fastest; k keeps the global batch",
        description="Measure the micro-batch that fits and runs fastest; k keeps the target.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    model = p.add_argument_group("model and data (as `gradaccum train`)")
    flags.model(model)
    flags.model_config(model)
    flags.data(model)
    flags.seed(model, of="the built-in corpus", default=TRAIN_DEFAULTS["seed"])
    flags.seq_len(model, default=TRAIN_DEFAULTS["seq_len"])
    flags.precision(model, default=TRAIN_DEFAULTS["precision"])
    lora = p.add_argument_group("LoRA (as `gradaccum train`; the lora extra, on peft)")
    flags.lora_rank(
        lora,
        help="probe with LoRA adapters of rank R on the frozen model: gradients and optimizer "
        "state of the adapters only",
    )
    flags.lora_alpha(lora)
    flags.lora_dropout(lora)
    flags.lora_targets(lora)
    batch = p.add_argument_group("batch and memory")
    flags.tokens_per_step(batch, default=DEFAULT_TOKENS_PER_STEP)
    batch.add_argument(
        "--batch-tolerance",
        metavar="X",
        type=reader(read_tolerance, "--batch-tolerance"),
        help="how far the global batch may land from the target when that is faster: 0.05 "
        "or 5%% (default 5%%); 0 insists on the target",
    )
    flags.size(batch, "--memory-budget", help="1GB, 20GiB; bare number: GB")
    flags.device(batch, default=TRAIN_DEFAULTS["device"])
    flags.number(
        batch, "--max-seconds", metavar="T", help="end probing and timing after this many seconds"
    )
    batch.add_argument(
        "--no-checkpointing", action="store_true", help="do not try activation checkpointing"
    )
    flags.json_output(p)
    p.set_defaults(run=run_of("fit_run"))


def read_tolerance(text: str, flag: str) -> float:
    """--batch-tolerance as a fraction: 0.05 or 5%, from 0 to MAX_TOLERANCE."""
    body = text.strip()
    percent = body.endswith("%")
    try:
        value = float(body[:-1] if percent else body) / (100 if percent else 1)
    except ValueError:
        raise BadInput(flag, text, "expected a fraction: 0.05 or 5%") from None
    if not 0 <= value <= MAX_TOLERANCE:  # NaN fails this too
        raise BadInput(flag, text, f"must be from 0 to {MAX_TOLERANCE:.0%}")
    return value
