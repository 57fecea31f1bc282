"""Activation checkpointing switched on and off one way, for the built-in GPT and for Hugging
Face models alike (the trainer's --activation-checkpointing and `gradaccum fit`'s probes).

Hugging Face models are switched with the non-reentrant checkpoint (`use_reentrant=False`),
as the built-in GPT is: the reentrant one gives no gradient to a block whose inputs do not
require grad (a frozen embedding, LoRA), and under DDP it can mark a parameter ready twice in
one backward, an error unless the graph is declared static.
"""

from __future__ import annotations

import torch


def outer_lists(model: torch.nn.Module) -> list[torch.nn.ModuleList]:
    """The model's non-empty ModuleLists that are not inside another's elements: its lists of
    blocks (a mixture of experts' list of experts, inside a block, is not one)."""
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m)]
    nested = {id(inner) for outer in lists for item in outer for inner in item.modules()}
    return [m for m in lists if id(m) not in nested]


def first_block(model: torch.nn.Module) -> torch.nn.Module | None:
    """The first transformer block: element 0 of the longest of `outer_lists` (a list of
    experts can be longer than the list of blocks); None if there is none."""
    outer = outer_lists(model)
    return max(outer, key=len)[0] if outer else None


def set_checkpointing(model: torch.nn.Module, enabled: bool) -> bool:
    """Turn activation checkpointing on or off; False when the model cannot do it."""
    inner = getattr(model, "module", model)  # DDP
    if hasattr(inner, "set_activation_checkpointing"):  # the built-in GPT
        inner.set_activation_checkpointing(enabled)
        return True
    for on, off, kwargs in (  # Hugging Face: the newer names first
        ("activation_checkpointing_enable", "activation_checkpointing_disable", "activation"),
        ("gradient_checkpointing_enable", "gradient_checkpointing_disable", "gradient"),
    ):
        if hasattr(inner, on):
            if enabled:
                options = {f"{kwargs}_checkpointing_kwargs": {"use_reentrant": False}}
                getattr(inner, on)(**options)
            else:
                getattr(inner, off)()
            return True
    return False


def checkpointing_enabled(model: torch.nn.Module) -> bool:
    """Whether activation checkpointing is on in `model` (or the model DDP wraps)."""
    inner = getattr(model, "module", model)
    if hasattr(inner, "activation_checkpointing"):
        return bool(inner.activation_checkpointing)
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(inner), name):
            return bool(getattr(inner, name))
    return False
