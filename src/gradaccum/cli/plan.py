"""`gradaccum plan`: the batch, memory, time and LR arithmetic of a run, before running it.

Pure arithmetic: nothing here imports torch.
"""

from __future__ import annotations

import argparse
import sys

from ..plan import LR_RULES, PlanInputs, make_plan, render_table
from ..plan.batch_schedule import parse_batch_schedule
from ..plan.memory import CHECKPOINTING, OPTIMIZERS, PRECISIONS
from ..plan.presets import PRESETS
from ..plan.sizes import parse_bytes, parse_count, parse_float, parse_seconds
from ..utils.errors import flag_name
from .common import print_json

# flag name (dest) -> parser of its text; choices and switches are handled by argparse.
_COUNTS = (
    "target_tokens target_sequences accum_steps seq_len micro_batch micro_tokens gpus steps "
    "total_tokens params layers hidden heads vocab base_batch_tokens trainable_params lora_rank"
)
_PARSERS = {name: parse_count for name in _COUNTS.split()}
_PARSERS.update(
    micro_step_time=parse_seconds,
    device_memory=lambda text, flag: parse_bytes(text, flag, bare_unit=10**9),
    peak_tflops=parse_float,
    base_lr=parse_float,
    mfu=lambda text, flag: parse_float(text, flag, allow_percent=True),
    batch_schedule=parse_batch_schedule,
)

_EPILOG = """\
sizes: 4M = 4,000,000  4Mi = 4,194,304  262k  7B  1e6; memory 80GB (1e9 bytes) or 80GiB;
times 300ms, 1.5s, 2min. Examples:
  gradaccum plan --target-tokens 1M --seq-len 4096 --micro-batch 4 --gpus 8
  gradaccum plan --model llama2-7b --target-tokens 4Mi --seq-len 4096 --gpus 8 --zero 3 \\
      --flash-attention --device-memory 80GB --total-tokens 1T --peak-tflops 989 --mfu 0.4
  gradaccum plan --model llama2-7b --lora-rank 16 --device-memory 24GB --seq-len 2048 \\
      --micro-batch 1 --checkpointing full --target-tokens 32k
  gradaccum plan --batch-schedule "0:32k,1B:256k,10B:4M" --total-tokens 20B --seq-len 2048 \\
      --micro-batch 1 --gpus 8 --model llama2-7b --micro-step-time 250ms --base-lr 3e-4 \\
      --lr-rule sqrt

batch schedule: TOKENS_SEEN:TOKENS_PER_STEP points, the first at 0; step-wise, or a linear
  ramp between the points with a linear: prefix (linear:0:32k,10B:4M). k is rounded per
  window from the target, at least 1, so every target must hold one micro-batch on every
  device; the micro-batch stays (picked for the smallest target when --device-memory picks
  it). The plan's batch rows describe the first phase; steps, tokens and time are the whole
  run's, and a table of the phases follows, each phase's time at its own k. The LR
  (--base-lr) belongs to the schedule's last batch; --lr-rule scales it for the others.

memory per device assumes (bytes; `gradaccum fit` measures the same terms):
  parameters: 2 each in bf16/fp16, 4 in fp32; ZeRO-3 gathers one block at a time.
  gradients: fp32 .grad, or 16-bit ones the engine adds into an fp32 buffer at once (4 per
    trained parameter), plus the largest tensor's fresh gradient while it accumulates, plus
    DDP's buckets; AdamW 8 per trained parameter (SGD 4), plus 4 for fp32 master weights in
    bf16/fp16. --trainable-params or --lora-rank: these terms for the trainable part only.
  activations per block (Korthikanti et al. 2022): 34 s b h + 5 a s^2 b at 16 bits, 66 and 9
    in fp32, dropout masks included; no s^2 term with --flash-attention; the MLP's activation
    one fused kernel (Hugging Face GPT-2's element-wise gelu_new keeps 3 more tensors of the
    MLP's width); logits in fp32, 4 s b V; --checkpointing full keeps each block's input and
    recomputes one block in backward.
  not counted: the CUDA context and library workspaces, allocator fragmentation, and copies a
    framework adds of its own (leave a few GB).
"""


def add_parser(sub, name: str) -> None:
    p = sub.add_parser(
        name,
        help="plan a run: global batch, k, memory per device, time, FLOPs, LR",
        description="Global batch = micro-batch x k x world: what it gives, what it costs.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    batch = p.add_argument_group("global batch per optimizer step (one of)")
    batch.add_argument("--target-tokens", metavar="N", help="wanted tokens per step (1M, 4Mi)")
    batch.add_argument("--target-sequences", metavar="N", help="wanted sequences per step")
    batch.add_argument("--accum-steps", metavar="K", help="k given: the global batch follows")
    batch.add_argument(
        "--batch-schedule",
        metavar="SCHEDULE",
        help="tokens per step by tokens seen, 0:32k,1B:256k,10B:4M or linear:0:32k,10B:4M; "
        "needs --total-tokens (see below)",
    )
    micro = p.add_argument_group("micro-batch and devices")
    micro.add_argument("--seq-len", metavar="N", help="tokens per sequence")
    micro.add_argument("--micro-batch", metavar="N", help="sequences per device per micro-step")
    micro.add_argument("--micro-tokens", metavar="N", help="tokens per device per micro-step")
    micro.add_argument("--gpus", "--devices", dest="gpus", metavar="N", help="world size (1)")
    time = p.add_argument_group("time")
    time.add_argument("--micro-step-time", metavar="T", help="measured time of one micro-step")
    time.add_argument("--steps", metavar="N", help="optimizer steps of the run")
    time.add_argument("--total-tokens", metavar="N", help="tokens to train on (steps round up)")
    cost = p.add_argument_group("model and cost")
    cost.add_argument("--params", metavar="N", help="parameter count (7B)")
    cost.add_argument("--layers", metavar="N", help="model shape: blocks")
    cost.add_argument("--hidden", metavar="N", help="model shape: width")
    cost.add_argument("--heads", metavar="N", help="model shape: attention heads")
    cost.add_argument("--vocab", metavar="N", help="model shape: vocabulary size")
    cost.add_argument("--model", metavar="NAME", help=f"preset: {', '.join(PRESETS)}")
    cost.add_argument("--peak-tflops", metavar="X", help="peak TFLOP/s of one device")
    cost.add_argument("--mfu", metavar="X", help="model FLOPs utilisation, 0.4 or 40%%")
    _add_memory_flags(p.add_argument_group("memory per device"))
    lr = p.add_argument_group("learning rate")
    lr.add_argument(
        "--base-lr",
        metavar="X",
        help="LR tuned at --base-batch-tokens (with --batch-schedule: at its last batch)",
    )
    lr.add_argument("--base-batch-tokens", metavar="N", help="global batch of --base-lr, tokens")
    lr.add_argument(
        "--lr-rule",
        choices=LR_RULES,
        help="LR for a batch c times the base: x 1, x c, x sqrt(c); default sqrt for adamw, "
        "linear for sgd, none with --batch-schedule",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


def _add_memory_flags(memory) -> None:
    memory.add_argument("--precision", choices=PRECISIONS, help="bf16 (default): mixed precision")
    memory.add_argument("--optimizer", choices=OPTIMIZERS, help="adamw (default) or sgd")
    memory.add_argument("--zero", choices=["0", "1", "2", "3"], help="ZeRO stage over --gpus")
    memory.add_argument(
        "--checkpointing", choices=CHECKPOINTING, help="full: keep block inputs only"
    )
    memory.add_argument(
        "--flash-attention",
        action="store_true",
        default=None,
        help="fused attention: the s x s scores are never stored",
    )
    memory.add_argument(
        "--sync-every-micro-batch",
        action="store_true",
        default=None,
        help="sync gradients after every micro-batch (ZeRO-2/3: sharded gradients, k x traffic);"
        " default: once per window",
    )
    memory.add_argument("--device-memory", metavar="SIZE", help="80GB, 64GiB; bare number: GB")
    memory.add_argument(
        "--trainable-params",
        metavar="N",
        help="parameters that train, the rest frozen (40M): gradients, fp32 buffer and "
        "optimizer state for these only",
    )
    memory.add_argument(
        "--lora-rank",
        metavar="R",
        help="LoRA at rank R on every linear layer of every block (needs a model shape)",
    )


def inputs_from_args(args: argparse.Namespace) -> PlanInputs:
    """PlanInputs from parsed flags; raises BadInput naming the flag and value."""
    values = {}
    for name, parse in _PARSERS.items():
        text = getattr(args, name)
        values[name] = None if text is None else parse(text, flag_name(name))
    return PlanInputs(
        **values,
        model=args.model,
        precision=args.precision,
        optimizer=args.optimizer,
        zero=None if args.zero is None else int(args.zero),
        checkpointing=args.checkpointing,
        flash_attention=args.flash_attention,
        sync_every_micro_batch=args.sync_every_micro_batch,
        lr_rule=args.lr_rule,
    )


def run(args: argparse.Namespace) -> int:
    plan = make_plan(inputs_from_args(args))
    if args.json:
        print_json(plan.to_dict())
    else:
        sys.stdout.write(render_table(plan))
    return 0
