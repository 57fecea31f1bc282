"""The model and data of the QLoRA benchmarks (qlora_checkpointing.py, qlora_gpu.py).

A Llama built from a config with random weights, on the device (a 7B one in bf16 takes 13.5
GB there and seconds to draw; in fp32 on the host it would take 27 GB and minutes), then made
what `gradaccum train --base-bits 4 --lora-rank R` trains: its blocks' linear layers swapped
for bitsandbytes NF4 `Linear4bit` layers with double-quantised constants
(`models.quantized.quantize_linears`, what `build_model(..., quant=...)` does to a model built
from a config), the base prepared for k-bit training (frozen, its unquantised parameters in
fp32), LoRA on every linear layer but the head (`models.lora.apply_lora`), and with
activation checkpointing the non-reentrant recomputation the train command turns on
(`models.checkpointing.set_checkpointing`).

The data are random token ids, every position a target: what a step costs does not depend
on what the tokens say. Labels are the inputs, unshifted (`gradaccum.hf.loss_fn` shifts).
"""

from __future__ import annotations

import torch

from gradaccum.models import lora, quantized
from gradaccum.models.checkpointing import set_checkpointing
from gradaccum.models.quantized_spec import QuantSpec, compute_dtype_for

LLAMA_7B = {"hidden": 4096, "intermediate": 11008, "layers": 32, "heads": 32, "vocab": 32000}
"""Llama 2 7B's shape (Touvron et al. 2023; the plan's llama2-7b)."""


def llama_config(hidden: int, intermediate: int, layers: int, heads: int, vocab: int, seq_len: int):
    """A transformers LlamaConfig of that shape (multi-head attention, untied head)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=seq_len,
        tie_word_embeddings=False,
        use_cache=False,
    )


def qlora_spec(device: torch.device) -> QuantSpec:
    """NF4, double-quantised, computed in bf16 on an accelerator and fp32 on the CPU (the
    train command's default)."""
    return QuantSpec(4, compute_dtype=compute_dtype_for(None, device.type))


def build_qlora(config, device: torch.device, rank: int, checkpointing: bool, seed: int = 0):
    """(model, LoraInfo): `config`'s Llama drawn from `seed` on `device` (bf16 on an
    accelerator, fp32 on the CPU), its base in 4 bits and LoRA of `rank` on it; with
    `checkpointing`, activation checkpointing on."""
    from transformers import AutoModelForCausalLM

    quantized.require_bitsandbytes(4)
    quantized.silence()
    weights = torch.float32 if device.type == "cpu" else torch.bfloat16
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=weights)
    model.config.use_cache = False
    quantized.quantize_linears(model, qlora_spec(device), device)
    quantized.prepare_for_kbit_training(model, checkpointing)
    info = lora.apply_lora(model, lora.LoraSpec(rank=rank))
    model.to(device)
    if checkpointing and not set_checkpointing(model, True):
        raise RuntimeError(f"{type(model).__name__} cannot recompute its activations")
    return model, info


def random_windows(
    n: int, k: int, micro_batch: int, seq_len: int, vocab: int, device: torch.device, seed: int = 0
) -> list[list[dict]]:
    """`n` windows of `k` micro-batches of `micro_batch` x `seq_len` random ids on `device`,
    every position a target (labels = input_ids, unshifted)."""
    g = torch.Generator().manual_seed(seed)
    windows = []
    for _ in range(n):
        window = []
        for _ in range(k):
            ids = torch.randint(0, vocab, (micro_batch, seq_len), generator=g).to(device)
            window.append({"input_ids": ids, "labels": ids})
        windows.append(window)
    return windows
