"""`gradaccum bench`: the engine against a hand-written loop and its peers, side by side."""

from __future__ import annotations

from gradaccum.bench.settings import BENCH_DEFAULTS, BenchSettings
from gradaccum.grpo.settings import RLSettings
from gradaccum.models.settings import LoraSettings, ModelSettings
from gradaccum.parallel.settings import ParallelSettings
from gradaccum.settings.command import Command, part
from gradaccum.train.settings import BatchSettings, RunSettings

_EPILOG = """\
Before the first step it says what it will run; after the first contestant's step, about how
long the rest takes; then each contestant's figures as they come (on stderr).
tokens/s: valid tokens per second, median of the rounds (order alternating), its spread
(largest - smallest) / median, and the ratio to the hand loop in the same round.
update err: one SGD step at lr 1 from the same weights, so the update is the gradient,
against the exact big batch (one float64 forward over the window's rows, loss / N).
Peers: pip install 'gradaccum[bench]'. A Hugging Face model from its config, e.g. GPT-2:
  python -c "from transformers import GPT2Config; GPT2Config().save_pretrained('gpt2')"
  gradaccum bench --model-config gpt2/config.json --seq-len 128 --micro-batch 2 \\
      --accum-steps 4 --rounds 3 --windows 1
--task sft: a ragged instruction set with a long tail (its length distribution is printed),
one Hugging Face model (a tiny Llama from config, or --model-config) for every contestant,
the same examples per step: gradaccum in each --packing mode, the hand loop (pad, mean / k),
TRL's SFTTrainer padded and padding-free, the Trainer with a padding collator (--peers trl,
trl-padding-free, trainer). Its defaults: --micro-batch 8, --accum-steps 8, --seq-len 512
(the longest example and the padding-free row), --micro-batch-tokens = --seq-len, --rounds 5,
--windows 3. Figures: target tokens/s, padding share, peak memory, update error.
--task sft --base-bits 4 (QLoRA): the same contestants train LoRA adapters (--lora-rank, 8 when
not given) on one 4-bit base, each a copy of the same quantised model with the same starting
adapters, all computing in fp32; the update error is against the float64 big batch on the
dequantised base (the weights the 4-bit layers compute with). --lora-rank alone: LoRA on the
fp32 base. Needs peft and bitsandbytes >= 0.47 (pip install 'gradaccum[qlora]').
--task grpo: gradaccum's RL losses against TRL's GRPOTrainer, one Hugging Face model (the tiny
Llama, or --model-config), --prompts-per-step x --num-generations completions per step
(micro-batch x k, the micro-batch in completions), sampled once with the model's generate
(timed apart) and cut to lengths varying 8x. For each --loss-type (all when not given): both
contestants' update error against the float64 big batch, then completion tokens/s of forward,
backward and step. TRL runs its own per-micro-batch path (training_step, its own scaling under
gradient_accumulation_steps). Its defaults: --micro-batch 4 (completions), --accum-steps 8,
--rounds 5, --windows 3. Needs trl (pip install 'gradaccum[bench]').
"""

COUNTS = ("micro_batch", "accum_steps", "seq_len", "rounds", "windows", "seed")
SFT_COUNTS = COUNTS + ("micro_batch_tokens",)
SFT_ONLY = ("micro_batch_tokens", "packing", "lora_rank", "base_bits", "base_quant")
"""Flags `gradaccum bench` takes with --task sft only."""
"""The counts `gradaccum bench` takes; None when not given: the config's defaults
(`BENCH_DEFAULTS`, which the help states) fill them in."""
GRPO_ONLY = ("prompts_per_step", "num_generations", "max_completion_length", "temperature",
             "loss_type")  # fmt: skip
"""Flags `gradaccum bench` takes with --task grpo only."""
GRPO_COUNTS = ("micro_batch", "accum_steps", "rounds", "windows", "seed", "prompts_per_step",
               "num_generations", "max_completion_length", "temperature")  # fmt: skip
"""The numbers --task grpo reads; its other flags of bench's are refused with it."""

COMMAND = Command(
    name="bench",
    help="the engine against a hand-written loop, Accelerate, the Trainer and Lightning",
    description="One model, one data set of ragged rows, one (micro-batch, k) through every\n"
    "contestant: tokens/s and the update's error against the exact big batch.",
    parts=(
        part(RunSettings, "task"),
        part(ModelSettings, "model", "model_config"),
        part(BatchSettings, "micro_batch", "accum_steps", "seq_len", "micro_batch_tokens"),
        part(BatchSettings, "packing"),
        part(LoraSettings, "lora_rank", "base_bits", "base_quant"),
        part(RLSettings, *GRPO_ONLY),
        part(BenchSettings),
        part(RunSettings, "seed"),
        part(ParallelSettings, "device"),
        part(RunSettings, "json"),
    ),
    run="bench_run",
    epilog=_EPILOG,
    task_defaults=BENCH_DEFAULTS,
    defaults={
        "packing": "all of none, window, padding-free",
        "prompts_per_step": None,
        "loss_type": None,
    },
    notes={
        "prompts_per_step": "--task grpo only; micro-batch x k / G when not given.",
        "num_generations": "--task grpo only.",
        "max_completion_length": "--task grpo only.",
        "temperature": "--task grpo only.",
        "loss_type": "--task grpo only; each of them when not given.",
        "lora_rank": "--task sft only; 8 with --base-bits when not given.",
        "base_bits": "--task sft only; --lora-rank defaults to 8 with it.",
    },
)
