"""LoRA and QLoRA in `gradaccum bench --task sft` (--lora-rank, --base-bits): the one adapted
model every contestant trains a copy of, and the base its float64 reference runs on.

The model is built as without them (`measure.build_hf`); then, with --base-bits, its blocks'
linear layers become bitsandbytes `Linear4bit` / `Linear8bitLt` (`quantize_linears`, what
`build_model(..., quant=...)` does to every model but a Hugging Face folder) and it is
prepared for k-bit training as the train command prepares it; then peft's LoRA layers go on
every linear layer but the head (`models.lora.apply_lora`, the base frozen). Every contestant,
TRL's SFTTrainer and the Trainer included, gets a deep copy of that one model: the same
quantised weights and the same starting adapters, so their updates can be compared. (TRL
given a base and a `peft_config` would draw adapters of its own; peft's `get_peft_model` puts
the same LoRA layers in place as `inject_adapter_in_model`, which apply_lora calls, plus a
wrapper that computes nothing.)

peft starts B at zero, where A's gradient is zero too and an update check would see only B.
Here B starts from small seeded values instead (as after some steps of training), so the
check covers both; the cost of a step does not depend on them.

All contestants compute in fp32: the 4-bit layers dequantise to fp32 (bitsandbytes' CPU and
CUDA kernels alike), and TRL's cast of the adapters to bf16, which it applies to a model
transformers loaded quantised, does not happen to this one.
"""

from __future__ import annotations

import copy

import torch

from gradaccum.models import lora, quantized

B_SCALE = 0.02
"""Standard deviation of B's starting values (A keeps peft's Kaiming-uniform draw)."""


def adapt(model: torch.nn.Module, cfg, device: torch.device) -> lora.LoraInfo | None:
    """`model` (fp32, on the CPU) quantised on `device` as `cfg.quant_spec` says and given
    LoRA of `cfg.lora_rank`, in place; the LoRA's description (None without --lora-rank).
    Draws A and B from torch's generator: call it under the bench's seed."""
    spec = cfg.quant_spec
    if spec is not None:
        quantized.require_bitsandbytes(spec.bits)
        quantized.silence()
        quantized.quantize_linears(model, spec, device)
        quantized.prepare_for_kbit_training(model)
    if cfg.lora_rank is None:
        return None
    info = lora.apply_lora(model, lora.LoraSpec(rank=cfg.lora_rank))
    with torch.no_grad():
        for name, tensor in lora.adapter_state_dict(model).items():
            if ".lora_B." in name:
                tensor.normal_(0.0, B_SCALE)
    return info


def reference_base(model: torch.nn.Module) -> torch.nn.Module:
    """The model the float64 big batch runs on: for a quantised base, a copy whose
    bitsandbytes layers are plain nn.Linear layers holding the weights they dequantise to
    (what each 4-bit layer computes with), so the reference differs from the contestants only
    in the float64 arithmetic; any other model as it is."""
    if not quantized.quantized_layers(model):
        return model
    return quantized.dequantize_linears(copy.deepcopy(model), torch.float32)


def versions() -> dict:
    """peft's and bitsandbytes' versions where installed (None where not)."""
    found = {}
    for name in ("peft", "bitsandbytes"):
        try:
            with quantized.quiet():
                module = __import__(name)
            found[name] = module.__version__
        except ImportError:
            found[name] = None
    return found
