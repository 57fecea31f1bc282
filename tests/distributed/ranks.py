"""What the distributed tests share: per-rank ragged data, the global windows it forms, and
the single-process reference that takes each global window as one batch (no engine).

The process harness and the gradient recorders are `gradaccum.testing`'s, re-exported here.
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import lru_cache

import torch
from reference import big_batch, big_batch_grads, make_gpt, ragged_batches, token_loss

from gradaccum.testing import (  # noqa: F401 - re-exported for the tests
    adamw,
    full,
    record_grads,
    run_ranks,
    valid_tokens,
)

K = 4  # micro-batches per rank per window
TIMEOUT_S = 90.0  # a rank that hangs fails the test instead of blocking the suite


def rank_data(rank: int, count: int, seed: int = 100) -> list[dict]:
    """Rank `rank`'s micro-batches: 2 + rank rows each, so ranks hold unequal token counts."""
    return ragged_batches("gpt", count, seed=seed + 7 * rank, batch=2 + rank)


def global_windows(counts: tuple[int, ...], k: int = K, seed: int = 100) -> list[list[dict]]:
    """Window i = every rank's micro-batches i*k .. i*k + k - 1, while any rank has some."""
    per_rank = [rank_data(r, n, seed) for r, n in enumerate(counts)]
    out = []
    for i in range(0, max(counts), k):
        out.append([b for data in per_rank for b in data[i : i + k]])
    return out


@lru_cache(maxsize=4)
def reference_run(counts: tuple[int, ...]) -> dict:
    """One process, one batch per global window of ranks holding `counts` micro-batches:
    loss summed over tokens / tokens, AdamW. Cached: several tests share a run; read only."""
    windows = global_windows(counts)
    model = make_gpt()
    opt = adamw(model.parameters())
    grads, losses = [], []
    for window in windows:
        with torch.no_grad():
            loss_sum, n = token_loss(model, big_batch(window))
        losses.append(loss_sum.item() / n.item())
        grads.append(big_batch_grads(model, window))
        for p, g in zip(model.parameters(), grads[-1], strict=True):
            p.grad = g
        opt.step()
    return {"params": dict(model.named_parameters()), "grads": grads, "losses": losses}


def comparable(params: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """Parameters less the attention key bias: its true gradient is zero (softmax ignores a
    constant added to every key's score), so AdamW turns the rounding noise of any two ways of
    summing into full-size steps of arbitrary sign."""
    out = []
    for name, p in sorted(params.items()):
        if name.endswith("c_attn.bias"):
            q, _, v = p.detach().chunk(3)
            out += [q, v]
        else:
            out.append(p.detach())
    return out


@contextmanager
def one_thread():
    """Compute as each rank does (one thread): bf16 kernels such as LayerNorm's backward
    reduce in blocks that depend on the thread count, which moves bf16 results by an ulp."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
