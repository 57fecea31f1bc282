"""`gradaccum fit`: the micro-batch that fits and runs fastest on this device, measured, and
the k that keeps the tokens per step.

Same model and data flags as `gradaccum train`: the built-in `tiny` GPT and corpus by default.
Under torchrun every rank probes and all agree on one micro-batch.
"""

from __future__ import annotations

from gradaccum.data.settings import DataSettings
from gradaccum.engine.settings import PrecisionSettings
from gradaccum.fit.settings import FitSettings
from gradaccum.models.settings import LoraSettings, ModelSettings
from gradaccum.parallel.settings import ParallelSettings
from gradaccum.settings.command import Command, part
from gradaccum.train.settings import DEFAULT_TOKENS_PER_STEP, BatchSettings, RunSettings

_EPILOG = """\
Probes forward + backward + optimizer step at micro-batch 1, 2, 4, ... until one runs out
of memory (or over --memory-budget), bisects, then times the sizes that fit with activation
checkpointing off and on, then the sizes nearest the fastest whose global batch lands on the
target (within 1%). Of the sizes whose global batch is within --batch-tolerance (default 5%)
of the target it picks the fastest; among those within measurement noise of it (at most 5%),
one that lands on the target, then the one with the most headroom. The table says what a
choice off the target buys, and which faster size the tolerance left out.
Memory is measured: the allocator's peak on accelerators; on CPU the bytes of parameters,
gradients, buffers and optimizer state plus the tensors autograd saves for backward. With
--base-bits the model probed is the one train builds: its linear layers in 4 or 8 bits
(bitsandbytes), held at their stored size with their quantisation constants.
Examples:
  gradaccum fit --memory-budget 1GB
  gradaccum fit --lora-rank 8 --memory-budget 1GB      # the base frozen, as train's LoRA
  gradaccum fit --lora-rank 8 --base-bits 4 --memory-budget 1GB   # QLoRA: the base in NF4
  gradaccum fit --model-config gpt2/config.json --seq-len 1024 --precision bf16 \\
      --tokens-per-step 512k --device cuda
"""


COMMAND = Command(
    name="fit",
    help="find the micro-batch that fits and runs fastest; k keeps the global batch",
    description="Measure the micro-batch that fits and runs fastest; k keeps the target.",
    parts=(
        part(ModelSettings, "model", "model_config"),
        part(DataSettings, "data"),
        part(RunSettings, "seed"),
        part(BatchSettings, "seq_len", "tokens_per_step"),
        part(PrecisionSettings),
        part(LoraSettings, "lora_rank", "lora_alpha", "lora_dropout", "lora_targets"),
        part(LoraSettings, "base_bits", "base_quant"),
        part(FitSettings),
        part(ParallelSettings, "device"),
        part(RunSettings, "json"),
    ),
    run="fit_run",
    epilog=_EPILOG,
    defaults={"tokens_per_step": DEFAULT_TOKENS_PER_STEP},
)
