"""`gradaccum bench` once its flags are read (`cli/bench.py`): the BenchConfig, the rounds, the
table or JSON."""

from __future__ import annotations

import argparse
import sys

from gradaccum.bench import PEERS, BenchConfig, render_table, run_bench, to_json
from gradaccum.bench.sft import report as sft_report
from gradaccum.bench.sft.config import SFTBenchConfig
from gradaccum.bench.sft.loops import PEERS as SFT_PEERS
from gradaccum.bench.sft.measure import run_sft_bench
from gradaccum.cli.bench import COUNTS, GRPO_COUNTS, GRPO_ONLY, SFT_COUNTS, SFT_ONLY
from gradaccum.cli.common import print_json
from gradaccum.settings.command import namespace
from gradaccum.utils.choices import PACKINGS
from gradaccum.utils.errors import BadInput, flag_name


def _names(flag: str, text: str, known) -> tuple[str, ...]:
    """A comma list of names; "none" is the empty tuple."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise BadInput(flag, repr(text), f"name some of {', '.join(known)} or none")
    return () if names == ["none"] else tuple(names)


def _refuse(args: argparse.Namespace, names, task: str) -> None:
    """BadInput for the first of `names` given: a flag of another --task than `task`."""
    for dest in names:
        if getattr(args, dest) is not None:
            raise BadInput(flag_name(dest), getattr(args, dest), f"not with --task {task}")


def grpo_config_from_args(args: argparse.Namespace):
    """The GRPOBenchConfig of the flags given (its own defaults for the rest)."""
    from gradaccum.bench.grpo.config import GRPOBenchConfig

    _refuse(args, ("model", "seq_len", "peers") + SFT_ONLY, "grpo")
    values = {d: getattr(args, d) for d in GRPO_COUNTS if getattr(args, d) is not None}
    if args.loss_type is not None:
        values["loss_types"] = (args.loss_type,)
    return GRPOBenchConfig(model_config=args.model_config, device=args.device or "auto", **values)


def sft_config_from_args(args: argparse.Namespace) -> SFTBenchConfig:
    """The SFTBenchConfig of the flags given (its own defaults for the rest)."""
    _refuse(args, GRPO_ONLY, "sft")
    if args.model is not None:
        raise BadInput(
            "--model",
            args.model,
            "--task sft runs a Hugging Face model: give --model-config or nothing (a tiny Llama)",
        )
    names = SFT_COUNTS + ("lora_rank", "base_bits", "base_quant")
    values = {d: getattr(args, d) for d in names if getattr(args, d) is not None}
    if args.peers is not None:
        values["peers"] = _names("--peers", args.peers, SFT_PEERS)
    if args.packing is not None:
        values["packings"] = _names("--packing", args.packing, PACKINGS)
    return SFTBenchConfig(model_config=args.model_config, device=args.device or "auto", **values)


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """The BenchConfig of the flags given (its own defaults for the rest)."""
    for dest in SFT_ONLY:
        if getattr(args, dest) is not None:
            raise BadInput(flag_name(dest), getattr(args, dest), "only with --task sft")
    _refuse(args, GRPO_ONLY, "pretrain")
    values = {dest: getattr(args, dest) for dest in COUNTS if getattr(args, dest) is not None}
    if args.peers is not None:
        values["peers"] = _names("--peers", args.peers, PEERS)
    return BenchConfig(
        model=args.model, model_config=args.model_config, device=args.device or "auto", **values
    )


def _measure(task: str, args: argparse.Namespace, progress):
    """(results, config, to_json, render_table) of --task `task`; its config read and
    checked before anything is built."""
    return MEASURES[task](args, progress)


def _measure_grpo(args: argparse.Namespace, progress):
    from gradaccum.bench.grpo import report as grpo_report
    from gradaccum.bench.grpo.measure import run_grpo_bench

    rows, summary = run_grpo_bench(grpo_config_from_args(args), progress=progress)
    return rows, summary, grpo_report.to_json, grpo_report.render_table


def _measure_sft(args: argparse.Namespace, progress):
    entries, summary = run_sft_bench(sft_config_from_args(args), progress=progress)
    return entries, summary, sft_report.to_json, sft_report.render_table


def _measure_pretrain(args: argparse.Namespace, progress):
    entries, summary = run_bench(config_from_args(args), progress=progress)
    return entries, summary, to_json, render_table


MEASURES = {"pretrain": _measure_pretrain, "sft": _measure_sft, "grpo": _measure_grpo}
"""The bench of each --task."""


def run(args: argparse.Namespace) -> int:
    args = namespace(args, fill=False)

    def progress(line: str) -> None:  # stderr, so that --json keeps stdout to the object
        print(line, file=sys.stderr, flush=True)

    results, summary, data, table = _measure(args.task or "pretrain", args, progress)
    if args.json:
        print_json(data(results, summary))
    else:
        sys.stdout.write(table(results, summary))
    return 0
