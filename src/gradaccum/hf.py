"""Hugging Face causal LMs in a hand-written loop: the loss and the token count, label shift
included.

A Hugging Face causal LM called with `labels=` shifts them itself (the label at position t
is predicted from the inputs before it) and returns their *mean*, which is the wrong thing to
accumulate over micro-batches of different lengths (docs/design.md, "Numerical rules"). Here
the labels stay unshifted, as the model expects them, -100 marks what is not a target, and the
loss is summed over the targets that remain after the shift:

    from gradaccum import Accumulator, hf
    acc = Accumulator(model, optimizer, count_tokens=hf.count_tokens)
    acc.step(micro_batches, hf.loss_fn)        # batches: input_ids, labels, [attention_mask]

`count_tokens` must shift too: counting `labels != -100` before the shift counts each row's
first label, which no position predicts.

Packed rows (`gradaccum.data.sft.packing`, layout "unshifted"): several examples in a row with
position_ids restarting at each and no attention_mask. transformers (5.x, through
`masking_utils.find_packed_sequence_indices`) then restricts attention to each example for
the sdpa, eager and flex_attention implementations, and flash attention reads the same
position ids as varlen boundaries, but only when the forward has no cache: `loss_fn` passes
`use_cache=False` (a model left to its default makes one, and every example would silently
attend to the ones before it). `packed_positions_supported` checks a model does it.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from gradaccum.models.loss import IGNORE_INDEX, count_targets, logits_of, targets, token_sum_loss

__all__ = [
    "IGNORE_INDEX",
    "count_tokens",
    "loss_fn",
    "packed_positions_supported",
    "shifted_labels",
]


def shifted_labels(labels: torch.Tensor) -> torch.Tensor:
    """The targets of positions 0 .. T-2: labels 1 .. T-1 of each row, (b, T-1)."""
    return targets(labels, shift=True)


def count_tokens(batch: Mapping) -> torch.Tensor:
    """Targets in a batch after the shift: `labels[:, 1:] != -100`, summed (a 0-dim tensor)."""
    return count_targets(batch["labels"], shift=True)


def loss_fn(model: torch.nn.Module, batch: Mapping) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy summed over the shifted targets, and their count (the Accumulator's
    loss_fn contract; `gradaccum.models.loss.token_sum_loss` with the shift).

    Every key of `batch` but "labels" and "document_ids" goes to the model as a keyword
    (input_ids, attention_mask, position_ids, ...); the labels are never handed to the model,
    so it does not average a loss of its own. With position_ids and no attention_mask (packed
    rows), also `use_cache=False` (see the module docstring). Logits are upcast to fp32
    (float64 stays float64).
    """
    inputs = {key: value for key, value in batch.items() if key not in ("labels", "document_ids")}
    if "position_ids" in inputs and "attention_mask" not in inputs:
        inputs["use_cache"] = False
    return token_sum_loss(logits_of(model(**inputs)), batch["labels"], shift=True)


def packed_positions_supported(model: torch.nn.Module) -> bool:
    """Whether `model` keeps packed documents apart given restarting position_ids alone,
    measured on the model as it is (three forwards of at most 2 x 4 tokens, no gradient, in
    eval mode): the second of two 4-token documents in one row must come out as it does
    alone, to within 1% of how far it lands when it attends to the first (the error of an
    implementation that ignores the packing; any dtype's rounding is far below it). False for
    an attention implementation or a transformers version that ignores packed position ids,
    so the caller can refuse or fall back to padded micro-batches."""
    param = next(model.parameters())
    ids = torch.arange(8, device=param.device).remainder(max(2, _vocab(model)))[None]
    positions = torch.arange(4, device=param.device).repeat(2)[None]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            packed = logits_of(model(input_ids=ids, position_ids=positions, use_cache=False))
            joined = logits_of(model(input_ids=ids, use_cache=False))
            alone = logits_of(model(input_ids=ids[:, 4:], use_cache=False)).float()
    finally:
        model.train(was_training)
    error = (packed[:, 4:].float() - alone).abs().max().item()
    wrong = (joined[:, 4:].float() - alone).abs().max().item()
    return error <= 0.01 * wrong


def _vocab(model: torch.nn.Module) -> int:
    config = getattr(model, "config", None)
    return int(getattr(config, "vocab_size", 2) or 2)
