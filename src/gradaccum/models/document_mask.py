"""Document masking: several documents in one row of tokens, each attending only to itself.

A packed row carries `document_ids` (b, T) int64: the document each token belongs to, each
document's tokens consecutive (0, 0, 0, 1, 1, 2, ...), any value for padding (the packers use
-1: padding is then a document of its own, so it never reaches a real token and no query is
left with nothing to attend to, which would make the softmax NaN). `position_ids` restart at
0 at each document, so every document sees the positions it would see alone.
"""

from __future__ import annotations

import torch

__all__ = ["block_causal_mask", "positions_from_documents"]


def block_causal_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """(b, 1, T, T) bool, True where query t may attend key s: s <= t and both in the same
    document. The boolean `attn_mask` of `F.scaled_dot_product_attention` (True = attend)."""
    t = document_ids.shape[-1]
    causal = torch.ones(t, t, dtype=torch.bool, device=document_ids.device).tril()
    same = document_ids[:, :, None] == document_ids[:, None, :]
    return (same & causal)[:, None]


def positions_from_documents(document_ids: torch.Tensor) -> torch.Tensor:
    """(b, T) int64: each token's position within its document (0 where the id changes)."""
    b, t = document_ids.shape
    index = torch.arange(t, device=document_ids.device).expand(b, t)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - first
