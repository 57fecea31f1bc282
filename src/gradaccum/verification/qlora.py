"""LoRA and a quantised base in `gradaccum verify` (--lora-rank, --base-bits, --base-quant):
the adapters put on the case's model as `gradaccum train` puts them, the reference they are
checked against, and how far quantisation moved the base's weights (docs/design.md, "QLoRA").

- The adapters (`adapt`): with --base-bits the base was built quantised on the CPU
  (`models.build.build_model(quant=...)`, bitsandbytes' Linear4bit / Linear8bitLt in its
  blocks) and is prepared for k-bit training as train prepares it (frozen, its unquantised
  bf16/fp16 parameters in fp32: `models.quantized.prepare_for_kbit_training`); then peft's
  LoRA of --lora-rank (8 when only --base-bits is given: `cli.verify`) goes on every linear
  layer but the output head (`models.lora.apply_lora`), and only the adapters require grad.
  Training starts each B at zero; here B is drawn small and random from --seed (normal, std
  B_STD): with B = 0 every A's gradient is exactly zero and the check would compare zeros.
- The reference (`dequantized_reference`): a copy of the model whose bitsandbytes layers are
  nn.Linear layers holding their dequantised weights (`models.quantized.dequantize_linears`),
  the same adapters, in float64. On the CPU a 4- or 8-bit layer computing in fp32 gives
  x @ dequantize(W)^T to fp32 rounding (the tiny GPT's adapters' gradients agree with the
  float64 copy's to 7e-7, both widths), so the window's error against it is accumulation's.
  A folder's bf16 weights are loaded in fp32 before they are quantised (`cases`): the 4-bit
  layer's forward dequantises in fp32 but its backward in the dtype the weights were loaded
  in, and from bf16 the two differ by bf16's rounding (4e-3 on the adapters' gradient).
- The quantisation error (`quantization_error`): each quantised layer's dequantised weight
  against the weight it was quantised from (the --init-from folder loaded again without
  quantisation, or the model built again from --seed), ||W_deq - W|| / ||W|| (Frobenius). A
  property of the base, not of accumulation: reported apart, never part of the verdict.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn as nn

from gradaccum.models import quantized
from gradaccum.models.lora import LoraInfo, LoraSpec, apply_lora
from gradaccum.models.quantized_spec import QuantSpec
from gradaccum.moe.router import moe_spec
from gradaccum.utils.errors import BadInput

__all__ = [
    "B_STD",
    "Adapters",
    "Quantization",
    "adapt",
    "check_dense",
    "dequantized_reference",
    "quantization_error",
]

B_STD = 0.02
"""Standard deviation of the adapters' B as verify draws it (the usual init of a transformer's
weights): small, so the model stays near its base, and not zero, so A has a gradient."""


@dataclass
class Quantization:
    """How the base is stored, and how far that moved its weights (information: not part of
    verify's verdict)."""

    spec: QuantSpec
    """--base-bits and --base-quant, with the compute dtype."""
    layer_type: str
    """bitsandbytes' class of the quantised layers: Linear4bit or Linear8bitLt."""
    stored_bytes: int
    """Bytes the quantised base holds (`models.quantized.stored_bytes`), constants included."""
    original: str
    """Where the original weights were read from, in words."""
    rel_errs: dict[str, float]
    """Per quantised layer (its name in the base), ||W_deq - W|| / ||W|| (Frobenius norms)."""

    @property
    def worst_layer(self) -> str:
        """The layer whose dequantised weight is farthest from its original."""
        return max(self.rel_errs, key=self.rel_errs.__getitem__)

    @property
    def max_rel_err(self) -> float:
        return self.rel_errs[self.worst_layer]

    @property
    def mean_rel_err(self) -> float:
        return sum(self.rel_errs.values()) / len(self.rel_errs)

    def to_dict(self) -> dict:
        """What --json prints under "quantization"."""
        return {
            **self.spec.record(),
            "description": self.spec.describe(),
            "layers": len(self.rel_errs),
            "layer_type": self.layer_type,
            "stored_bytes": self.stored_bytes,
            "reference": "the quantised layers dequantised, the same adapters, in float64",
            "original": self.original,
            "max_rel_err": self.max_rel_err,
            "worst_layer": self.worst_layer,
            "mean_rel_err": self.mean_rel_err,
            "layer_rel_errs": dict(self.rel_errs),
            "part_of_verdict": False,
        }


@dataclass
class Adapters:
    """The LoRA verify put on the model, and its quantised base (None: a full base)."""

    lora: LoraInfo
    quantization: Quantization | None = None

    def to_dict(self) -> dict:
        """What --json prints under "lora"."""
        return {
            **self.lora.to_dict(),
            "targets": list(self.lora.targets),
            "b_init": f"normal, std {B_STD:g}, drawn from --seed",
        }


def check_dense(model: nn.Module, quant: QuantSpec) -> None:
    """BadInput (--base-bits) for a mixture of experts: its balance check runs the whole model
    in float64, which a quantised base cannot."""
    if moe_spec(model) is not None:
        raise BadInput(
            "--base-bits",
            quant.bits,
            "verify checks a quantised base on a dense model (a mixture of experts' balance "
            "check runs the whole model in float64); use --lora-rank alone",
        )


def adapt(
    model: nn.Module, lora_rank: int, seed: int, quantization: Quantization | None = None
) -> Adapters:
    """LoRA of `lora_rank` on `model` in place, A and B drawn from `seed` (module docstring);
    with `quantization` (the model was built quantised; `quantization_error`, measured before
    this), the base first prepared for k-bit training as train prepares it."""
    if quantization is not None:
        quantized.prepare_for_kbit_training(model)
    torch.manual_seed(seed)  # the draw of every A
    info = apply_lora(model, LoraSpec(rank=lora_rank))
    _draw_b(model, seed)
    return Adapters(info, quantization)


def _draw_b(model: nn.Module, seed: int) -> None:
    """Every adapter's B drawn from N(0, B_STD^2), from `seed`, in the model's order."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad and ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * B_STD)


def dequantized_reference(model: nn.Module) -> nn.Module:
    """A copy of `model` with its bitsandbytes layers dequantised into nn.Linear layers, the
    adapters as they are, in float64: what verify's big batch runs on. `model` is not
    changed."""
    return quantized.dequantize_linears(copy.deepcopy(model), torch.float64).double()


@torch.no_grad()
def quantization_error(
    model: nn.Module, quant: QuantSpec, original: nn.Module, source: str
) -> Quantization:
    """Each bitsandbytes layer of `model` (before LoRA: its names are the base's) against the
    weight of the same name in `original`, the same model unquantised."""
    layers = quantized.quantized_layers(model)
    errs = {}
    for name, layer in layers:
        want = original.get_submodule(name).weight.detach().double()
        got = quantized.dequantized_weight(layer).double()
        errs[name] = float((got - want).norm() / max(float(want.norm()), 1e-30))
    return Quantization(
        spec=quant,
        layer_type=type(layers[0][1]).__name__,
        stored_bytes=quantized.stored_bytes(model),
        original=source,
        rel_errs=errs,
    )
