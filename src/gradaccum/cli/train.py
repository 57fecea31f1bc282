"""`gradaccum train`: train a causal LM at a fixed tokens-per-step budget.

With no flags it trains the built-in `tiny` GPT on the built-in Markov corpus for a budget
that ends within about two minutes on two CPU cores, writing to runs/<date>-<time>.

Values come from, later ones winning: the defaults; on --resume the checkpoint's own
settings; the --config TOML file (keys are the flag names, with - or _); the command line.
Exit codes: 0 when training ended or SIGTERM stopped it after saving; 130 when Ctrl-C
stopped it after saving (a second Ctrl-C does not wait for the save); 2 on bad input.
"""

from __future__ import annotations

import argparse
import os

from ..plan.sizes import SizeError, parse_count
from .common import UsageError, bad, print_json

# name -> how its value is read: count (4M, 262k), int, float, micro (N or auto), str, bool
KINDS = {
    "tokens_per_step": "count",
    "seq_len": "int",
    "micro_batch": "micro",
    "accum_steps": "int",
    "max_steps": "int",
    "max_tokens": "count",
    "lr": "float",
    "warmup_steps": "int0",
    "schedule": "str",
    "weight_decay": "float",
    "max_grad_norm": "float",
    "precision": "str",
    "activation_checkpointing": "bool",
    "compile": "bool",
    "seed": "int0",
    "out": "str",
    "save_every": "int0",
    "resume": "bool",
    "json": "bool",
    "eval_every": "int0",
    "data": "str",
    "model": "str",
    "model_config": "str",
    "init_from": "str",
    "device": "str",
}

HELP = {
    "tokens_per_step": "tokens per optimizer step over all ranks, e.g. 8192, 262k, 4M "
    "(default 8192)",
    "seq_len": "tokens per sequence (default 128)",
    "micro_batch": "sequences per forward/backward per rank, or auto (default auto)",
    "accum_steps": "micro-batches per optimizer step (default: from --tokens-per-step)",
    "max_steps": "optimizer steps to train",
    "max_tokens": "tokens to train on, e.g. 1.5M (default 1,572,864)",
    "lr": "peak learning rate (default 3e-3)",
    "warmup_steps": "linear warmup, in optimizer steps (default a tenth of the run, <= 100)",
    "schedule": "cosine, linear or constant, in optimizer steps (default cosine)",
    "weight_decay": "AdamW weight decay (default 0.1)",
    "max_grad_norm": "clip the step's gradient norm; 0: off (default 1.0)",
    "precision": "fp32, bf16 or fp16 (default fp32)",
    "activation_checkpointing": "recompute activations in backward to save memory",
    "compile": "torch.compile the model",
    "seed": "seed of init, built-in corpus and data order (default 0)",
    "out": "output folder (default runs/<date>-<time>)",
    "save_every": "checkpoint every N optimizer steps; 0: only at the end (default 100)",
    "resume": "continue the run in --out from its newest checkpoint",
    "json": "print the final summary as JSON on stdout",
    "eval_every": "held-out loss every N optimizer steps; 0: only at the end (default 50)",
    "data": "PATH.txt, PATH.bin, PATH.npy or hf:NAME[:SPLIT] (default: built-in corpus)",
    "model": "preset: tiny, small, gpt2-124m (default tiny)",
    "model_config": "a Hugging Face config.json to build a model from (random init)",
    "init_from": "a checkpoint folder (config.json + model.pt) to start from",
    "device": "cpu, cuda, cuda:1, npu, mps, xpu or auto (default auto)",
}


def add_parser(sub, name: str) -> None:
    p = sub.add_parser(
        name,
        help="train a causal LM at a fixed tokens-per-step budget",
        description=__doc__.split("\n", 1)[1].strip(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    for key, kind in KINDS.items():
        flag = "--" + key.replace("_", "-")
        if kind == "bool":
            p.add_argument(
                flag, dest=key, action="store_true", default=argparse.SUPPRESS, help=HELP[key]
            )
        else:
            p.add_argument(
                flag,
                dest=key,
                default=argparse.SUPPRESS,
                metavar=_metavar(key, kind),
                help=HELP[key],
            )
    p.add_argument(
        "--config",
        dest="config_file",
        metavar="FILE.toml",
        default=None,
        help="TOML file whose keys are these flags; the command line wins",
    )
    p.set_defaults(run=run)


METAVARS = {
    "out": "DIR",
    "data": "PATH",
    "model": "PRESET",
    "model_config": "PATH",
    "init_from": "DIR",
    "device": "DEVICE",
    "schedule": "NAME",
    "precision": "NAME",
}


def _metavar(key: str, kind: str) -> str:
    return METAVARS.get(key) or {"float": "X", "micro": "N|auto"}.get(kind, "N")


def convert(key: str, value):
    """A flag's value, typed: from the command line (a string) or a TOML file (typed)."""
    flag = "--" + key.replace("_", "-")
    kind = KINDS[key]
    if kind == "bool":
        if not isinstance(value, bool):
            raise bad(flag, value, "must be true or false")
        return value
    if kind == "str":
        if not isinstance(value, str) or not value.strip():
            raise bad(flag, repr(value), "expected a non-empty string")
        return value
    if kind == "micro" and isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    if kind in ("count", "int", "int0", "micro"):
        if isinstance(value, bool):
            raise bad(flag, value, "expected a whole number")
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, int):
            return value
        try:
            return parse_count(str(value), flag, allow_zero=kind == "int0")
        except SizeError as err:
            raise UsageError(str(err)) from None
    try:  # float
        if isinstance(value, bool):
            raise ValueError
        return float(value)
    except (TypeError, ValueError):
        raise bad(flag, value, "not a number") from None


def read_toml(path: str) -> dict:
    """The flags a TOML file sets, by field name; unknown keys are refused, all named."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise bad("--config", path, "no such file") from None
    except (OSError, tomllib.TOMLDecodeError) as err:
        raise bad("--config", path, f"not a readable TOML file ({err})") from None
    values, unknown = {}, []
    for key, value in data.items():
        name = key.replace("-", "_")
        if name not in KINDS:
            unknown.append(key)
        else:
            values[name] = value
    if unknown:
        raise bad(
            "--config",
            path,
            f"unknown key{'s' if len(unknown) > 1 else ''} {', '.join(sorted(unknown))}",
        )
    return values


def resolve_values(args: argparse.Namespace) -> dict:
    """Defaults < checkpoint (on --resume) < --config file < command line, all typed."""
    from ..train import checkpoint

    given = read_toml(args.config_file) if args.config_file else {}
    given.update({k: v for k, v in vars(args).items() if k in KINDS})
    given = {key: convert(key, value) for key, value in given.items()}
    if not given.get("resume"):
        return given
    if "out" not in given:
        raise UsageError("--resume: needs --out naming the run to continue")
    latest = checkpoint.find_latest(given["out"])
    if latest is None:
        raise bad("--resume", given["out"], "no checkpoint in this folder to resume from")
    base = checkpoint.read_run_config(latest)
    # A flag given now replaces the ones it excludes, not only its own saved value.
    exclusive = (("max_steps", "max_tokens"), ("model", "model_config", "init_from"))
    for group in exclusive:
        if any(name in given for name in group):
            for name in group:
                base.pop(name, None)
    base = {k: v for k, v in base.items() if k in KINDS and k not in ("resume", "json")}
    return {**base, **given}


def run(args: argparse.Namespace) -> int:
    from ..train.loop import TrainConfig, TrainConfigError, train

    values = resolve_values(args)
    try:
        config = TrainConfig(**values)
        summary = train(config)
    except TrainConfigError as err:
        raise UsageError(str(err)) from None
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
    lines = [
        f"{'stopped' if s['stopped'] else 'done'}: {s['steps']}/{s['total_steps']} steps, "
        f"{s['tokens']:,} tokens, {s['tokens_per_s']:,.0f} tokens/s, {s['wall_s']:.1f} s",
        f"loss {num(s['initial_loss'])} -> {num(s['final_loss'])} "
        f"(held out {num(s['final_eval_loss'])}); ln V {s['ln_vocab']:.4f}{floor}",
        f"out {s['out']}: metrics.jsonl, train.toml, loss.png, checkpoints/",
    ]
    return "\n".join(lines)
