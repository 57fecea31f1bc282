"""The flags of the commands, each defined once: its name, metavar, help, how its text is read
and the default the command gives it.

A flag several commands take (--model, --model-config, --data, --precision, --seq-len,
--micro-batch, --accum-steps, --tokens-per-step, --batch-schedule, --lr-rule, --seed, --device,
--json) has one function here that every command calls; a command's own numbers use `count`,
`size`, `seconds` and `number`. The value arrives read (an int, bytes, seconds, a schedule),
or the command stops before anything runs with one line naming the flag and the value
(BadInput, exit 2). Sizes are read by `gradaccum.plan.sizes` (4M, 4Mi, 262k, 80GB, 300ms).

`gradaccum train` reads its values through TrainConfig, which takes the same keys from a
--config TOML file and from a checkpoint: its flags come from these functions too, given the
field's `Flag` (`config=`: its help and metavar), with the text left for TrainConfig to read
and nothing in the namespace when the flag is not given.

No torch here (the parser of every command is built for `gradaccum plan` too): --device is
checked by `gradaccum.parallel.devices.check_device` when the command runs.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Iterable

from ..plan.batch_schedule import LR_RULES, parse_batch_schedule
from ..plan.sizes import parse_bytes, parse_count, parse_float, parse_seconds
from ..utils.choices import (
    BUILTIN_MODELS,
    DEFAULT_MODEL,
    DEVICES,
    MOE_BALANCES,
    PRECISIONS,
    TASKS,
    check_builtin_model,
)
from ..utils.errors import BadInput
from .common import reader


def _add(group, *names, help: str, config=None, parse: Callable | None = None, **kw) -> None:
    """One flag: read by `parse(text, flag)` as it is parsed; with `config` (a TrainConfig
    field's Flag) its help and metavar are the field's, the text is left for the config to
    read (choices too) and the namespace holds nothing when it is not given."""
    if config is not None:
        kw.pop("choices", None)
        kw.pop("default", None)
        if kw.get("action") is None:
            kw["metavar"] = config.metavar
        group.add_argument(*names, default=argparse.SUPPRESS, help=config.help, **kw)
        return
    if parse is not None:
        kw["type"] = reader(parse, names[0])
    group.add_argument(*names, help=help, **kw)


def _default(value) -> str:
    return "" if value is None else f" (default {value})"


def _with(note: str) -> str:
    return f"; {note}" if note else ""


# ---- numbers a command takes --------------------------------------------------------------


def count(
    group,
    *names,
    help: str,
    note: str = "",
    default=None,
    filled_in=False,
    metavar="N",
    allow_zero=False,
    config=None,
) -> None:
    """A whole count (tokens, sequences, steps): 4M, 4Mi, 262k, 1e6. `default` is said in the
    help (before the `note`); the namespace holds it when the flag is not given, or None
    with `filled_in` (the config the command builds fills it in)."""

    def parse(text, flag):
        return parse_count(text, flag, allow_zero=allow_zero)

    _add(
        group,
        *names,
        help=help + _default(default) + _with(note),
        config=config,
        parse=parse,
        default=None if filled_in else default,
        metavar=metavar,
    )


def size(group, *names, help: str, metavar="SIZE") -> None:
    """Bytes: 80GB (1e9 bytes), 64GiB; a bare number is GB. None when not given."""

    def parse(text, flag):
        return parse_bytes(text, flag, bare_unit=10**9)

    _add(group, *names, help=help, parse=parse, metavar=metavar)


def seconds(group, *names, help: str, metavar="T") -> None:
    """A duration in seconds: 300ms, 1.5s, 2min. None when not given."""
    _add(group, *names, help=help, parse=parse_seconds, metavar=metavar)


def number(group, *names, help: str, metavar="X", allow_percent=False) -> None:
    """A positive number (an LR, TFLOP/s); 40% is 0.4 where `allow_percent`. None when not
    given."""

    def parse(text, flag):
        return parse_float(text, flag, allow_percent=allow_percent)

    _add(group, *names, help=help, parse=parse, metavar=metavar)


# ---- the shared flags ---------------------------------------------------------------------


def model(group, *, shapes: Iterable[str] | None = None, config=None) -> None:
    """--model PRESET: a built-in GPT preset (None when not given: `model_source` picks the
    default). `shapes`: the planner's model shapes instead, which the plan reads (by any
    case)."""
    if shapes is not None:
        help, parse = f"model shape: {', '.join(shapes)}", None
    else:
        help = f"built-in GPT: {', '.join(BUILTIN_MODELS)} (default {DEFAULT_MODEL})"
        parse = check_builtin_model
    _add(group, "--model", help=help, config=config, parse=parse, metavar="PRESET")


def model_config(group, *, config=None) -> None:
    """--model-config PATH: a Hugging Face config.json to build a causal LM from."""
    _add(
        group,
        "--model-config",
        help="a Hugging Face config.json: the causal LM it describes, random init",
        config=config,
        metavar="PATH",
    )


def model_source(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """(preset, config.json) from --model and --model-config: one or the other, a config
    that exists, the default preset when neither is given."""
    if args.model is not None and args.model_config is not None:
        raise BadInput(f"--model {args.model}: give --model or --model-config, not both")
    if args.model_config is None:
        return args.model or DEFAULT_MODEL, None
    if not os.path.exists(args.model_config):
        raise BadInput("--model-config", args.model_config, "no such file")
    return None, args.model_config


def data(group, *, config=None, help: str | None = None) -> None:
    """--data PATH: training text or tokens; None: the built-in corpus. `help`: what the
    command reads from it, where that is not the training data."""
    help = help or "PATH.txt, PATH.bin, PATH.npy or hf:NAME[:SPLIT] (default: the built-in corpus)"
    _add(group, "--data", help=help, config=config, metavar="PATH")


def task(group, *, help: str = "", config=None) -> None:
    """--task: pretraining on a token stream or SFT on examples (train, verify)."""
    help = help or "pretrain (a token stream) or sft (SFT examples) (default pretrain)"
    _add(group, "--task", help=help, config=config, choices=TASKS, default=TASKS[0])


def lora_rank(group, *, help: str = "", config=None) -> None:
    """--lora-rank R: LoRA adapters of rank R on a frozen base (plan, fit, train)."""
    help = help or "LoRA adapters of rank R on the frozen model"
    _add(group, "--lora-rank", help=help, config=config, parse=parse_count, metavar="R")


def lora_alpha(group, *, config=None) -> None:
    """--lora-alpha A: the adapters' scale is alpha / rank."""
    help = "with --lora-rank: the adapters' update is scaled by alpha / rank (default 2 x rank)"
    _add(group, "--lora-alpha", help=help, config=config, parse=parse_float, metavar="A")


def _probability(text: str, flag: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise BadInput(flag, text, "expected a probability in [0, 1)") from None
    if not 0 <= value < 1:  # NaN fails this too
        raise BadInput(flag, text, "must be in [0, 1)")
    return value


def lora_dropout(group, *, config=None) -> None:
    """--lora-dropout P: dropout on the adapters' input, in [0, 1)."""
    help = "with --lora-rank: dropout on the adapters' input, in [0, 1) (default 0)"
    _add(group, "--lora-dropout", help=help, config=config, parse=_probability, metavar="P")


def lora_targets(group, *, config=None) -> None:
    """--lora-targets A,B: module names to adapt."""
    help = "with --lora-rank: module names to adapt (default: the attention and MLP projections)"
    _add(group, "--lora-targets", help=help, config=config, metavar="A,B")


def precision(group, *, default: str | None = "fp32", filled_in=False, config=None) -> None:
    """--precision: one of PRECISIONS. `default` is said in the help; the namespace holds it
    when the flag is not given, or None with `filled_in` (the plan fills it in)."""
    _add(
        group,
        "--precision",
        help=f"{', '.join(PRECISIONS)}: 16-bit ones are mixed precision{_default(default)}",
        config=config,
        choices=PRECISIONS,
        default=None if filled_in else default,
    )


def seq_len(group, *, default=None, filled_in=False, note: str = "", config=None) -> None:
    """--seq-len N: tokens per sequence."""
    kw = {"default": default, "filled_in": filled_in, "config": config}
    count(group, "--seq-len", help="tokens per sequence", note=note, **kw)


def micro_batch(group, *, default=None, filled_in=False, config=None) -> None:
    """--micro-batch N: sequences per device per micro-step."""
    help = "sequences per device per micro-step"
    count(group, "--micro-batch", help=help, default=default, filled_in=filled_in, config=config)


def packing(
    group,
    *,
    help: str = "",
    parse: Callable | None = None,
    default=None,
    config=None,
    several: bool = False,
) -> None:
    """--packing MODE: how a window's SFT examples become micro-batches. One mode (train,
    verify); `several`: the modes a command runs side by side (bench), a comma list the
    command reads itself, said so in the help (every command shows one metavar, MODE)."""
    if not help and several:
        help = (
            "--task sft: MODE[,MODE...], a comma list of gradaccum's modes none, window, "
            "padding-free to run side by side (default: all)"
        )
    help = help or "--task sft: none, window or padding-free"
    _add(group, "--packing", help=help, config=config, parse=parse, default=default, metavar="MODE")


def moe_balance(group, *, help: str = "", config=None) -> None:
    """--moe-balance MODE: how a mixture of experts' load-balancing loss is balanced over a
    window (train, verify; `utils.choices.MOE_BALANCES`, `gradaccum.models.balance`). None
    when not given: the command picks "global" for an MoE model and none for a dense one."""
    help = help or (
        "mixture of experts: the load-balancing loss per micro-batch (micro), over the whole "
        "window from a routing pass (global, exact), or with the previous window's token "
        "fractions (global-previous, no extra pass) (default global for an MoE model)"
    )
    _add(group, "--moe-balance", help=help, config=config, choices=MOE_BALANCES, metavar="MODE")


def micro_batch_tokens(group, *, help: str = "", config=None) -> None:
    """--micro-batch-tokens N: positions per micro-batch, padding included (--task sft)."""
    help = help or "--task sft: positions per micro-batch, padding included"
    count(group, "--micro-batch-tokens", help=help, config=config)


def accum_steps(group, *, default=None, filled_in=False, note: str = "", config=None) -> None:
    """--accum-steps K: micro-batches per optimizer step."""
    kw = {"default": default, "filled_in": filled_in, "metavar": "K", "config": config}
    count(group, "--accum-steps", help="micro-batches per optimizer step, k", note=note, **kw)


def tokens_per_step(group, *, default: int | None = None, config=None) -> None:
    """--tokens-per-step N: the global batch over all ranks, in tokens."""
    help = "tokens per optimizer step over all ranks, e.g. 262k, 4M"
    count(group, "--tokens-per-step", help=help, default=default, config=config)


def batch_schedule(group, *, note: str = "", config=None) -> None:
    """--batch-schedule: tokens per step by tokens seen (`plan.batch_schedule`)."""
    _add(
        group,
        "--batch-schedule",
        help="tokens per step by tokens seen, 0:32k,1B:256k,10B:4M or linear:0:32k,10B:4M"
        + _with(note),
        config=config,
        parse=parse_batch_schedule,
        metavar="SCHEDULE",
    )


def lr_rule(group, *, note: str = "", config=None) -> None:
    """--lr-rule: the LR for a batch c times the base batch."""
    _add(
        group,
        "--lr-rule",
        help="LR for a batch c times the base: none x 1, linear x c, sqrt x sqrt(c)" + _with(note),
        config=config,
        choices=LR_RULES,
    )


def seed(group, *, of: str = "", default: int = 0, filled_in=False, config=None) -> None:
    """--seed N: the seed of `of` (what the command draws from it)."""
    help = f"seed of {of}" if of else "seed"
    kw = {"default": default, "filled_in": filled_in, "allow_zero": True, "config": config}
    count(group, "--seed", help=help, **kw)


def device(group, *, default: str = "auto", config=None) -> None:
    """--device: where to run; checked by `devices.check_device` when the command runs."""
    help = DEVICES + _default(default)
    _add(group, "--device", help=help, config=config, default=default, metavar="DEVICE")


def json_output(group, *, config=None) -> None:
    """--json: one JSON object on stdout instead of the table."""
    _add(
        group, "--json", help="print one JSON object on stdout", config=config, action="store_true"
    )


SHARED = {
    "model": model,
    "model_config": model_config,
    "data": data,
    "precision": precision,
    "seq_len": seq_len,
    "micro_batch": micro_batch,
    "accum_steps": accum_steps,
    "tokens_per_step": tokens_per_step,
    "batch_schedule": batch_schedule,
    "lr_rule": lr_rule,
    "seed": seed,
    "device": device,
    "json": json_output,
    "task": task,
    "lora_rank": lora_rank,
    "lora_alpha": lora_alpha,
    "lora_dropout": lora_dropout,
    "lora_targets": lora_targets,
    "packing": packing,
    "micro_batch_tokens": micro_batch_tokens,
    "moe_balance": moe_balance,
}
"""Shared flags by dest, for `gradaccum train`, whose flags come from TrainConfig's fields."""
