"""The ground truth accumulation is checked against, computed without the code under test,
and the one measure of how far a gradient is from it.

- The big batch (docs/design.md, "Numerical rules"): the micro-batches stacked into one
  batch, padded where their lengths differ (`concat_batches`, `big_batch`); its gradient of
  loss_sum / valid tokens, one forward and one backward on a copy of the model, in float64
  where the model runs in it (`big_batch_reference`; `big_batch_grads` for the tests' form).
  Or each micro-batch's gradient summed exactly in float64 (`exact_fp64_sum`).
- The window through `Accumulator` on a copy of the model (`engine_grads`): the gradient it
  hands the optimizer.
- The relative error (`rel_errors`, `max_rel_error`): per parameter ||g - w|| / ||w|| in
  float64 (Frobenius norms), w the reference; a parameter whose reference gradient is zero up
  to rounding (its norm below 1e-7 of the whole gradient's) is measured against that floor
  instead, since there rounding alone makes any ratio. `whole_rel_error` is the same measure
  with every parameter as one vector: the error of the whole update.
- Recorders of what an optimizer is handed, ragged data, and how far two AdamW runs whose
  gradients agree only to rounding can drift apart (`adamw_drift_bound`).

Public through `gradaccum.testing`.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from gradaccum.engine.accumulator import Accumulator
from gradaccum.models.loss import IGNORE_INDEX, causal_lm_loss
from gradaccum.models.optimizer import adamw as make_adamw
from gradaccum.utils.errors import BadInput

Grads = list["torch.Tensor | None"]

# ---- the big batch --------------------------------------------------------------------------


def concat_batches(micro_batches: Sequence, ignore_index: int = IGNORE_INDEX):
    """The micro-batches as one batch: tensors stacked along dim 0, padded along dim 1 where
    their lengths differ (labels with `ignore_index`, everything else with 0).

    Knows dicts of tensors, tuples/lists of tensors (element 1 taken for labels) and tensors;
    anything else raises BadInput saying to pass `big_batch=` or `concat=`.
    """
    first = micro_batches[0]
    if isinstance(first, torch.Tensor):
        return _cat(list(micro_batches), 0)
    if isinstance(first, Mapping):
        return {
            key: _cat([b[key] for b in micro_batches], ignore_index if key == "labels" else 0)
            for key in first
        }
    if isinstance(first, (tuple, list)):
        return type(first)(
            _cat([b[i] for b in micro_batches], ignore_index if i == 1 else 0)
            for i in range(len(first))
        )
    raise _cannot_concat(type(first).__name__)


def big_batch(micro_batches: Sequence[dict]) -> dict:
    """The micro-batches (dicts of tensors) stacked along the batch dimension; rows narrower
    than the widest are padded at the end (labels with IGNORE_INDEX, the rest with 0)."""
    return concat_batches(micro_batches, IGNORE_INDEX)


def _cannot_concat(what: str) -> BadInput:
    return BadInput(
        "micro_batches",
        what,
        "cannot be concatenated into one big batch: pass big_batch= (the whole batch) or "
        "concat= (a function from the list of micro-batches to one batch)",
    )


def _cat(parts: list, pad) -> torch.Tensor:
    if not all(isinstance(t, torch.Tensor) for t in parts):
        raise _cannot_concat(
            type(next(t for t in parts if not isinstance(t, torch.Tensor))).__name__
        )
    if parts[0].dim() < 2 or len({t.shape[1] for t in parts}) == 1:
        try:
            return torch.cat(parts)
        except RuntimeError:
            raise _cannot_concat(f"tensors of shapes {[tuple(t.shape) for t in parts]}") from None
    if len({(t.dim(), *t.shape[2:]) for t in parts}) != 1:
        raise _cannot_concat(f"tensors of shapes {[tuple(t.shape) for t in parts]}")
    width = max(t.shape[1] for t in parts)
    out = []
    for t in parts:
        padded = t.new_full((t.shape[0], width, *t.shape[2:]), pad)
        padded[:, : t.shape[1]] = t
        out.append(padded)
    return torch.cat(out)


def cast_floats(batch, dtype: torch.dtype):
    """`batch` with its floating tensors in `dtype` (token ids and labels stay as they are)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(dtype) if batch.is_floating_point() else batch
    if isinstance(batch, Mapping):
        return {key: cast_floats(value, dtype) for key, value in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(cast_floats(value, dtype) for value in batch)
    return batch


# ---- gradients, with and without the engine ---------------------------------------------------


def seeded(loss_fn: Callable, seed: int) -> Callable:
    """`loss_fn` with the random generators seeded before every call (the same draws for
    every micro-batch, the big batch included)."""

    def call(model, batch):
        torch.manual_seed(seed)
        return loss_fn(model, batch)

    return call


def trainable(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """(name, parameter) of every parameter that requires grad, in the model's order (the
    order `Accumulator` and the optimizers see them in)."""
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


@dataclass
class Reference:
    """The big batch's gradient."""

    grads: Grads
    """Per trainable parameter (None where it got no gradient), in the reference dtype."""
    loss_sum: float
    """The summed loss over the big batch."""
    tokens: int
    """Valid tokens loss_fn counted in it."""
    dtype: torch.dtype
    """What the big batch ran in."""


def big_batch_reference(
    model: torch.nn.Module,
    whole,
    loss_fn: Callable = causal_lm_loss,
    seed: int | None = 0,
    dtypes: Sequence[torch.dtype | None] = (torch.float64, torch.float32),
) -> Reference:
    """The gradient of loss_sum / tokens over the big batch `whole` (one forward, one
    backward), on a copy of `model`: in the first of `dtypes` the model runs in, its floating
    inputs cast alike (None: the model's own dtype, the batch as it is). The model passed in
    is not changed. seed: torch's generator seeded before the forward (the draws each
    micro-batch gets in `engine_grads`); None leaves it alone."""
    loss = loss_fn if seed is None else seeded(loss_fn, seed)
    for i, dtype in enumerate(dtypes):
        ref = copy.deepcopy(model)
        batch = whole
        if dtype is not None:
            ref, batch = ref.to(dtype), cast_floats(whole, dtype)
        try:
            loss_sum, n = loss(ref, batch)
            (loss_sum / n).backward()
        except (RuntimeError, TypeError):  # a model that cannot run in this dtype
            if i == len(dtypes) - 1:
                raise
            continue
        grads = [None if p.grad is None else p.grad.detach().clone() for _, p in trainable(ref)]
        ran = dtype or next((p.dtype for p in ref.parameters() if p.is_floating_point()), None)
        return Reference(grads, loss_sum.item(), int(n), ran or torch.float32)
    raise ValueError("big_batch_reference: no dtypes to run in")


def big_batch_grads(
    model: torch.nn.Module,
    micro_batches: Sequence[dict],
    dtype: torch.dtype | None = None,
    loss_fn: Callable = causal_lm_loss,
) -> Grads:
    """`big_batch_reference`'s gradients for the micro-batches stacked (`big_batch`), in
    `dtype` (None: the model's own), no seeding: the form the tests compare with."""
    return big_batch_reference(model, big_batch(micro_batches), loss_fn, None, (dtype,)).grads


def engine_grads(
    model: torch.nn.Module,
    windows: Sequence[Sequence],
    loss_fn: Callable,
    make_optimizer: Callable | None = None,
    seed: int = 0,
    **options,
) -> tuple[Grads, torch.nn.Module]:
    """Run `windows` through an `Accumulator` built with `options` on a copy of `model`.

    Returns the gradient handed to the optimizer, summed in float64 over the windows' steps
    (what plain SGD would move by), and the copy after its steps. `make_optimizer(params)`
    builds the optimizer (default: SGD with lr 0, which leaves the parameters as they are).
    """
    model = copy.deepcopy(model)
    params = [p for _, p in trainable(model)]
    optimizer = (make_optimizer or _still)(params)
    total: Grads = [None] * len(params)

    def record(opt, args, kwargs):
        handed = [p for group in opt.param_groups for p in group["params"]]
        for i, p in enumerate(handed):
            if p.grad is not None:
                g = p.grad.detach().double()
                total[i] = g.clone() if total[i] is None else total[i] + g

    optimizer.register_step_pre_hook(record)
    acc = Accumulator(model, optimizer, **options)
    loss = seeded(loss_fn, seed)
    for window in windows:
        acc.step(window, loss)
    return total, model


def _still(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.0)


def exact_fp64_sum(
    model: torch.nn.Module, micro_batches: Sequence[dict], loss_fn: Callable = causal_lm_loss
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


# ---- the relative error -----------------------------------------------------------------------


@torch.no_grad()
def rel_errors(got: Grads, want: Grads) -> list[float]:
    """Per parameter ||got - want|| / ||want|| in float64 (Frobenius norms; None: zeros where
    the other side has a tensor). A parameter whose reference is zero up to rounding (below
    1e-7 of the whole reference's norm) is measured against that floor instead."""
    floor = 1e-7 * grad_norm(want)
    out = []
    for g, w in zip(got, want, strict=True):
        if g is None and w is None:
            out.append(0.0)
            continue
        g, w = dense(g, w), dense(w, g)
        out.append(((g - w).norm() / max(w.norm().item(), floor, 1e-30)).item())
    return out


def max_rel_error(got: Grads, want: Grads) -> float:
    """The relative error of `got` against the reference `want`: the largest of `rel_errors`
    over the parameters (0 for none)."""
    return max(rel_errors(got, want), default=0.0)


@torch.no_grad()
def whole_rel_error(got: Grads, want: Grads) -> float:
    """`max_rel_error` with every parameter's tensor as one vector: ||got - want|| / ||want||
    over the whole gradient (or update), where `max_rel_error` is its worst parameter's."""
    pairs = [(g, w) for g, w in zip(got, want, strict=True) if g is not None or w is not None]
    if not pairs:
        return 0.0
    flat_got = torch.cat([dense(g, w).flatten() for g, w in pairs])
    flat_want = torch.cat([dense(w, g).flatten() for g, w in pairs])
    return max_rel_error([flat_got], [flat_want])


def dense(t, other) -> torch.Tensor:
    """`t` in float64, or zeros shaped like `other` where `t` is None."""
    return torch.zeros_like(other, dtype=torch.float64) if t is None else t.double()


def grad_norm(grads: Grads) -> float:
    """The norm of every tensor of `grads` as one vector (None counted as zeros)."""
    return math.sqrt(sum(float(g.double().square().sum()) for g in grads if g is not None))


# ---- ragged data, and what an optimizer is handed -----------------------------------------------


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


# ---- what AdamW can do with gradients that agree only to rounding ----------------------------


def adamw(params) -> torch.optim.Optimizer:
    """The optimizer the equivalence checks step: AdamW, lr 1e-2, weight decay 0.1."""
    return make_adamw(params, lr=1e-2, weight_decay=0.1)


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
