"""`gradaccum verify`: accumulation against the big batch on a model, with the usual mistakes
for contrast, what breaks equivalence, and optionally N ranks and the precision study.

Exit 0 when the check passes, 1 when it fails (a finding, not an error), 2 on bad input.
"""

from __future__ import annotations

import argparse
import os

from ..utils.choices import PACKINGS
from ..utils.errors import BadInput
from . import flags
from .common import run_of

DEFAULT_PLOT = "precision_study.png"

MAX_SEQ_LEN = 4096
"""Longest --seq-len, in tokens. Verify's float64 big batch costs about the square of the
length: k 4 x 4 sequences took 10 s at 1024 tokens, 50 s at 2048 and 262 s at 4096 on 2 CPU
cores (tiny preset); at the same growth 8192 would take about 20 minutes."""
RANK_BYTES_PER_PARAMETER = 48
"""Memory of one rank of --world-size per model parameter, in bytes: 12 fp32 copies (the
parameters, their gradients, DDP's bucket, AdamW's two moments, and what rank 0 records for
the comparison: the parameters before each of the 2 windows and after, the 2 gradients,
and the copy that carries them back)."""

_EPILOG = """\
The built-in check: a GPT of the chosen preset on token sequences of random lengths (micro-
batches padded to their longest row). --task sft: the window is k x micro-batch SFT examples
read as `gradaccum train --task sft` reads them (the built-in instruction set, or --data;
byte tokens, the loss on the completion only), each micro-batch padded to its longest, so
the micro-batches hold different numbers of targets. --packing window or padding-free cuts the
same examples as `train --packing` does (by --micro-batch-tokens, or into padding-free rows of
--seq-len with attention kept inside each example), checked against every example of the
window padded into one unpacked batch. Examples:
  gradaccum verify
  gradaccum verify --task sft                # the built-in instruction set
  gradaccum verify --task sft --data sft.jsonl --k 8
  gradaccum verify --task sft --packing padding-free
  gradaccum verify --model-config path/to/config.json --k 8 --precision bf16
  gradaccum verify --world-size 2          # also DDP and FSDP2 over 2 gloo processes on CPU
  gradaccum verify --model tiny-moe --moe-balance micro   # a mixture of experts
  gradaccum verify --precision-study --plot study.png
"""


def add_parser(sub, name: str) -> None:
    p = sub.add_parser(
        name,
        help="prove accumulated gradients equal the big-batch gradient on a model",
        description="One window through the engine against the same data as one big batch.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    model = p.add_argument_group("model (one of)")
    flags.model(model)
    flags.model_config(model)
    flags.moe_balance(
        model,
        help="a mixture of experts: the load-balancing loss checked per micro-batch (micro), "
        "over the whole window from a routing pass (global), or with the previous window's "
        "token fractions (global-previous, over 2 windows); against a big batch whose loss "
        "takes the whole window's (default global for an MoE model)",
    )
    data = p.add_argument_group("the window")
    flags.task(
        data,
        help="pretrain: random token sequences (default); sft: SFT examples, the loss on "
        "their completions",
    )
    flags.data(
        data,
        help="--task sft: .jsonl, .json or .parquet rows (prompt/completion, messages or "
        "Alpaca) or hf:NAME[:SPLIT], in byte tokens (default: the built-in instruction set)",
    )
    flags.count(data, "--k", metavar="K", help="micro-batches in the window", default=4)
    flags.micro_batch(data, default=4)
    flags.packing(
        data,
        help="--task sft: the window's k x micro-batch examples as micro-batches: none (runs of "
        "--micro-batch), window (by --micro-batch-tokens) or padding-free (rows of --seq-len, "
        "attention within each example) (default none)",
        parse=_one_packing,
        default="none",
    )
    flags.micro_batch_tokens(
        data,
        help="--packing window or padding-free: positions per micro-batch, padding included "
        "(default micro-batch x seq-len)",
    )
    flags.seq_len(
        data,
        default=64,
        note=f"rows are ragged, this is the longest; at most {MAX_SEQ_LEN}: the float64 big "
        "batch costs about the square of it; k x micro-batch x seq-len must also fit the "
        "available memory at about 8 bytes x (18 x layers x width + 3 x vocab) per token",
    )
    flags.precision(data)
    flags.seed(data, of="the data and weights")
    more = p.add_argument_group("more checks")
    flags.count(
        more,
        "--world-size",
        default=1,
        help="also N gloo ranks (DDP, FSDP2); at most 4 per CPU core, and as many as the "
        "available memory holds at 0.3 GB plus "
        f"{RANK_BYTES_PER_PARAMETER} bytes per model parameter each",
    )
    more.add_argument("--precision-study", action="store_true", help="k = 1..K-MAX, per precision")
    flags.count(more, "--k-max", metavar="K", help="largest k of the study", default=1024)
    more.add_argument(
        "--plot",
        metavar="PATH",
        help=f"the study's PNG ({DEFAULT_PLOT}); only with --precision-study",
    )
    flags.json_output(p)
    p.set_defaults(run=run_of("verify_run"))


def _one_packing(text: str, flag: str) -> str:
    if text not in PACKINGS:
        raise BadInput(flag, text, f"choose one of {', '.join(PACKINGS)}")
    return text


def parse_sizes(args) -> dict:
    """The window's sizes, checked against what verify can take; the model source settled
    (--model or --model-config, the default preset when neither)."""
    names = ("k", "micro_batch", "seq_len", "world_size", "k_max", "seed")
    sizes = {name: getattr(args, name) for name in names}
    if sizes["seq_len"] < 2:
        raise BadInput("--seq-len", sizes["seq_len"], "must be at least 2 (one input, one target)")
    if sizes["seq_len"] > MAX_SEQ_LEN:
        raise BadInput(
            "--seq-len",
            sizes["seq_len"],
            f"at most {MAX_SEQ_LEN}: verify's float64 big batch costs about the square of the "
            "length (k 4 x 4 sequences of 4096 tokens took 262 s on 2 CPU cores)",
        )
    if sizes["k_max"] & (sizes["k_max"] - 1) or sizes["k_max"] > 1024:
        raise BadInput("--k-max", sizes["k_max"], "must be a power of two, at most 1024")
    args.model, args.model_config = flags.model_source(args)
    _check_task(args)
    _check_plot(args)
    return sizes


def _check_task(args) -> None:
    """--data belongs to --task sft; the N-rank check and the precision study run on the
    pretraining window only."""
    if args.task != "sft":
        if args.data is not None:
            raise BadInput("--data", args.data, "needs --task sft (the pretraining check "
                           "draws its own token sequences)")  # fmt: skip
        if args.packing != "none":
            raise BadInput("--packing", args.packing, "needs --task sft")
        if args.micro_batch_tokens is not None:
            raise BadInput("--micro-batch-tokens", args.micro_batch_tokens, "needs --task sft")
        return
    tokens = args.micro_batch_tokens
    if tokens is not None and args.packing == "none":
        raise BadInput("--micro-batch-tokens", tokens, "needs --packing window or padding-free")
    if tokens is not None and args.packing == "padding-free" and tokens < args.seq_len:
        raise BadInput(
            "--micro-batch-tokens",
            tokens,
            f"below --seq-len {args.seq_len}: a padding-free row is --seq-len positions",
        )
    if args.world_size > 1:
        raise BadInput("--world-size", args.world_size, "runs on --task pretrain only")
    if args.precision_study:
        raise BadInput("--precision-study: runs on --task pretrain only")


def _check_plot(args) -> None:
    """--plot only with --precision-study, onto a file in a folder that exists: checked
    before the study runs (1024 windows at the default --k-max), not after it."""
    if args.plot is not None and not args.precision_study:
        raise BadInput("--plot", args.plot, "needs --precision-study (the plot is the study's)")
    if not args.precision_study:
        return
    args.plot = args.plot or DEFAULT_PLOT
    folder = os.path.dirname(os.path.abspath(args.plot))
    if os.path.isdir(args.plot):
        raise BadInput("--plot", args.plot, "is a folder; give a file name such as study.png")
    if not os.path.isdir(folder):
        raise BadInput("--plot", args.plot, f"no folder {folder} to write it in")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise BadInput("--plot", args.plot, f"folder {folder} is not writable")
