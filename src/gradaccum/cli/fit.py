"""`gradaccum fit`: the micro-batch that fits and runs fastest on this device, measured, and
the k that keeps the tokens per step.

Same model and data flags as `gradaccum train`: the built-in `tiny` GPT and corpus by default.
Under torchrun every rank probes and all agree on one micro-batch.
"""

from __future__ import annotations

import argparse
import sys

from ..plan.sizes import parse_bytes, parse_count, parse_float
from ..utils.errors import BadInput
from .common import print_json

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
    model.add_argument("--model", metavar="NAME", help="tiny (default), small or gpt2-124m")
    model.add_argument("--model-config", metavar="PATH", help="a Hugging Face config.json")
    model.add_argument("--data", metavar="SPEC", help="PATH.txt, PATH.bin, PATH.npy, hf:NAME")
    model.add_argument("--seed", metavar="N", default="0", help="seed of the built-in corpus")
    model.add_argument("--seq-len", metavar="N", default="128", help="tokens per sequence (128)")
    model.add_argument(
        "--precision", choices=("fp32", "bf16", "fp16"), default="fp32", help="fp32 (default)"
    )
    batch = p.add_argument_group("batch and memory")
    batch.add_argument(
        "--tokens-per-step", metavar="N", help="target over all ranks (8192): 262k, 4M"
    )
    batch.add_argument(
        "--batch-tolerance",
        metavar="X",
        help="how far the global batch may land from the target when that is faster: 0.05 "
        "or 5%% (default 5%%); 0 insists on the target",
    )
    batch.add_argument("--memory-budget", metavar="SIZE", help="1GB, 20GiB; bare number: GB")
    batch.add_argument(
        "--device", default="auto", help="cpu, cuda, cuda:1, npu, npu:1, xpu, mps or auto"
    )
    batch.add_argument(
        "--max-seconds", metavar="T", help="end probing and timing after this many seconds"
    )
    batch.add_argument(
        "--no-checkpointing", action="store_true", help="do not try activation checkpointing"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


def _whole(text: str, flag: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise BadInput(flag, text, "must be a whole number") from None
    if value < least:
        raise BadInput(flag, text, f"must be at least {least}")
    return value


def _options(args: argparse.Namespace) -> dict:
    """The flags' values, checked: BadInput naming the flag and value otherwise."""
    from ..models.gpt import PRESETS
    from ..parallel.devices import check_device
    from ..train.config import DEFAULT_PRESET, DEFAULT_TOKENS_PER_STEP

    check_device(args.device)
    if args.model is not None and args.model_config is not None:
        raise BadInput("--model", args.model, "give --model or --model-config, not both")
    if args.model is not None and args.model not in PRESETS:
        raise BadInput("--model", args.model, f"unknown preset; choose one of {', '.join(PRESETS)}")
    tokens = args.tokens_per_step
    budget = args.memory_budget
    seconds = None if args.max_seconds is None else parse_float(args.max_seconds, "--max-seconds")
    if budget is not None:
        budget = parse_bytes(budget, "--memory-budget", bare_unit=10**9)
        if budget < 1:
            raise BadInput("--memory-budget", args.memory_budget, "must be above zero")
    return {
        "preset": None if args.model_config else args.model or DEFAULT_PRESET,
        "model_config": args.model_config,
        "data": args.data,
        "seed": _whole(args.seed, "--seed", 0),
        "seq_len": _whole(args.seq_len, "--seq-len", 1),
        "precision": args.precision,
        "tokens_per_step": DEFAULT_TOKENS_PER_STEP
        if tokens is None
        else parse_count(tokens, "--tokens-per-step"),
        "memory_budget": budget,
        "device": args.device,
        "max_seconds": seconds,
        "try_checkpointing": not args.no_checkpointing,
        "batch_tolerance": _tolerance(args.batch_tolerance),
    }


MAX_TOLERANCE = 0.5
"""The most --batch-tolerance takes: a batch half again or half the target is another recipe."""


def _tolerance(text: str | None) -> float:
    """--batch-tolerance as a fraction: 0.05 or 5%; the default when not given."""
    from ..fit.search import BATCH_TOLERANCE

    if text is None:
        return BATCH_TOLERANCE
    body = text.strip()
    percent = body.endswith("%")
    try:
        value = float(body[:-1] if percent else body) / (100 if percent else 1)
    except ValueError:
        raise BadInput("--batch-tolerance", text, "expected a fraction: 0.05 or 5%") from None
    if not 0 <= value <= MAX_TOLERANCE:  # NaN fails this too
        raise BadInput("--batch-tolerance", text, f"must be from 0 to {MAX_TOLERANCE:.0%}")
    return value


def _one_line(err: BaseException, flag: str, value) -> BadInput:
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return BadInput(text) if text.startswith("--") else BadInput(flag, value, text)


def _build(opts: dict, device):
    """Data and model as `gradaccum train` builds them; `make_batch(b)` on `device`."""
    import numpy as np

    from ..data.tokens import DEFAULT_CORPUS_TOKENS, load_tokens
    from ..models.gpt import build_model

    # Probing reads at most one global batch: the built-in corpus need not be longer.
    tokens = min(DEFAULT_CORPUS_TOKENS, 2 * opts["tokens_per_step"] + 4 * opts["seq_len"])
    try:
        train, _, info = load_tokens(
            opts["data"], opts["seq_len"], opts["seed"], corpus_tokens=tokens
        )
    except (ValueError, OSError, ImportError) as err:
        raise _one_line(err, "--data", opts["data"] or "(built-in)") from None
    try:
        model, _ = build_model(
            preset=opts["preset"],
            config_path=opts["model_config"],
            vocab_size=info.vocab_size,
            seq_len=opts["seq_len"],
        )
    except (ValueError, OSError, ImportError) as err:
        flag = "--model-config" if opts["model_config"] else "--model"
        raise _one_line(err, flag, opts["model_config"] or opts["preset"]) from None

    def make_batch(micro_batch: int) -> dict:
        rows = train.batch(np.arange(micro_batch) % len(train)).to(device)
        return {"input_ids": rows[:, :-1].contiguous(), "labels": rows[:, 1:].contiguous()}

    if len(train) < 1:
        raise BadInput("--data", opts["data"] or "(built-in)", "holds no whole sequence")
    return model.to(device), make_batch


def run(args: argparse.Namespace) -> int:
    from .. import fit
    from ..models.gpt import causal_lm_loss
    from ..parallel import process_group as distributed

    opts = _options(args)
    try:
        info = distributed.init_distributed(opts["device"])
    except (ValueError, RuntimeError) as err:
        raise _one_line(err, "--device", opts["device"]) from None
    try:
        if opts["tokens_per_step"] < opts["seq_len"] * info.world_size:
            raise BadInput(
                "--tokens-per-step",
                opts["tokens_per_step"],
                f"below one sequence of --seq-len {opts['seq_len']} on each of "
                f"{info.world_size} rank(s)",
            )
        model, make_batch = _build(opts, info.device)
        if info.world_size > 1:
            from torch.nn.parallel import DistributedDataParallel

            ids = [info.device.index] if info.device.type not in ("cpu", "mps") else None
            model = DistributedDataParallel(model, device_ids=ids)
        result = fit.find_micro_batch(
            model,
            make_batch,
            causal_lm_loss,
            seq_len=opts["seq_len"],
            tokens_per_step=opts["tokens_per_step"],
            world_size=info.world_size,
            precision=opts["precision"],
            memory_budget=opts["memory_budget"],
            try_checkpointing=opts["try_checkpointing"],
            max_seconds=opts["max_seconds"],
            batch_tolerance=opts["batch_tolerance"],
        )
    finally:
        distributed.teardown(info)
    if info.rank == 0:
        if args.json:
            print_json(result.to_dict())
        else:
            sys.stdout.write(fit.render_table(result))
    return 0
