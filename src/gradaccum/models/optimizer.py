"""The optimizer a model trains with: AdamW, one factory for every part.

The trainer, fit (whose optimizer state it measures), verify and the testing harness (whose
steps they compare) all build their AdamW here, so they step the same way.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def adamw(
    params: torch.nn.Module | Iterable[torch.nn.Parameter],
    lr: float,
    weight_decay: float = 0.01,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    decay_matrices_only: bool = False,
) -> torch.optim.AdamW:
    """AdamW over the trainable parameters of `params` (a module, or parameters); torch's
    defaults unless given. `decay_matrices_only`: matrices and embeddings (2 or more
    dimensions) decay, biases and norm gains do not (nanoGPT, GPT-3), in two groups."""
    if isinstance(params, torch.nn.Module):
        params = params.parameters()
    trainable = [p for p in params if p.requires_grad]
    if not decay_matrices_only:
        return torch.optim.AdamW(trainable, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    groups = [
        {"params": [p for p in trainable if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in trainable if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps)
