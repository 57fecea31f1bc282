"""What the distributed tests share: per-rank ragged data, the global windows it forms, and
the single-process reference that takes each global window as one batch (no engine)."""

from __future__ import annotations

from contextlib import contextmanager
from functools import lru_cache

import torch
from reference import IGNORE, big_batch, big_batch_grads, make_gpt, ragged_batches, token_loss

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


def valid_tokens(batches: list[dict]) -> int:
    return sum(int((b["labels"] != IGNORE).sum()) for b in batches)


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


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


def record_grads(optimizer: torch.optim.Optimizer) -> list[list[torch.Tensor]]:
    """The gradients the optimizer is handed at each step (full tensors under FSDP2)."""
    seen: list[list[torch.Tensor]] = []

    def hook(opt, args, kwargs):
        params = [p for g in opt.param_groups for p in g["params"]]
        seen.append([full(p.grad).detach().clone() for p in params])

    optimizer.register_step_pre_hook(hook)
    return seen


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


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
