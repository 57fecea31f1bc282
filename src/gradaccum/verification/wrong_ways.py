"""The usual mistakes of gradient accumulation, run by `verify` on the same data through the same
engine (`WRONG_WAYS`), each measured by its largest relative error against the big batch's
gradient, or for a step after every micro-batch, against the big batch's step."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch

from gradaccum.verification.reference import (
    Grads,
    Reference,
    big_batch_reference,
    concat_batches,
    engine_grads,
    max_rel_error,
    trainable,
)

WRONG_WAYS = {
    "mean_over_k": "each micro-batch's mean loss divided by k",
    "no_division": "each micro-batch's mean loss, not divided",
    "step_every_micro_batch": "an optimizer step after every micro-batch (error of the update)",
    "short_window_over_k": "a short last window (k/2 micro-batches), each mean divided by k",
    "bf16_accumulation": "bf16 parameters, gradients summed in bf16",
}


@dataclass
class WrongWayInputs:
    """What every mistake runs on: verify's own data, loss and engine options, and the big
    batch's gradient and step it is measured against."""

    model: torch.nn.Module
    micro_batches: list
    loss_fn: Callable
    seed: int
    count_tokens: Callable | str | None
    ref: Reference
    concat: Callable | None
    make_optimizer: Callable
    ref_after: torch.nn.Module
    exact: torch.nn.Module
    """What the big batches run on: `model`, or verify's `reference_model`."""


def measure_wrong_ways(c: WrongWayInputs, big_batch) -> dict[str, float | None]:
    """Each mistake's largest relative error against the big batch's gradient."""
    k = len(c.micro_batches)
    run = {"seed": c.seed, "count_tokens": c.count_tokens}
    out: dict[str, float | None] = {}

    def scaled(model, batch):  # the mean of each micro-batch, not divided by k
        loss_sum, n = c.loss_fn(model, batch)
        return loss_sum * k, n

    out["mean_over_k"] = _try(
        lambda: engine_grads(
            c.model, [c.micro_batches], c.loss_fn, normalize="micro_batch_mean", **run
        )
    )
    out["no_division"] = _try(
        lambda: engine_grads(
            c.model, [c.micro_batches], scaled, normalize="micro_batch_mean", **run
        )
    )
    out = {name: _error(result, c.ref.grads) for name, result in out.items()}
    out["step_every_micro_batch"] = _step_every(c)
    out["short_window_over_k"] = _short_window(c) if k >= 2 and big_batch is None else None
    # torch's cast, not a subclass's: transformers refuses .to(dtype) for a model it loaded
    # with a quantised base, whose packed integer weights torch's cast leaves as they are
    bf16 = torch.nn.Module.to(copy.deepcopy(c.model), torch.bfloat16)
    out["bf16_accumulation"] = _error(
        _try(
            lambda: engine_grads(
                bf16,
                [c.micro_batches],
                c.loss_fn,
                precision="bf16",
                accum_dtype=torch.bfloat16,
                **run,
            )
        ),
        c.ref.grads,
    )
    return out


def _step_every(c: WrongWayInputs) -> float | None:
    """k optimizer steps of one micro-batch each: the parameters' change against the big
    batch's one step (the gradients alone would hide that the optimizer moved k times)."""
    result = _try(
        lambda: engine_grads(
            c.model,
            [[b] for b in c.micro_batches],
            c.loss_fn,
            c.make_optimizer,
            seed=c.seed,
            count_tokens=c.count_tokens,
        )
    )
    if result is None:
        return None
    before = [p.detach().double() for _, p in trainable(c.model)]
    moved = [
        p.detach().double() - b for (_, p), b in zip(trainable(result[1]), before, strict=True)
    ]
    want = [
        p.detach().double() - b for (_, p), b in zip(trainable(c.ref_after), before, strict=True)
    ]
    return max_rel_error(moved, want)


def _short_window(c: WrongWayInputs) -> float | None:
    """The last window holds k/2 micro-batches and each one's mean is still divided by k
    (what a loop that divides by its configured k does): the engine divides each mean by
    the k/2 it ran, and the loss here is scaled by (k/2)/k to make that a division by k."""
    k = len(c.micro_batches)
    short = c.micro_batches[: k // 2]
    ref = big_batch_reference(c.exact, (c.concat or concat_batches)(short), c.loss_fn, c.seed)

    def over_k(model, batch):
        loss_sum, n = c.loss_fn(model, batch)
        return loss_sum * len(short) / k, n

    result = _try(
        lambda: engine_grads(
            c.model,
            [short],
            over_k,
            seed=c.seed,
            count_tokens=c.count_tokens,
            normalize="micro_batch_mean",
        )
    )
    return _error(result, ref.grads)


def _try(run: Callable):
    try:
        return run()
    except (RuntimeError, TypeError, ValueError):  # a model that cannot run this way
        return None


def _error(result, want: Grads) -> float | None:
    if result is None:
        return None
    got, _ = result
    return max_rel_error(got, want)
