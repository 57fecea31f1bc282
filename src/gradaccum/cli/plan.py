"""`gradaccum plan`: the batch, memory, time and LR arithmetic of a run, before running it.

Pure arithmetic: nothing here imports torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from ..plan import PlanInputs, make_plan, render_table
from ..plan.memory import CHECKPOINTING, DEFAULT_PRECISION, OPTIMIZERS
from ..plan.presets import MODEL_SHAPES
from . import flags
from .common import print_json

_EPILOG = """\
sizes: 4M = 4,000,000  4Mi = 4,194,304  262k  7B  1e6; memory 80GB (1e9 bytes) or 80GiB;
times 300ms, 1.5s, 2min. Examples:
  gradaccum plan --target-tokens 1M --seq-len 4096 --micro-batch 4 --gpus 8
  gradaccum plan --model llama2-7b --target-tokens 4Mi --seq-len 4096 --gpus 8 --zero 3 \\
      --flash-attention --device-memory 80GB --total-tokens 1T --peak-tflops 989 --mfu 0.4
  gradaccum plan --model llama2-7b --lora-rank 16 --device-memory 24GB --seq-len 2048 \\
      --micro-batch 1 --checkpointing full --target-tokens 32k
  gradaccum plan --target-sequences 128 --seq-len 2048 --micro-batch 1 --model llama2-7b \\
      --lora-rank 16 --base-bits 4 --checkpointing full --device-memory 24GB   # QLoRA
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
  --base-bits 4: the frozen base's block linear weights in NF4 with double-quantised
    constants (bitsandbytes' default), 0.5 + 1/64 + 1/4096 = 0.516 bytes each; 8: LLM.int8,
    1 byte each + 4 per output row; embeddings, head and norms stay in the parameter dtype.
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
    flags.count(batch, "--target-tokens", help="wanted tokens per step (1M, 4Mi)")
    flags.count(batch, "--target-sequences", help="wanted sequences per step")
    flags.accum_steps(batch, note="given, the global batch follows")
    flags.batch_schedule(batch, note="needs --total-tokens (see below)")
    micro = p.add_argument_group("micro-batch and devices")
    flags.seq_len(micro)
    flags.micro_batch(micro)
    flags.count(micro, "--micro-tokens", help="tokens per device per micro-step")
    flags.count(micro, "--gpus", "--devices", help="world size (1 when not given)")
    time = p.add_argument_group("time")
    flags.seconds(time, "--micro-step-time", help="measured time of one micro-step")
    flags.count(time, "--steps", help="optimizer steps of the run")
    flags.count(time, "--total-tokens", help="tokens to train on (steps round up)")
    cost = p.add_argument_group("model and cost")
    flags.count(cost, "--params", help="parameter count (7B)")
    flags.count(
        cost,
        "--active-params",
        help="parameters each token runs through, for a mixture of experts (47B total, 13B "
        "active): FLOPs and time count these, memory every parameter (default: all)",
    )
    flags.count(cost, "--layers", help="model shape: blocks")
    flags.count(cost, "--hidden", help="model shape: width")
    flags.count(cost, "--heads", help="model shape: attention heads")
    flags.count(cost, "--vocab", help="model shape: vocabulary size")
    flags.model(cost, shapes=MODEL_SHAPES)
    flags.number(cost, "--peak-tflops", help="peak TFLOP/s of one device")
    flags.number(cost, "--mfu", help="model FLOPs utilisation, 0.4 or 40%%", allow_percent=True)
    _add_memory_flags(p.add_argument_group("memory per device"))
    lr = p.add_argument_group("learning rate")
    flags.number(
        lr,
        "--base-lr",
        help="LR tuned at --base-batch-tokens (with --batch-schedule: at its last batch)",
    )
    flags.count(lr, "--base-batch-tokens", help="global batch of --base-lr, tokens")
    flags.lr_rule(lr, note="default sqrt for adamw, linear for sgd, none with --batch-schedule")
    flags.json_output(p)
    p.set_defaults(run=run)


def _add_memory_flags(memory) -> None:
    flags.precision(memory, default=DEFAULT_PRECISION, filled_in=True)
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
    flags.size(memory, "--device-memory", help="80GB, 64GiB; bare number: GB")
    flags.count(
        memory,
        "--trainable-params",
        help="parameters that train, the rest frozen (40M): gradients, fp32 buffer and "
        "optimizer state for these only",
    )
    flags.lora_rank(
        memory, help="LoRA at rank R on every linear layer of every block (needs a model shape)"
    )
    flags.count(
        memory,
        "--base-bits",
        metavar="BITS",
        help="the frozen base stored in 4 (NF4, QLoRA), 8 (LLM.int8) or 16 bits (the default "
        "under bf16); needs --lora-rank or --trainable-params; training a 4- or 8-bit base "
        "needs bitsandbytes on a GPU, not provided by gradaccum train",
    )


def inputs_from_args(args: argparse.Namespace) -> PlanInputs:
    """PlanInputs from the parsed flags (read as they were parsed); raises BadInput naming
    the flag and value."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(PlanInputs)}
    if values["zero"] is not None:
        values["zero"] = int(values["zero"])
    return PlanInputs(**values)


def run(args: argparse.Namespace) -> int:
    plan = make_plan(inputs_from_args(args))
    if args.json:
        print_json(plan.to_dict())
    else:
        sys.stdout.write(render_table(plan))
    return 0
