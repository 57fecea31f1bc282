"""What `loss_fn` (or `Window.backward`) must hand the engine, checked with one-line errors
that name what it returned: (the loss summed over the batch's valid tokens, a tensor with its
graph; their count, an int or a 0-d tensor). Type and shape checks only: no host sync.
"""

from __future__ import annotations

import numbers

import torch


def loss_pair(out) -> tuple:
    """`loss_fn`'s return value as (loss_sum, num_tokens), or a one-line error naming it."""
    if isinstance(out, (tuple, list)) and len(out) == 2:
        return out
    raise TypeError(
        f"loss_fn returned {_describe(out)}: it must return (loss_sum, num_tokens), the loss "
        "summed over the batch's valid tokens and their count"
    )


def checked_loss(loss_sum, num_tokens, source: str) -> torch.Tensor:
    """The loss as a 0-d fp32 tensor, or a one-line error naming what `source` ("loss_fn
    returned", "Window.backward got") handed over. Type and shape checks only: no host sync."""
    if not isinstance(loss_sum, torch.Tensor):
        value = f" ({loss_sum:.6g})" if isinstance(loss_sum, numbers.Real) else ""
        raise TypeError(
            f"{source} a {type(loss_sum).__name__} loss{value}: the loss must be a tensor with "
            "its graph, summed over the batch's valid tokens"
        )
    if loss_sum.numel() != 1:
        raise ValueError(
            f"{source} a loss of shape {tuple(loss_sum.shape)}: it must be one number, the loss "
            "summed (.sum()) over the batch's valid tokens, not one per row or token"
        )
    if not loss_sum.requires_grad:
        raise ValueError(
            f"{source} a loss without a graph (requires_grad=False): compute it from the "
            "model's output with gradients enabled"
        )
    if isinstance(num_tokens, torch.Tensor):
        bad = num_tokens.numel() != 1 or num_tokens.is_complex()
    else:
        bad = isinstance(num_tokens, bool) or not isinstance(num_tokens, numbers.Real)
    if bad:
        what = (
            f"of shape {tuple(num_tokens.shape)}"
            if isinstance(num_tokens, torch.Tensor)
            else repr(num_tokens)
        )
        raise TypeError(
            f"{source} num_tokens {what}: it must be the batch's count of valid tokens, one "
            "number (an int or a 0-d tensor)"
        )
    return (loss_sum if loss_sum.dim() == 0 else loss_sum.reshape(())).float()


def _describe(x) -> str:
    if x is None:
        return "None"
    if isinstance(x, (tuple, list)):
        return f"a {type(x).__name__} of {len(x)} values"
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {tuple(x.shape)}"
    if isinstance(x, numbers.Real):
        return f"a {type(x).__name__} ({x:.6g})"
    return f"a {type(x).__name__}"
