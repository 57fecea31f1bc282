"""LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models") on a frozen
base, through peft (the `lora` extra: pip install 'gradaccum[lora]').

Each targeted linear layer W (out x in) gains A (r x in) and B (out x r) and computes
W x + (alpha / r) B A dropout(x); B starts at zero, so the model starts as the base. Only A and
B train: every other parameter gets requires_grad False, so the engine, DDP and the optimizer
see the adapters only, and gradients, fp32 buffers and optimizer state exist for them alone
(the planner's frozen-base memory, plan.memory.MemorySetup(trainable_params=...), with the
count of `lora_trainable_params`).

The adapters are injected in place with peft's `inject_adapter_in_model`: the model keeps its
class (a transformers model stays one, the built-in GPT stays a GPT) and its forward; each
targeted nn.Linear (or GPT-2's Conv1D) becomes a peft `lora.Linear` holding the original as
`base_layer`.

State and export:
- `adapter_state_dict(model)`: the adapters' tensors only, under their model.state_dict()
  names (`...attn.c_attn.lora_A.default.weight`), for checkpoints;
  `load_adapter_state_dict` puts them back bit for bit.
- `export_adapter(model, folder)`: peft's own adapter folder (adapter_config.json and
  adapter_model.safetensors, keys `base_model.model.<module>.lora_A.weight`), which
  `PeftModel.from_pretrained(base, folder)` loads onto a fresh base. For the built-in GPT the
  folder also holds base_config.json (its GPTConfig, model_type gradaccum-gpt), so the base
  can be rebuilt: `PeftModel.from_pretrained(GPT(GPTConfig(**cfg)), folder)` with the base's
  weights loaded first.
- `export_merged(model, folder)`: W + (alpha / r) B A folded into each weight (in fp32, stored
  in the weight's dtype), saved as a plain model: a transformers model with save_pretrained;
  the built-in GPT in this project's checkpoint form (config.json and model.safetensors,
  which build_model(init_from=) reads).
"""

from __future__ import annotations

import copy
import json
import math
import os
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn

from gradaccum.models.export import (
    export_hf_model,
    has_lora,
    save_tokenizer,
    unwrap,
    write_folder_atomic,
)
from gradaccum.models.gpt import GPT, GPT_MODEL_TYPE, GPTConfig
from gradaccum.models.hf_config import parameter_count
from gradaccum.utils.errors import BadInput

ADAPTER = "default"
"""The one adapter's name inside peft's layers."""

PEFT_PREFIX = "base_model.model."
"""What peft's saved adapter keys start with (the PeftModel and LoraModel wrappers)."""


@dataclass(frozen=True)
class LoraSpec:
    """What LoRA to apply; checked on construction (BadInput naming the flag)."""

    rank: int
    """r, the inner size of each pair A, B: r x (in + out) parameters per adapted layer."""
    alpha: float | None = None
    """The update is scaled by alpha / rank; None: 2 x rank (a scale of 2)."""
    dropout: float = 0.0
    """Dropout on the adapters' input, in [0, 1); 0 keeps a run exact and reproducible."""
    targets: tuple[str, ...] | None = None
    """Module names to adapt: a module matches when its name is the target or ends in
    "." + target. None: every linear layer but the output head (`default_targets`)."""

    def __post_init__(self):
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise BadInput("--lora-rank", self.rank, "must be an integer >= 1")
        alpha = self.alpha
        if alpha is not None and not (
            isinstance(alpha, (int, float)) and math.isfinite(alpha) and alpha > 0
        ):
            raise BadInput("--lora-alpha", alpha, "must be a number > 0")
        if not (isinstance(self.dropout, (int, float)) and 0.0 <= self.dropout < 1.0):
            raise BadInput("--lora-dropout", self.dropout, "must be in [0, 1)")
        targets = self.targets
        if isinstance(targets, str):
            targets = tuple(t.strip() for t in targets.split(","))
        if targets is not None:
            targets = tuple(targets)
            if not targets or not all(isinstance(t, str) and t for t in targets):
                raise BadInput("--lora-targets", ",".join(map(str, targets)), "empty module name")
        object.__setattr__(self, "targets", targets)

    @property
    def lora_alpha(self) -> float:
        return float(2 * self.rank if self.alpha is None else self.alpha)

    @property
    def scaling(self) -> float:
        """alpha / rank: the factor on B A."""
        return self.lora_alpha / self.rank


@dataclass(frozen=True)
class LoraInfo:
    """What `apply_lora` did, for the start-of-run printout and metrics."""

    rank: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]
    """The target names used (the architecture's defaults when none were given)."""
    layers: int
    """Linear layers that got an adapter."""
    trainable: int
    """Parameters that train: the adapters' A and B."""
    total: int
    """Every parameter of the model, base and adapters."""

    @property
    def fraction(self) -> float:
        """trainable / total."""
        return self.trainable / self.total

    def describe(self) -> str:
        return (
            f"LoRA rank {self.rank}, alpha {self.alpha:g}, dropout {self.dropout:g} on "
            f"{', '.join(self.targets)} ({self.layers} layers): {self.trainable:,} trainable "
            f"of {self.total:,} parameters ({100 * self.fraction:.3f}%), the base frozen"
        )

    def to_dict(self) -> dict:
        return {**asdict(self), "fraction": self.fraction}


def require_peft(rank=None):
    """The peft module; BadInput naming --lora-rank and the extra when it is not installed."""
    from gradaccum.models.quantized import import_bitsandbytes

    try:
        import_bitsandbytes()  # peft imports it: first without the kernel hub's lookup
        import peft
    except ImportError:
        raise BadInput("--lora-rank", rank, "needs peft (pip install 'gradaccum[lora]')") from None
    return peft


def _is_linear(module: nn.Module) -> bool:
    # transformers' Conv1D (GPT-2) is a linear layer with its weight stored (in, out).
    conv1d = type(module).__name__ == "Conv1D" and hasattr(module, "nf")
    return isinstance(module, nn.Linear) or conv1d


def _in_out(module: nn.Module) -> tuple[int, int]:
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    n_in, n_out = module.weight.shape  # Conv1D
    return int(n_in), int(n_out)


def _output_head(model: nn.Module) -> nn.Module | None:
    get = getattr(model, "get_output_embeddings", None)
    return get() if callable(get) else None


def linear_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every linear layer but the output head, in module order."""
    head = _output_head(model)
    return [(n, m) for n, m in model.named_modules() if _is_linear(m) and m is not head]


def default_targets(model: nn.Module) -> tuple[str, ...]:
    """The architecture's attention and MLP projections: the last name of every linear layer
    but the output head, in order of first appearance. Llama-like: q_proj, k_proj, v_proj,
    o_proj, gate_proj, up_proj, down_proj; GPT-2 and the built-in GPT: c_attn, c_proj, c_fc."""
    names: dict[str, None] = {}
    for name, _ in linear_layers(model):
        names.setdefault(name.rsplit(".", 1)[-1], None)
    return tuple(names)


def _matches(name: str, target: str) -> bool:
    return name == target or name.endswith("." + target)  # peft's rule for a list of names


def target_layers(model: nn.Module, targets) -> list[tuple[str, nn.Module]]:
    """The linear layers `targets` name. BadInput (--lora-targets) for a target that matches
    no module, or matches modules that are not linear layers."""
    shown = ",".join(targets)
    head = _output_head(model)
    chosen = []
    for target in targets:
        found = [(n, m) for n, m in model.named_modules() if n and _matches(n, target)]
        if not found:
            layers = linear_layers(model)
            examples = ", ".join(n for n, _ in layers[:2])
            raise BadInput(
                "--lora-targets",
                shown,
                f"{target} matches no module of {type(model).__name__}; its linear layers "
                f"are {', '.join(default_targets(model))} (e.g. {examples})",
            )
        wrong = [(n, m) for n, m in found if not _is_linear(m) or m is head]
        if wrong:
            n, m = wrong[0]
            what = "the output head" if m is head else f"{type(m).__name__} {n}"
            raise BadInput(
                "--lora-targets", shown, f"{target} matches {what}, not a linear layer of a block"
            )
        chosen += [(n, m) for n, m in found if all(n != c for c, _ in chosen)]
    return chosen


def lora_trainable_params(arch, rank: int, targets=None) -> int:
    """Parameters a LoRA of `rank` on `targets` adds to an architecture: r x (in + out) summed
    over the layers it adapts. `arch` is a model (not changed), a GPTConfig, or a transformers
    config (built on the meta device: no memory, a 7B model in about a second). The count of
    the real layers: GPT-2's fused c_attn (h -> 3h) counts r x 4h, not three q, k, v."""
    spec = LoraSpec(rank=rank, targets=targets)
    if isinstance(arch, nn.Module):
        model = unwrap(arch)
    else:
        with torch.device("meta"):
            model = GPT(arch) if isinstance(arch, GPTConfig) else _hf_from_config(arch)
    if has_lora(model):
        raise ValueError("lora_trainable_params: the model already holds LoRA adapters")
    layers = target_layers(model, spec.targets or default_targets(model))
    return rank * sum(sum(_in_out(m)) for _, m in layers)


def _hf_from_config(config) -> nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(config)


def apply_lora(model: nn.Module, spec: LoraSpec, adapter_dtype=torch.float32) -> LoraInfo:
    """Inject LoRA adapters into `model` in place and freeze everything else.

    adapter_dtype: the adapters' dtype; fp32 by default whatever the base's (peft's own
    default for a bf16 or fp16 base), None for the base layer's dtype. Raises BadInput for
    targets that match no linear layer, and for a missing peft.
    """
    peft = require_peft(spec.rank)
    if has_lora(model):
        raise ValueError("apply_lora: the model already holds LoRA adapters")
    targets = spec.targets or default_targets(model)
    layers = target_layers(model, targets)
    conv1d = any(not isinstance(m, nn.Linear) for _, m in layers)
    config = peft.LoraConfig(
        r=spec.rank,
        lora_alpha=spec.lora_alpha,
        lora_dropout=spec.dropout,
        target_modules=list(targets),
        fan_in_fan_out=conv1d,  # Conv1D stores its weight transposed
        bias="none",
        task_type=None if isinstance(model, GPT) else "CAUSAL_LM",
    )
    peft.inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    adapters = dict(_adapter_parameters(model))
    for name, p in model.named_parameters():
        p.requires_grad_(name in adapters)
    if adapter_dtype is not None:
        for p in adapters.values():
            p.data = p.data.to(adapter_dtype)
    return LoraInfo(
        rank=spec.rank,
        alpha=spec.lora_alpha,
        dropout=float(spec.dropout),
        targets=tuple(targets),
        layers=len(layers),
        trainable=sum(p.numel() for p in adapters.values()),
        total=parameter_count(model),
    )


def _lora_layer_class():
    require_peft()
    from peft.tuners.lora import LoraLayer

    return LoraLayer


def _lora_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    LoraLayer = _lora_layer_class()
    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoraLayer)]


def _adapter_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    found = []
    for name, layer in _lora_layers(model):
        for attr in layer.adapter_layer_names:
            for pname, p in getattr(layer, attr).named_parameters():
                found.append((f"{name}.{attr}.{pname}", p))
    return found


def is_adapter_key(name: str) -> bool:
    """Whether a model.state_dict() name is an adapter tensor's (`...c_attn.lora_A.default.
    weight`) rather than the base's (`...c_attn.base_layer.weight`)."""
    LoraLayer = _lora_layer_class()
    parts = name.split(".")
    pairs = zip(parts, parts[1:], strict=False)
    return any(a in LoraLayer.adapter_layer_names and b == ADAPTER for a, b in pairs)


def base_key(name: str) -> str:
    """The name a base tensor had before `apply_lora` moved it under `base_layer`."""
    return name.replace(".base_layer.", ".")


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters that train (requires_grad), in model order: what the optimizer gets, so
    its state holds the adapters only."""
    return [p for p in model.parameters() if p.requires_grad]


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' tensors only (no base tensor), under their model.state_dict() names,
    detached (sharing memory with the parameters, as state_dict does)."""
    return {name: p.detach() for name, p in _adapter_parameters(unwrap(model))}


def load_adapter_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy adapter tensors saved by `adapter_state_dict` into a model with the same LoRA,
    bit for bit. ValueError when names, shapes or dtypes differ (another rank, other targets)."""
    params = dict(_adapter_parameters(unwrap(model)))
    missing, unexpected = sorted(set(params) - set(state)), sorted(set(state) - set(params))
    if missing or unexpected:
        raise ValueError(
            f"adapter state does not match the model's LoRA: {len(missing)} missing "
            f"({', '.join(missing[:2])}), {len(unexpected)} unexpected ({', '.join(unexpected[:2])})"
        )
    for name, p in params.items():
        t = state[name]
        if t.shape != p.shape or t.dtype != p.dtype:
            raise ValueError(
                f"adapter {name}: saved {tuple(t.shape)} {t.dtype}, model {tuple(p.shape)} {p.dtype}"
            )
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(state[name])


def export_adapter(model: nn.Module, folder: str, base=None, tokenizer=None) -> str:
    """Write peft's adapter folder for `model` (see the module docstring) atomically.
    base: the base model's folder or hub name, written as base_model_name_or_path.
    tokenizer: a folder to copy tokenizer files from, or a tokenizer object. Returns folder."""
    peft = require_peft()
    from safetensors.torch import save_file

    model = unwrap(model)
    config = copy.deepcopy(model.peft_config[ADAPTER])
    config.inference_mode = True
    config.base_model_name_or_path = None if base is None else os.fspath(base)
    state = peft.get_peft_model_state_dict(model, adapter_name=ADAPTER)
    tensors = {PEFT_PREFIX + k: v.detach().contiguous() for k, v in state.items()}

    def fill(tmp: str) -> None:
        config.save_pretrained(tmp)
        save_file(tensors, os.path.join(tmp, "adapter_model.safetensors"), {"format": "pt"})
        if isinstance(model, GPT):
            _write_json(os.path.join(tmp, "base_config.json"), _gpt_config(model))
        save_tokenizer(tokenizer, tmp)

    return write_folder_atomic(folder, fill)


def merged_state_dict(
    model: nn.Module, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """The base's state_dict with each adapted weight replaced by W + (alpha / r) B A
    (computed in fp32, stored in W's dtype); the model is not changed. A base in 4 or 8 bits
    (--base-bits) is dequantised first: W is the weight its layers computed with, and every
    floating tensor is stored in `dtype` (the base's own dtype before quantisation), the
    quantisation's constants left out."""
    model = unwrap(model)
    layers = dict(_lora_layers(model))
    adapters = {name for name, _ in _adapter_parameters(model)}
    quantized = {f"{n}.weight": m for n, m in _quantized_layers(model)}
    merged = {}
    for key, value in model.state_dict().items():
        if key in adapters or _is_quant_state(key, quantized):
            continue
        if key in quantized:
            value = _dequantized(quantized[key])
        module, _, leaf = key.rpartition(".")
        owner = module.removesuffix(".base_layer")
        if module.endswith(".base_layer") and owner in layers:
            key = f"{owner}.{leaf}"
            if leaf == "weight":
                delta = layers[owner].get_delta_weight(ADAPTER)
                value = (value.float() + delta.float()).to(value.dtype)
        if quantized and dtype is not None and value.is_floating_point():
            value = value.to(dtype)
        merged[key] = value
    return merged


def _quantized_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    from gradaccum.models.quantized import quantized_layers

    return quantized_layers(model)


def _dequantized(layer: nn.Module) -> torch.Tensor:
    from gradaccum.models.quantized import dequantized_weight

    return dequantized_weight(layer)


def _is_quant_state(key: str, quantized: dict) -> bool:
    """Whether a state_dict key is a quantised layer's constant (weight.absmax, SCB, ...)."""
    module, _, leaf = key.rpartition(".")
    if leaf in ("SCB", "weight_format"):  # LLM.int8's row scales and layout
        return f"{module}.weight" in quantized
    return any(key.startswith(weight + ".") for weight in quantized)  # weight.absmax, ...


def export_merged(model: nn.Module, folder: str, tokenizer=None) -> str:
    """Write the merged model (adapters folded into the weights) atomically: a transformers
    model with save_pretrained, the built-in GPT as config.json and model.safetensors. The
    model itself keeps its adapters. Memory: a copy of every adapted weight. Returns folder."""
    model = unwrap(model)
    merged = merged_state_dict(model, base_dtype(model))
    if isinstance(model, GPT):
        from safetensors.torch import save_file

        tensors = {k: v.contiguous() for k, v in merged.items()}

        def fill(tmp: str) -> None:
            save_file(tensors, os.path.join(tmp, "model.safetensors"), {"format": "pt"})
            _write_json(os.path.join(tmp, "config.json"), _gpt_config(model))
            save_tokenizer(tokenizer, tmp)

        return write_folder_atomic(folder, fill)
    # A plain model of the same class, built without memory and given the merged tensors.
    config = copy.deepcopy(model.config)
    for key in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, key):
            delattr(config, key)
    dtype = base_dtype(model)
    if dtype is not None:
        config.dtype = dtype
    with torch.device("meta"):
        plain = type(model)(config)
    for name, _ in _quantized_layers(model):  # transformers loads GPT-2's Conv1D as Linear4bit
        name = name.removesuffix(".base_layer")
        if type(plain.get_submodule(name)).__name__ == "Conv1D":  # (in, out), not (out, in)
            merged[f"{name}.weight"] = merged[f"{name}.weight"].t().contiguous()
    plain.load_state_dict(merged, assign=True, strict=True)
    plain.tie_weights()
    if getattr(model, "generation_config", None) is not None:
        plain.generation_config = model.generation_config
    return export_hf_model(plain, folder, tokenizer=tokenizer)


def base_dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype of a quantised base's weights before quantisation (a folder's stored dtype,
    recorded as `base_dtype` when it was loaded; the built-in GPT's is fp32); None for a base
    not quantised."""
    if not _quantized_layers(model):
        return None
    config = getattr(model, "config", None)
    dtype = getattr(model, "base_dtype", None) or getattr(config, "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


def _gpt_config(model: GPT) -> dict:
    return {"model_type": GPT_MODEL_TYPE, **asdict(model.config)}


def _write_json(path: str, data: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True)
