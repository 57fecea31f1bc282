"""Router logits of mixture-of-experts models, read the same way from the built-in GPT and
from Hugging Face MoE models, and the per-layer routing figures the load-balancing loss is
made of (`gradaccum.moe.balance` turns them into the loss).

- `moe_spec(model)`: experts E, top-k, the loss's coefficient and the MoE layers L, or None
  for a dense model. The built-in GPT with `n_expert > 0`; a transformers model whose class
  records router logits (`_can_record_outputs["router_logits"]`, transformers 5) and whose
  config names `num_experts_per_tok`, `router_aux_loss_coef` and `num_local_experts` or
  `num_experts`: Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE are the ones checked. Their routers
  return raw logits (the softmax is taken here, in fp32) and route each token to the top-k of
  that softmax. Layers without experts (Qwen2-MoE's `mlp_only_layers`, a
  `decoder_sparse_step` above 1) return none, so L counts the routers.
- `forward(model, batch, shift)`: (logits, router logits per layer) of the training forward.
- `routing_pass(model, batch, shift)`: the router logits alone, no gradient, the output head
  skipped where the model allows (not under FSDP2, whose root unit holds the embedding).
- `routed_mask(batch)`: the tokens that are real input, which the balance counts.
- `layer_figures(router_logits, mask, top_k)`: per layer and expert, the tokens routed
  (top-k counts) and the summed router probabilities.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

try:
    from torch.distributed.fsdp import FSDPModule
except ImportError:  # a torch without FSDP2
    FSDPModule = None

from gradaccum.models.experts import router_probs
from gradaccum.models.loss import _unwrapped, logits_of, packed_inputs


@dataclass(frozen=True)
class MoESpec:
    """What the load-balancing loss needs to know about a mixture-of-experts model."""

    n_expert: int
    """Experts per MoE layer (E)."""
    top_k: int
    """Experts each token is routed to (k)."""
    coef: float
    """The loss's coefficient (`router_aux_loss_coef`, or GPTConfig.router_aux_coef)."""
    layers: int
    """MoE layers (L): layers with a router, dense ones not counted."""
    model_class: str
    """The model's class name, for messages."""


def core_model(model: torch.nn.Module) -> torch.nn.Module:
    """The model under DDP / torch.compile wrappers and a peft adapter (`get_base_model`)."""
    inner = _unwrapped(model)
    base = getattr(inner, "get_base_model", None)
    return _unwrapped(base()) if callable(base) else inner


def moe_spec(model: torch.nn.Module) -> MoESpec | None:
    """The model's MoESpec; None for a dense model or one whose router logits are not read."""
    inner = core_model(model)
    name = type(inner).__name__
    cfg = getattr(inner, "config", None)
    if getattr(inner, "reads_document_ids", False) and hasattr(cfg, "n_expert"):  # built-in
        if not cfg.n_expert:
            return None
        return MoESpec(
            cfg.n_expert, cfg.expert_top_k, float(cfg.router_aux_coef), cfg.n_layer, name
        )
    recorder = (getattr(type(inner), "_can_record_outputs", None) or {}).get("router_logits")
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    top_k = getattr(cfg, "num_experts_per_tok", None)
    coef = getattr(cfg, "router_aux_loss_coef", None)
    if recorder is None or not experts or not top_k or coef is None:
        return None
    layers = sum(1 for m in inner.modules() if _records(recorder, m))
    return MoESpec(int(experts), int(top_k), float(coef), layers, name) if layers else None


def _records(recorder, module: torch.nn.Module) -> bool:
    """Whether transformers' OutputRecorder `recorder` (or a bare class) captures `module`."""
    target = getattr(recorder, "target_class", recorder)
    if isinstance(target, type) and isinstance(module, target):
        return True
    suffix = getattr(recorder, "class_name", None)
    return bool(suffix) and type(module).__name__.endswith(suffix)


def _is_builtin(model: torch.nn.Module) -> bool:
    return bool(getattr(core_model(model), "reads_document_ids", False))


def model_inputs(model: torch.nn.Module, batch: Mapping, shift: bool) -> dict:
    """The keywords of the forward, as the token-sum losses call it.

    shift False (the trainer's batches, `models.loss.causal_lm_loss`): input_ids and the
    packed keys (`packed_inputs`), and a Hugging Face model also the batch's attention_mask.
    shift True (`gradaccum.hf.loss_fn`): every key but labels and document_ids, and
    use_cache=False for packed rows. The built-in GPT reads neither an attention_mask nor a
    cache flag: it gets input_ids and the packed keys either way."""
    if _is_builtin(model) or not shift:
        inputs = {"input_ids": batch["input_ids"], **packed_inputs(model, batch)}
        if not _is_builtin(model) and "attention_mask" in batch:
            inputs["attention_mask"] = batch["attention_mask"]
        return inputs
    inputs = {k: v for k, v in batch.items() if k not in ("labels", "document_ids")}
    if "position_ids" in inputs and "attention_mask" not in inputs:
        inputs["use_cache"] = False
    return inputs


def forward(
    model: torch.nn.Module, batch: Mapping, shift: bool = False
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(logits (b, T, vocab), router logits: one (b * T, E) tensor per MoE layer) of one
    forward through `model` (its wrappers included, so DDP sees it). ValueError naming the
    model's class when it returns no router logits."""
    out = model(**model_inputs(model, batch, shift), output_router_logits=True)
    return logits_of(out), _router_logits(out, model)


def routing_pass(model: torch.nn.Module, batch: Mapping, shift: bool = False) -> list[torch.Tensor]:
    """The router logits of `forward`, without gradient and without the output head where
    the model allows: the built-in GPT's `router_logits`, a Hugging Face model's base model
    (`model.base_model`). Under FSDP2 (a sharded root) the whole forward, through the
    wrapper. The same weights and inputs, so the same routing as the training forward when
    that is deterministic (no dropout before a router, no router jitter)."""
    inner = core_model(model)
    inputs = model_inputs(model, batch, shift)
    with torch.no_grad():
        if is_sharded(model):
            return forward(model, batch, shift)[1]
        if _is_builtin(model):
            return list(inner.router_logits(**inputs))
        base = getattr(inner, "base_model", None)
        if base is None or base is inner:
            return forward(model, batch, shift)[1]
        inputs.setdefault("use_cache", False)
        return _router_logits(base(**inputs, output_router_logits=True), model)


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether the model's root is an FSDP2 unit: each of its forwards then all-gathers the
    parameters, a collective every rank must join."""
    return FSDPModule is not None and isinstance(core_model(model), FSDPModule)


def _router_logits(out, model) -> list[torch.Tensor]:
    logits = getattr(out, "router_logits", None)
    if not logits:
        raise ValueError(
            f"{type(core_model(model)).__name__} returned no router logits with "
            "output_router_logits=True: not a mixture-of-experts model gradaccum can balance"
        )
    return list(logits)


def routed_mask(batch: Mapping) -> torch.Tensor:
    """(b * T,) bool: the tokens that are real input, in `input_ids.reshape(-1)` order:
    attention_mask == 1 when the batch has one, else document_ids >= 0 (packed rows, padding
    is -1) when it has those, else every position."""
    if "attention_mask" in batch:
        return batch["attention_mask"].reshape(-1) == 1
    if "document_ids" in batch:
        return batch["document_ids"].reshape(-1) >= 0
    return torch.ones(
        batch["input_ids"].numel(), dtype=torch.bool, device=batch["input_ids"].device
    )


def layer_figures(
    router_logits: Sequence[torch.Tensor], mask: torch.Tensor, top_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(counts (L, E) int64, no gradient: tokens of `mask` whose top-k contains each expert;
    prob sums (L, E), with gradient, fp32 or float64: the router probabilities summed over
    those tokens), each layer's softmax taken in at least fp32 (`moe.router_probs`)."""
    # The mask multiplies rather than selects: no host sync for the tokens' count.
    counts, sums = [], []
    for logits in router_logits:
        keep = mask.to(logits.device)[:, None]
        probs = router_probs(logits)
        chosen = probs.detach().topk(top_k, dim=-1).indices
        counts.append((F.one_hot(chosen, probs.shape[-1]).sum(dim=1) * keep).sum(dim=0))
        sums.append((probs * keep.to(probs.dtype)).sum(dim=0))
    return torch.stack(counts).to(torch.int64), torch.stack(sums)
