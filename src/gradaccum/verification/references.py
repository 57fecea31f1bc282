"""References that check accumulation without the code under test.

Big-batch references (docs/design.md, "Numerical rules"): every micro-batch padded to one
length, stacked into one batch, one forward and one backward of the summed token loss divided
by the valid-token count, in any dtype float64 included (`big_batch_grads`), or the
per-micro-batch gradients summed exactly in float64 (`exact_fp64_sum`); the loss and the
ragged data the tests and the distributed check run; recorders of what an optimizer is handed.
Public through `gradaccum.testing`.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from .bigbatch import IGNORE_INDEX, concat_batches

# ---- the loss and the data ------------------------------------------------------------------


def token_loss(model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy summed over valid labels (not IGNORE_INDEX), and their count.

    `batch["input_ids"]` goes into the model; its output (or its `.logits`) is (b, T, classes)
    and `batch["labels"]` (b, T) is already aligned with it. Logits are upcast to at least fp32
    (float64 stays float64, so a float64 reference is float64 throughout).
    """
    out = model(batch["input_ids"])
    logits = out if isinstance(out, torch.Tensor) else out.logits
    if logits.dtype != torch.float64:
        logits = logits.float()
    labels = batch["labels"]
    loss = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]),
        labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
    return loss, (labels != IGNORE_INDEX).sum()


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
) -> list[dict]:
    """`count` micro-batches of `batch` rows whose valid tokens number 1..seq_len at random;
    the rest of each row is padding with label IGNORE_INDEX.

    kind "gpt": `input_ids` are token ids (b, seq_len) below `vocab`; any other kind: features
    (b, seq_len, d_in) in `dtype` with labels below `classes`.
    """
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
        out.append({"input_ids": ids, "labels": torch.where(valid, labels, IGNORE_INDEX)})
    return out


def valid_tokens(batches: Sequence[dict]) -> int:
    """Labels that are not IGNORE_INDEX, over all `batches`."""
    return sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in batches)


# ---- big-batch references ---------------------------------------------------------------------


def big_batch(micro_batches: Sequence[dict]) -> dict:
    """The micro-batches (dicts of tensors) stacked along the batch dimension; rows narrower
    than the widest are padded at the end (labels with IGNORE_INDEX, the rest with 0)."""
    return concat_batches(micro_batches, IGNORE_INDEX)


def big_batch_grads(
    model: torch.nn.Module,
    micro_batches: Sequence[dict],
    dtype: torch.dtype | None = None,
    loss_fn: Callable = token_loss,
) -> list[torch.Tensor]:
    """Gradients of (sum of token losses) / (valid tokens) over all micro-batches at once,
    on a copy of `model` (cast to `dtype` when given, floating inputs too)."""
    model = copy.deepcopy(model)
    if dtype is not None:
        model = model.to(dtype)
    batch = big_batch(micro_batches)
    if dtype is not None and batch["input_ids"].is_floating_point():
        batch = {**batch, "input_ids": batch["input_ids"].to(dtype)}
    loss_sum, n = loss_fn(model, batch)
    (loss_sum / n).backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def exact_fp64_sum(
    model: torch.nn.Module, micro_batches: Sequence[dict], loss_fn: Callable = token_loss
) -> list[torch.Tensor]:
    """The window gradient as exact accumulation would give it: each micro-batch's own
    gradient (in the model's dtype) of loss_sum / N, summed in float64."""
    model = copy.deepcopy(model)
    total = valid_tokens(micro_batches)
    out = None
    for batch in micro_batches:
        model.zero_grad()
        loss_sum, _ = loss_fn(model, batch)
        (loss_sum / total).backward()
        grads = [p.grad.double() for p in model.parameters()]
        out = grads if out is None else [a + b for a, b in zip(out, grads, strict=True)]
    return out


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """|got - want| / |want| (Frobenius norms, in float64)."""
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm().clamp(min=1e-30)).item()


def max_rel_error(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor]) -> float:
    """max over parameters of |got - want| / |want| (Frobenius norms, in float64)."""
    return max(rel_error(a, b) for a, b in zip(got, want, strict=True))


class GradRecorder(torch.optim.Optimizer):
    """An optimizer whose step only records the gradients it was given (parameters stay)."""

    def __init__(self, params):
        super().__init__(params, {"lr": 0.0})
        self.seen: list[list[torch.Tensor | None]] = []

    @torch.no_grad()
    def step(self, closure=None):
        self.seen.append(
            [
                None if p.grad is None else full(p.grad).detach().clone()
                for g in self.param_groups
                for p in g["params"]
            ]
        )


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of an FSDP2 shard (a DTensor); any other tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def record_grads(optimizer: torch.optim.Optimizer) -> list[list[torch.Tensor]]:
    """The gradients `optimizer` is handed at each step, whole tensors under FSDP2 (a list
    that grows by one entry per step)."""
    seen: list[list[torch.Tensor]] = []

    def hook(opt, args, kwargs):
        params = [p for g in opt.param_groups for p in g["params"]]
        seen.append(
            [None if p.grad is None else full(p.grad).detach().cpu().clone() for p in params]
        )

    optimizer.register_step_pre_hook(hook)
    return seen


def adamw(params) -> torch.optim.Optimizer:
    """The optimizer the equivalence checks step: AdamW, lr 1e-2, weight decay 0.1."""
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


# ---- what AdamW can do with gradients that agree only to rounding ----------------------------


def adam_ratio_bound(step: int, betas: tuple[float, float] = (0.9, 0.999)) -> float:
    """The largest |m_hat| / sqrt(v_hat) Adam can reach at `step` (1, 2, ...), whatever the
    gradients: the most one step moves a weight, in units of the learning rate.

    m_hat = (1-b1) sum_s b1^(t-s) g_s / (1-b1^t), v_hat = (1-b2) sum_s b2^(t-s) g_s^2 /
    (1-b2^t); by Cauchy-Schwarz over the t gradients of one element, |m_hat| / sqrt(v_hat) <=
    (1-b1)/(1-b1^t) * sqrt((1-b2^t)/(1-b2)) * sqrt(sum_{j<t} (b1^2/b2)^j). It is 1 at step 1,
    1.004 at step 3 with betas (0.9, 0.999), 1.002 at step 4 with (0.9, 0.95), and grows
    towards (1-b1) / sqrt((1-b2)(1-b1^2/b2)) (7.3 with (0.9, 0.999)) over many steps.
    """
    b1, b2 = betas
    if step < 1:
        raise ValueError(f"step {step}: must be at least 1")
    ratio = b1 * b1 / b2
    series = step if ratio == 1 else (1 - ratio**step) / (1 - ratio)
    return (1 - b1) / (1 - b1**step) * math.sqrt((1 - b2**step) / (1 - b2) * series)


def adamw_drift_bound(
    lrs: Sequence[float], betas: tuple[float, float] = (0.9, 0.999), first_step: int = 1
) -> float:
    """The most one weight can differ between two AdamW runs from the same weights and
    optimizer state after steps at learning rates `lrs`, the first of them AdamW's step
    `first_step` (1 for a fresh optimizer), whatever their gradients.

    Each step moves a weight by lr_t * (m_hat / (sqrt(v_hat) + eps) + wd * w), and
    |m_hat| / sqrt(v_hat) <= adam_ratio_bound(t); decoupled weight decay multiplies both runs'
    difference by the same (1 - lr_t * wd) < 1, which only shrinks it. So
    |w_a - w_b| <= sum_t 2 * lr_t * adam_ratio_bound(t, betas), about 2 lr x steps (plus the
    rounding of the weights themselves, a few ulps of |w| per step).

    Why tests need it: Adam divides each gradient element by the root of its own second
    moment, so an element whose gradient is zero up to rounding (an attention key bias, any
    element whose contributions nearly cancel) steps by up to lr in a direction set by its
    last bits, and two runs whose gradients agree to rounding reach this bound in such
    weights. Compare gradients and losses tightly, from the same weights; weights after Adam
    steps only within this bound, which catches a run that steps more often, at a larger
    learning rate, or with another update rule.
    """
    steps = enumerate(lrs, start=first_step)
    return sum(2 * lr * adam_ratio_bound(t, betas) for t, lr in steps)
