"""The token-sum causal-LM loss: cross-entropy summed over the valid targets, and their count.

One core, `token_sum_loss(logits, labels, shift, ignore_index)`; the entry points hand it a
model's logits:

- `causal_lm_loss(model, batch)`: `model(batch["input_ids"])` (with the batch's
  "position_ids" / "document_ids" as keywords when it has them: packed rows), labels already
  aligned with the logits (the label at position t is the token after input t), as the
  built-in GPT, the trainer, fit, bench and the references take them;
- `gradaccum.hf.loss_fn(model, batch)`: every key but "labels" as keywords, labels as Hugging
  Face keeps them (unshifted: position t predicts label t + 1), shifted here.

A sum, never a mean: the engine divides by the window's valid tokens once (docs/design.md,
"Numerical rules"). Logits are upcast to at least fp32 before the cross-entropy (float64
stays float64, so a float64 reference is float64 throughout).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
"""The label of a position that is not a target (padding, prompt tokens): torch's default."""


def targets(labels: torch.Tensor, shift: bool) -> torch.Tensor:
    """The labels the logits predict: labels 1 .. T-1 of each row when `shift` (position t
    predicts label t + 1), else `labels` as they are."""
    return labels[..., 1:] if shift else labels


def count_targets(
    labels: torch.Tensor, shift: bool = False, ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """Targets that are not `ignore_index`, after the shift when `shift` (a 0-dim int64)."""
    return (targets(labels, shift) != ignore_index).sum()


def token_sum_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    shift: bool = False,
    ignore_index: int = IGNORE_INDEX,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cross-entropy summed over the valid targets, their count).

    logits: (b, T, vocab) in any float dtype, upcast to fp32 (float64 kept). labels: (b, T)
    long. shift: position t predicts label t + 1, so the last position and the first label
    drop out (Hugging Face's layout); otherwise label t is position t's target.
    Returns (loss_sum: 0-dim fp32 or float64 tensor, num_tokens: 0-dim int64 tensor).
    """
    if logits.dtype != torch.float64:
        logits = logits.float()
    if shift:
        logits = logits[..., :-1, :]
    wanted = targets(labels, shift)
    loss_sum = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]),
        wanted.reshape(-1),
        ignore_index=ignore_index,
        reduction="sum",
    )
    return loss_sum, (wanted != ignore_index).sum()


def logits_of(out) -> torch.Tensor:
    """A model's output as logits: the tensor itself, or its `.logits` (Hugging Face)."""
    return out if isinstance(out, torch.Tensor) else out.logits


PACKED_KEYS = ("position_ids", "document_ids")
"""Keys of a packed batch (`gradaccum.data.sft.packing.collate_packed`) that the model reads."""


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The module under DDP (`.module`) and torch.compile (`._orig_mod`) wrappers."""
    while True:
        inner = getattr(model, "module", None)
        if not isinstance(inner, torch.nn.Module):
            inner = getattr(model, "_orig_mod", None)
        if not isinstance(inner, torch.nn.Module):
            return model
        model = inner


def packed_inputs(model: torch.nn.Module, batch: Mapping) -> dict:
    """The keywords a packed batch adds to `model(input_ids, ...)`; {} for an ordinary batch.

    A model whose class sets `reads_document_ids = True` (the built-in GPT) gets both
    PACKED_KEYS. Any other gets "position_ids" alone; a Hugging Face model (its config has
    `use_cache`) also `use_cache=False`: transformers builds the per-document mask from
    restarting position ids only without a cache, and a model left to its default creates one
    (each document would then attend to the documents before it, silently)."""
    if not any(key in batch for key in PACKED_KEYS):
        return {}
    inner = _unwrapped(model)
    if getattr(inner, "reads_document_ids", False):
        return {key: batch[key] for key in PACKED_KEYS if key in batch}
    if "position_ids" not in batch:
        raise ValueError(
            f"{type(inner).__name__} does not read document_ids; a packed batch for it needs "
            "position_ids restarting at each document"
        )
    out = {"position_ids": batch["position_ids"]}
    if hasattr(getattr(inner, "config", None), "use_cache"):
        out["use_cache"] = False
    return out


def causal_lm_loss(model: torch.nn.Module, batch: Mapping, ignore_index: int = IGNORE_INDEX):
    """`token_sum_loss` of `model(batch["input_ids"], **packed_inputs(model, batch))` against
    `batch["labels"]`, all (b, T) long, labels already aligned with the inputs' next tokens
    (an ordinary batch: `model(input_ids)` as always). Works for the built-in GPT and for
    Hugging Face causal LMs; the Accumulator's loss_fn contract."""
    logits = logits_of(model(batch["input_ids"], **packed_inputs(model, batch)))
    return token_sum_loss(logits, batch["labels"], shift=False, ignore_index=ignore_index)
