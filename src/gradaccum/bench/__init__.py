"""`gradaccum bench`: the engine against the loops a user would pick, side by side.

One model (the built-in GPT, or a Hugging Face causal LM from its config), one data set with
ragged valid lengths, one (micro-batch, k), through: gradaccum's `Accumulator`; the shortest
hand-written loop (each micro-batch's mean loss / k); and, where installed, Accelerate's
`accumulate`, the Transformers Trainer with `gradient_accumulation_steps` and Lightning's
`accumulate_grad_batches`. All start from the same weights with the same optimizer and see
the same micro-batches in the same order.

Two figures per contestant:
- tokens/s: valid (labelled) tokens over the wall time of `windows` optimizer steps, after one
  untimed step; the contestants' order alternates from round to round; the median over the
  rounds, its spread, and the ratio to the hand loop in the same round (median);
- update error: after one SGD step at lr 1 from the initial weights, the update is the
  gradient the contestant formed; its distance to the exact big-batch gradient (one float64
  forward over the window's rows, loss summed over valid tokens / N), relative to that
  gradient's norm.
Peak memory (its own weights, optimizer state, gradients and activations) where the device
reports it (not on CPU).

`--task sft` (`sft_data`, `sft_loops`, `sft_measure`, `sft_report`): a ragged instruction set
with a long tail and one Hugging Face model for gradaccum in each `--packing` mode, the hand
loop, TRL's SFTTrainer (padded and padding-free) and the Trainer with a padding collator:
target tokens/s, the share of computed positions that are padding, the update error, and
peak memory (on the CPU, sampled resident memory). With `--base-bits 4` (QLoRA) or
`--lora-rank R` every contestant trains the same LoRA adapters on the same frozen (4-bit) base
(`sft/adapters.py`), the update error taken against the float64 big batch on the dequantised base.
"""

from __future__ import annotations

from gradaccum.utils.lazy import lazy_exports

# imported on first use: the package's settings module loads without torch
__getattr__ = lazy_exports(
    __name__,
    {
        "PEERS": "pretrain.config",
        "BenchConfig": "pretrain.config",
        "run_bench": "pretrain.measure",
        "render_table": "pretrain.report",
        "to_json": "pretrain.report",
    },
)

__all__ = ["PEERS", "BenchConfig", "render_table", "run_bench", "to_json"]
