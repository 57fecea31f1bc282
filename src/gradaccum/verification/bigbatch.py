"""The big batch and the window side by side: one batch formed from the micro-batches, its
gradient without the engine (float64 where the model runs in it), the window's gradient
through `Accumulator`, and the per-parameter relative errors between them.

`verify` and the precision study are built from these (docs/design.md, "Verify").
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from ..engine.accumulator import Accumulator
from ..utils.errors import BadInput

IGNORE_INDEX = -100

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


def reference_grads(
    model: torch.nn.Module, whole, loss_fn: Callable, seed: int = 0, float64: bool = True
) -> Reference:
    """Gradient of loss_sum / tokens over the big batch `whole`, on a copy of `model`: in
    float64 when the model runs in it (and `float64`), else in float32."""
    dtypes = (torch.float64, torch.float32) if float64 else (torch.float32,)
    for dtype in dtypes:
        ref = copy.deepcopy(model).to(dtype)
        try:
            loss_sum, n = seeded(loss_fn, seed)(ref, cast_floats(whole, dtype))
            (loss_sum / n).backward()
        except (RuntimeError, TypeError):
            if dtype == dtypes[-1]:
                raise
            continue
        grads = [None if p.grad is None else p.grad.detach().clone() for _, p in trainable(ref)]
        return Reference(grads, loss_sum.item(), int(n), dtype)
    raise AssertionError("unreachable")


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


def rel_errors(got: Grads, want: Grads) -> list[float]:
    """Per parameter |got - want| / |want|; a parameter whose big-batch gradient is zero up to
    rounding (below 1e-7 of the whole gradient's norm) is measured against that floor."""
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
    """The largest of `rel_errors`."""
    return max(rel_errors(got, want), default=0.0)


def dense(t, other) -> torch.Tensor:
    return torch.zeros_like(other, dtype=torch.float64) if t is None else t.double()


def grad_norm(grads: Grads) -> float:
    return math.sqrt(sum(float(g.double().square().sum()) for g in grads if g is not None))
