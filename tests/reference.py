"""Small models, ragged token data and big-batch references shared by the engine tests.

The reference for a window is always computed without the engine: every micro-batch padded
to one length, stacked into one batch, one forward and one backward of the summed token loss
divided by the window's valid-token count.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

from gradaccum.train.model import GPT, GPTConfig

IGNORE = -100


class TokenMLP(nn.Module):
    """Per-token classifier: (b, T, d) features -> (b, T, classes) logits."""

    def __init__(self, d_in: int = 8, hidden: int = 32, classes: int = 5):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, classes)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def token_loss(model, batch):
    """Summed cross-entropy over valid labels and their count (the engine's loss_fn contract)."""
    logits = model(batch["input_ids"])
    labels = batch["labels"]
    loss = F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]),
        labels.reshape(-1),
        ignore_index=IGNORE,
        reduction="sum",
    )
    return loss, (labels != IGNORE).sum()


def make_mlp(seed: int = 0, dtype=torch.float32) -> TokenMLP:
    torch.manual_seed(seed)
    return TokenMLP().to(dtype)


def make_gpt(seed: int = 0, vocab: int = 37, seq_len: int = 16) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=vocab, seq_len=seq_len, n_layer=2, n_head=2, n_embd=32))


def ragged_batches(
    kind: str,
    count: int,
    seed: int,
    seq_len: int = 16,
    batch: int = 3,
    vocab: int = 37,
    d_in: int = 8,
    classes: int = 5,
    dtype=torch.float32,
):
    """`count` micro-batches whose rows hold random numbers of valid tokens (1..seq_len);
    the rest of each row is padding with label IGNORE."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        lengths = torch.randint(1, seq_len + 1, (batch,), generator=g)
        valid = torch.arange(seq_len)[None, :] < lengths[:, None]
        if kind == "gpt":
            ids = torch.randint(0, vocab, (batch, seq_len), generator=g)
            labels = torch.randint(0, vocab, (batch, seq_len), generator=g)
            ids = torch.where(valid, ids, torch.zeros_like(ids))
        else:
            ids = torch.randn(batch, seq_len, d_in, generator=g).to(dtype)
            labels = torch.randint(0, classes, (batch, seq_len), generator=g)
        out.append({"input_ids": ids, "labels": torch.where(valid, labels, IGNORE)})
    return out


def big_batch(micro_batches: list[dict]) -> dict:
    return {k: torch.cat([b[k] for b in micro_batches]) for k in micro_batches[0]}


def big_batch_grads(model: nn.Module, micro_batches: list[dict], dtype=None) -> list[torch.Tensor]:
    """Gradients of (sum of token losses) / (valid tokens) over all micro-batches at once."""
    model = copy.deepcopy(model)
    if dtype is not None:
        model = model.to(dtype)
    batch = big_batch(micro_batches)
    if dtype is not None and batch["input_ids"].is_floating_point():
        batch = {**batch, "input_ids": batch["input_ids"].to(dtype)}
    loss_sum, n = token_loss(model, batch)
    (loss_sum / n).backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def exact_fp64_sum(model, data) -> list[torch.Tensor]:
    """The window gradient as exact accumulation would give it: each micro-batch's own
    gradient (in the model's dtype) of loss_sum / N, summed in float64."""
    model = copy.deepcopy(model)
    total = sum(int((b["labels"] != IGNORE).sum()) for b in data)
    out = None
    for batch in data:
        model.zero_grad()
        loss_sum, _ = token_loss(model, batch)
        (loss_sum / total).backward()
        grads = [p.grad.double() for p in model.parameters()]
        out = grads if out is None else [a + b for a, b in zip(out, grads, strict=True)]
    return out


def max_rel_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """max over parameters of |got - want| / |want| (Frobenius norms, in float64)."""
    errs = []
    for a, b in zip(got, want, strict=True):
        a, b = a.double(), b.double()
        errs.append(((a - b).norm() / b.norm().clamp(min=1e-30)).item())
    return max(errs)


class GradRecorder(torch.optim.Optimizer):
    """An optimizer whose step only records the gradients it was given."""

    def __init__(self, params):
        super().__init__(params, {"lr": 0.0})
        self.seen: list[list[torch.Tensor]] = []

    @torch.no_grad()
    def step(self, closure=None):
        self.seen.append([p.grad.detach().clone() for g in self.param_groups for p in g["params"]])
