"""The built-in GPT's mixture-of-experts layer (`GPTConfig(n_expert=E, expert_top_k=k)`).

Per token x (width C): router logits z = W_r x (a bias-free Linear(C, E)), probabilities
p = softmax(z) in at least fp32, the k experts of largest p chosen (`torch.topk`, ties to the
lower index), and the output

    y = sum over the chosen experts i of w_i * expert_i(x)

where w_i is p_i renormalised over the chosen experts (sum w_i = 1, Mixtral's rule) when
k > 1, and p_i itself when k = 1 (Switch's rule: a weight that is always 1 would leave the
router no gradient from the language-model loss). Each expert is the dense block's GELU MLP
(C -> 4C -> C). Dropless: every token reaches its k experts, whatever the load.

Each expert runs on its own tokens only (`index_select`, then `index_add` into the output):
no dense pass over all tokens, and the same arithmetic whatever else is in the batch, so the
result is deterministic (within one expert every index is distinct). An expert no token chose
still runs, on zero rows: its Linears are in the graph and backward gives them a zero
gradient, so DDP needs no `find_unused_parameters` for the experts.

The router logits of each layer, (tokens, E) with tokens = b * T in row-major order (Hugging
Face's layout), are returned beside the output; the load-balancing loss computed from them is
`gradaccum.moe.balance`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn


@dataclass
class MoEOutput:
    """What `GPT.forward(..., output_router_logits=True)` returns (Hugging Face's names)."""

    logits: torch.Tensor
    """(b, T, vocab)."""
    router_logits: tuple[torch.Tensor, ...]
    """One (b * T, E) tensor per MoE layer, the raw router logits (before the softmax), rows
    in the order of `input_ids.reshape(-1)`; empty for a dense model."""


def router_probs(logits: torch.Tensor) -> torch.Tensor:
    """softmax over the experts in at least fp32 (float64 stays float64)."""
    return torch.softmax(logits if logits.dtype == torch.float64 else logits.float(), dim=-1)


class MoE(nn.Module):
    """Top-k routed experts in place of the dense MLP: `forward(x) -> (y, router_logits)`."""

    def __init__(self, width: int, n_expert: int, top_k: int, make_expert: Callable[[], nn.Module]):
        super().__init__()
        if not 1 <= top_k <= n_expert:
            raise ValueError(f"top_k {top_k}: must be between 1 and n_expert {n_expert}")
        self.top_k = top_k
        self.router = nn.Linear(width, n_expert, bias=False)
        self.experts = nn.ModuleList(make_expert() for _ in range(n_expert))

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights (n, k) in the probabilities' dtype, chosen experts (n, k) int64) of
        router logits (n, E): see the module docstring."""
        probs = router_probs(logits)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        if self.top_k > 1:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, chosen

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (b, T, C) -> (y (b, T, C), router logits (b * T, E))."""
        flat = x.reshape(-1, x.shape[-1])
        logits = self.router(flat)
        weights, chosen = self.route(logits)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            # rows of the tokens that chose expert e, and which of their k slots it is
            token, slot = (chosen == e).nonzero(as_tuple=True)
            h = expert(flat.index_select(0, token))
            gate = weights[token, slot].unsqueeze(-1).to(h.dtype)
            # in the input's dtype: under autocast the experts' outputs may be 16-bit
            out = out.index_add(0, token, (h * gate).to(out.dtype))
        return out.view_as(x), logits
