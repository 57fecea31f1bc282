"""`gradaccum plan`: the batch, memory, time and LR arithmetic of a run, before running it.

Pure arithmetic: nothing here imports torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from gradaccum.cli.common import print_json
from gradaccum.engine.settings import PrecisionSettings
from gradaccum.models.settings import LoraSettings, ModelSettings
from gradaccum.parallel.settings import ParallelSettings
from gradaccum.plan import PlanInputs, make_plan, render_table
from gradaccum.plan.memory import DEFAULT_PRECISION
from gradaccum.plan.settings import (
    PlanLRSettings,
    PlanMemorySettings,
    PlanModelSettings,
    PlanTargetSettings,
    PlanTimeSettings,
)
from gradaccum.settings.command import Command, namespace, part
from gradaccum.train.settings import BatchSettings, RunSettings

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


COMMAND = Command(
    name="plan",
    help="plan a run: global batch, k, memory per device, time, FLOPs, LR",
    description="Global batch = micro-batch x k x world: what it gives, what it costs.",
    parts=(
        part(PlanTargetSettings, "target_tokens", "target_sequences"),
        part(BatchSettings, "accum_steps", "batch_schedule", "seq_len", "micro_batch"),
        part(PlanTargetSettings, "micro_tokens", "gpus"),
        part(PlanTimeSettings),
        part(ModelSettings, "model"),
        part(PlanModelSettings),
        part(PrecisionSettings),
        part(PlanMemorySettings),
        part(ParallelSettings, "sync"),
        part(LoraSettings, "lora_rank", "base_bits"),
        part(PlanLRSettings),
        part(BatchSettings, "lr_rule"),
        part(RunSettings, "json"),
    ),
    run="plan",
    epilog=_EPILOG,
    # No --model by default: the plan counts a model only when one is named.
    defaults={"precision": DEFAULT_PRECISION, "seq_len": None, "accum_steps": None, "model": None},
    notes={
        "base_bits": "The plan also takes 16 (a bf16 base under --precision fp32), and "
        "--trainable-params in place of --lora-rank; 4 and 8 need a model shape."
    },
)


def inputs_from_args(args: argparse.Namespace) -> PlanInputs:
    """PlanInputs from the parsed flags (None where not given: the plan says what it
    assumed, and for the inputs no flag sets, counted on a model by `gradaccum train`);
    raises BadInput naming the flag and value."""
    given = namespace(args, fill=False)
    names = [f.name for f in dataclasses.fields(PlanInputs)]
    return PlanInputs(**{name: getattr(given, name, None) for name in names})


def run(args: argparse.Namespace) -> int:
    plan = make_plan(inputs_from_args(args))
    if getattr(args, "json", False):
        print_json(plan.to_dict())
    else:
        sys.stdout.write(render_table(plan))
    return 0
