"""`gradaccum verify`: accumulation against the big batch on a model, with the usual mistakes
for contrast, what breaks equivalence, and optionally N ranks and the precision study.

Exit 0 when the check passes, 1 when it fails (a finding, not an error), 2 on bad input.
"""

from __future__ import annotations

import os

from gradaccum.data.settings import DEFAULT_SPLIT, DataSettings
from gradaccum.engine.settings import PrecisionSettings
from gradaccum.grpo.settings import RLSettings
from gradaccum.models.quantized_spec import check_base_flags
from gradaccum.models.settings import LoraSettings, ModelSettings, model_source
from gradaccum.moe.settings import MoESettings
from gradaccum.parallel.settings import ParallelSettings
from gradaccum.settings.command import Command, part
from gradaccum.train.settings import BatchSettings, RunSettings
from gradaccum.train.tasks.registry import rules_of
from gradaccum.utils.choices import PACKINGS
from gradaccum.utils.errors import BadInput, flag_name
from gradaccum.verification.budget import MAX_SEQ_LEN
from gradaccum.verification.settings import VerifySettings, default_shards

DEFAULT_PLOT = "precision_study.png"
GRPO_FIELDS = (
    "prompts_per_step",
    "num_generations",
    "max_completion_length",
    "temperature",
    "loss_type",
    "epsilon",
    "epsilon_high",
    "beta",
    "scale_rewards",
)
"""The RL settings --task grpo takes."""
DEFAULT_LORA_RANK = 8
"""The LoRA rank of --base-bits without --lora-rank."""

_EPILOG = f"""\
The built-in check: a GPT of the chosen preset on token sequences of random lengths (micro-
batches padded to their longest row). --task sft: the window is k x micro-batch SFT examples
read and tokenized as `gradaccum train --task sft` reads them (the built-in instruction set,
or --data with --data-format and --train-on-prompt; byte tokens, or with --init-from the
folder's model in its own dtype, its tokenizer and chat template; the loss on the completion
only), each micro-batch padded to its longest, so the micro-batches hold different numbers of
targets. --packing window or padding-free cuts the same examples as `train --packing` does
(by --micro-batch-tokens, or into padding-free rows of up to --seq-len with attention kept
inside each example), checked against every example of the window padded into one unpacked
batch. --task grpo: --prompts-per-step built-in prompts x --num-generations completions
sampled from the model, rewards drawn from --seed, cut into --k micro-batches (or of
--micro-batch completions each), through each --loss-type (all four unless given) against one
float64 big batch with the loss written out, and beside it the mistakes users hit on the same
completions: each micro-batch normalised on its own then divided by k, the window's
normalisation divided by k once more, groups cut across micro-batches; with --world-size N the
window dealt to N gloo ranks too, as train deals it (each prompt's group on one rank), under
DDP. --base-bits 4 or 8 (QLoRA): the model built with its blocks' linear layers in
bitsandbytes' 4- or 8-bit layers on the CPU, LoRA adapters on it (rank {DEFAULT_LORA_RANK}
unless --lora-rank says), checked against the same adapters on the dequantised base in
float64; how far the dequantised weights are from the original ones is reported apart, as
information. --lora-rank alone: the adapters on the full base. Examples:
  gradaccum verify
  gradaccum verify --task sft                # the built-in instruction set
  gradaccum verify --task sft --data sft.jsonl --k 8
  gradaccum verify --task sft --packing padding-free
  gradaccum verify --task sft --init-from path/to/model --data sft.jsonl --packing window
  gradaccum verify --task sft --init-from path/to/model --base-bits 4   # QLoRA
  gradaccum verify --task grpo               # every loss type of the GRPO family
  gradaccum verify --task grpo --loss-type bnpo --num-generations 4 --k 8 --beta 0.04
  gradaccum verify --task grpo --world-size 2   # the groups dealt to 2 gloo ranks too
  gradaccum verify --model-config path/to/config.json --k 8 --precision bf16
  gradaccum verify --world-size 2          # also DDP and FSDP2 over 2 gloo processes on CPU
  gradaccum verify --world-size 4 --sync hsdp   # FSDP2 as 2 replicas x 2 shards
  gradaccum verify --model tiny-moe --moe-balance micro   # a mixture of experts
  gradaccum verify --precision-study --plot study.png
"""


COMMAND = Command(
    name="verify",
    help="prove accumulated gradients equal the big-batch gradient on a model",
    description="One window through the engine against the same data as one big batch.",
    parts=(
        part(ModelSettings, "model", "model_config", "init_from"),
        part(MoESettings),
        part(LoraSettings, "lora_rank", "base_bits", "base_quant"),
        part(RunSettings, "task"),
        part(
            DataSettings,
            "data",
            "data_split",
            "data_format",
            "train_on_prompt",
            "drop_long",
            "skip_bad_rows",
        ),
        part(VerifySettings, "k"),
        part(BatchSettings, "micro_batch", "packing", "micro_batch_tokens", "seq_len"),
        part(RLSettings, *GRPO_FIELDS),
        part(PrecisionSettings),
        part(RunSettings, "seed"),
        part(VerifySettings, "world_size"),
        part(ParallelSettings, "sync"),
        part(VerifySettings, "shards", "precision_study", "k_max", "plot"),
        part(RunSettings, "json"),
    ),
    run="verify_run",
    epilog=_EPILOG,
    defaults={
        "micro_batch": 4,
        "packing": "none",
        "seq_len": 64,
        "precision": None,
        "prompts_per_step": 4,
        "loss_type": None,
    },
    # --task grpo: the window is prompts x completions, cut by --k or --micro-batch (one of
    # them), as wide as its longest prompt and completion
    task_defaults={
        "pretrain": {},
        "sft": {},
        "grpo": {"k": None, "micro_batch": None, "seq_len": None},
    },
    exclusive=(("model", "model_config", "init_from"),),
    notes={
        "sync": "Verify runs FSDP2 under it on the ranks of --world-size (DDP syncs once per "
        "window whatever it says) and checks each wrapper's gradient bytes per window against "
        "the planner's.",
        "lora_rank": f"With --base-bits and no --lora-rank: {DEFAULT_LORA_RANK}. Unlike "
        "training, B starts small and random (drawn from --seed), not zero: with B = 0 every "
        "A's gradient is zero and the check would compare zeros.",
        "base_bits": f"Also without --lora-rank (rank {DEFAULT_LORA_RANK}). The reference is "
        "the same adapters on the dequantised base in float64; the quantisation error "
        "(dequantised weights against the original ones) is reported apart, not part of the "
        "verdict.",
        "precision": "Default fp32; with --init-from, the dtype the folder's weights are "
        "stored in (bf16 weights: bf16), and --precision fp32 loads them in fp32.",
        "loss_type": "verify: every loss type when not given.",
        "k": "--task grpo: the window's completions cut into K micro-batches as equal as "
        "they can be; given --micro-batch instead, K follows from it.",
        "micro_batch": "--task grpo: the last micro-batch holds the completions left; not "
        "given, --k decides.",
        "seq_len": f"Rows are ragged, this is the longest; at most {MAX_SEQ_LEN}: the float64 "
        "big batch costs about the square of it, and k x micro-batch x seq-len must fit the "
        "available memory at about 8 bytes x (18 x layers x width + 3 x vocab) per token. "
        "--task grpo: the longest prompt plus --max-completion-length unless given.",
    },
)


def parse_sizes(args) -> dict:
    """The window's sizes, checked against what verify can take; the model source settled
    (--model or --model-config, the default preset when neither)."""
    if args.packing not in PACKINGS:
        raise BadInput("--packing", args.packing, f"choose one of {', '.join(PACKINGS)}")
    names = ("k", "micro_batch", "seq_len", "world_size", "k_max", "seed")
    sizes = {name: getattr(args, name) for name in names}
    seq_len = sizes["seq_len"]  # None: --task grpo sets it from its prompts
    if seq_len is not None and seq_len < 2:
        raise BadInput("--seq-len", seq_len, "must be at least 2 (one input, one target)")
    if seq_len is not None and seq_len > MAX_SEQ_LEN:
        raise BadInput(
            "--seq-len",
            seq_len,
            f"at most {MAX_SEQ_LEN}: verify's float64 big batch costs about the square of the "
            "length (k 4 x 4 sequences of 4096 tokens took 262 s on 2 CPU cores)",
        )
    if sizes["k_max"] & (sizes["k_max"] - 1) or sizes["k_max"] > 1024:
        raise BadInput("--k-max", sizes["k_max"], "must be a power of two, at most 1024")
    sizes.update(_sync_mesh(args))
    args.model, args.model_config = _model_source(args)
    _check_task(args)
    _check_lora(args)
    _check_plot(args)
    if rules_of(args.task).takes_rl:
        sizes.update(_grpo_cut(args))
    return sizes


def _sync_mesh(args) -> dict:
    """--sync and --shards as the ranks run them: {"sync", "shards"}, shards settled for
    hsdp (`default_shards`), None otherwise."""
    world, sync, shards = args.world_size, args.sync or "window", args.shards
    if sync == "auto":
        raise BadInput("--sync", sync, "the planner's choice (gradaccum plan --sync auto); "
                       "verify runs window, micro or hsdp")  # fmt: skip
    if sync != "window" and world < 2:
        raise BadInput("--sync", sync, "needs --world-size of at least 2 (how the ranks sync)")
    if shards is not None and sync != "hsdp":
        raise BadInput("--shards", shards, "needs --sync hsdp")
    if sync != "hsdp":
        return {"sync": sync, "shards": None}
    if shards is None:
        shards = default_shards(world)
        if shards < 2:
            raise BadInput("--sync", "hsdp", f"--world-size {world} does not factor into "
                           "replicas x shards, both at least 2 (4, 6, 8 ranks do)")  # fmt: skip
    elif world % shards or world // shards < 2:
        raise BadInput("--shards", shards, f"--world-size {world} is not replicas x {shards} "
                       "with at least 2 replicas")  # fmt: skip
    return {"sync": sync, "shards": shards}


def _grpo_cut(args) -> dict:
    """--task grpo: completions per micro-batch ("cut"), k and the largest micro-batch."""
    from gradaccum.verification.grpo import micro_batch_sizes  # torch: only when verify runs

    completions = args.prompts_per_step * args.num_generations
    cut = micro_batch_sizes(completions, args.k, args.micro_batch, COMMAND.default("k"))
    return {"cut": cut, "k": len(cut), "micro_batch": max(cut)}


def _model_source(args) -> tuple[str | None, str | None]:
    """(preset, config.json): `model_source`, or neither for --init-from, which takes no
    other model."""
    if args.init_from is None:
        return model_source(args)
    other = next((n for n in ("model", "model_config") if getattr(args, n) is not None), None)
    if other is not None:
        raise BadInput(
            "--init-from",
            args.init_from,
            f"give only one of --model, --model-config, --init-from (also got "
            f"{flag_name(other)} {getattr(args, other)})",
        )
    return None, None


OWN_DATA = {
    "pretrain": "checks token sequences it draws itself",
    "grpo": "samples its window from the built-in instruction set's prompts, no --data",
}
"""What the checks other than --task sft run on, for the line refusing their --data."""

SFT_READING = ("data_format", "train_on_prompt", "drop_long", "skip_bad_rows")
"""How --task sft reads its rows: flags the pretraining check has no use for."""


def _check_task(args) -> None:
    """--data belongs to --task sft, the RL settings to --task grpo; the N-rank check and the
    precision study run on the pretraining window only."""
    rules = rules_of(args.task)
    if not rules.takes_rl:
        for name in GRPO_FIELDS:
            value = getattr(args, name)
            if value != COMMAND.default(name, args.task):
                raise BadInput(flag_name(name), value, "needs --task grpo")
    if not rules.counts_examples:
        if args.data is not None:
            raise BadInput("--data", args.data, f"needs --task sft; --task {args.task} "
                           f"{OWN_DATA[args.task]}")  # fmt: skip
        if args.data_split != DEFAULT_SPLIT:
            raise BadInput("--data-split", args.data_split, "needs --task sft")
        for name in SFT_READING:
            value = getattr(args, name)
            if value not in (False, "auto"):
                raise BadInput(flag_name(name), None if value is True else value,
                               "needs --task sft")  # fmt: skip
        if args.packing != "none":
            raise BadInput("--packing", args.packing, "needs --task sft")
        if args.micro_batch_tokens is not None:
            raise BadInput("--micro-batch-tokens", args.micro_batch_tokens, "needs --task sft")
        if rules.takes_rl:
            _check_grpo(args)
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


def _check_grpo(args) -> None:
    """--task grpo checks one window, the policy loss alone, in one process and with
    --world-size on that many ranks under DDP (each a prompt's group at least), as train runs
    it."""
    if args.world_size > 1 and (args.sync or "window") != "window":
        raise BadInput("--sync", args.sync, "--task grpo trains under DDP (window): each rank "
                       "generates its own completions, which a sharded model cannot")  # fmt: skip
    if args.world_size > args.prompts_per_step:
        raise BadInput("--world-size", args.world_size, f"more ranks than --prompts-per-step "
                       f"{args.prompts_per_step}: each rank takes whole groups")  # fmt: skip
    if args.precision_study:
        raise BadInput("--precision-study: runs on --task pretrain only")
    if args.moe_balance is not None:
        raise BadInput("--moe-balance", args.moe_balance, "needs --task pretrain or sft: "
                       "--task grpo checks the policy loss alone")  # fmt: skip


def _check_lora(args) -> None:
    """--base-bits is 4 or 8 (`QuantSpec`), --base-quant needs --base-bits 4, and --base-bits
    without --lora-rank takes DEFAULT_LORA_RANK. The adapters are checked in one process: the
    ranks of --world-size and the precision study build the full model."""
    args.lora_rank = check_base_flags(
        args.base_bits, args.base_quant, args.lora_rank, DEFAULT_LORA_RANK
    )
    if args.lora_rank is None:
        return
    without = "runs the full model; give it without --lora-rank and --base-bits"
    if args.world_size > 1:
        raise BadInput("--world-size", args.world_size, without)
    if args.precision_study:
        raise BadInput(f"--precision-study: {without}")


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
