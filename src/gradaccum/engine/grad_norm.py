"""The L2 norm of a window's gradient, DTensor shards (FSDP2) and plain tensors alike, and the
split into those two kinds that foreach ops need."""

from __future__ import annotations

import torch


def by_kind(grads: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The gradients split into DTensors (FSDP2 shards) and plain tensors (everything else, a
    parameter outside an FSDP2 model included): foreach ops take one kind at a time."""
    sharded = [g for g in grads if hasattr(g, "full_tensor")]
    plain = [g for g in grads if not hasattr(g, "full_tensor")]
    return [kind for kind in (sharded, plain) if kind]


def total_norm(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The L2 norm of all of `grads` (whole tensors under FSDP2: DTensor norms are reduced)."""
    norms = []
    for same_kind in by_kind(grads):
        if hasattr(torch.nn.utils, "get_total_norm"):  # torch >= 2.6
            norm = torch.nn.utils.get_total_norm(same_kind, norm_type=2.0, foreach=True)
        else:
            norm = torch.linalg.vector_norm(
                torch.stack([torch.linalg.vector_norm(g) for g in same_kind])
            )
        if hasattr(norm, "full_tensor"):  # DTensor gradients under FSDP2
            norm = norm.full_tensor()
        norms.append(norm.to(device))
    if not norms:
        return torch.zeros((), device=device)
    return norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms))
