"""`gradaccum verify --task grpo --world-size N`: the window's groups dealt to N gloo ranks as
`gradaccum train` deals them (prompt j's group to rank j mod N, so a group never spans ranks),
each rank's completions in micro-batches of at most --micro-batch, the window through
`Accumulator` under DDP (the count all-reduced over the ranks before the first backward, one
gradient all-reduce per window), rank 0's gradient against the same float64 big batch as the
one-process check."""

from __future__ import annotations

import copy
from dataclasses import replace
from functools import partial

import torch

from gradaccum import rl
from gradaccum.engine.accumulator import Accumulator
from gradaccum.verification.grpo import GRPOWindow
from gradaccum.verification.ranks import run_ranks
from gradaccum.verification.reference import seeded, trainable

__all__ = ["rank_micro_batches", "ranks_grads"]

TIMEOUT_S = 600.0
"""Seconds the ranks may take for every loss type's window."""


def rank_micro_batches(window: GRPOWindow, world: int, micro_batch: int) -> list[list[dict]]:
    """Each rank's micro-batches: group j (completions j G .. j G + G - 1) on rank j mod
    `world`, its completions in order, cut every `micro_batch`."""
    G, total = window.num_generations, len(window.lengths)
    out = []
    for rank in range(world):
        rows = [i for i in range(total) if (i // G) % world == rank]
        sizes = [micro_batch] * (len(rows) // micro_batch)
        sizes += [len(rows) % micro_batch] if len(rows) % micro_batch else []
        out.append(replace(window, sizes=sizes).micro_batches(rows))
    return out


def ranks_grads(model, window: GRPOWindow, world: int, micro_batch: int,
                loss_types: tuple[str, ...], objective: dict, options: dict,
                seed: int) -> dict[str, list]:  # fmt: skip
    """{loss type: rank 0's window gradient (float64)} of the window on `world` gloo ranks
    (`rank_micro_batches`); options: the Accumulator's (precision, master_weights)."""
    per_rank = rank_micro_batches(window, world, micro_batch)
    args = (model, per_rank, loss_types, objective, options, seed)
    return run_ranks(_rank_grads, world, args=args, timeout_s=TIMEOUT_S)[0]


def _rank_grads(info, model, per_rank, loss_types, objective, options, seed) -> dict | None:
    """On each rank: every loss type's window on a copy of `model` under DDP; rank 0 returns
    the gradients handed to the optimizer."""
    from torch.nn.parallel import DistributedDataParallel

    most = objective["max_completion_length"]
    got = {}
    for name in loss_types:
        local = copy.deepcopy(model)
        params = [p for _, p in trainable(local)]
        optimizer = torch.optim.SGD(params, lr=0.0)  # the parameters stay as they are
        handed: list = []
        optimizer.register_step_pre_hook(partial(_record, handed))
        acc = Accumulator(DistributedDataParallel(local), optimizer,
                          count_tokens=rl.counter(name, most), **options)  # fmt: skip
        loss_fn = rl.PolicyLoss(name, objective["epsilon"], objective["epsilon_high"],
                                objective["beta"], most, objective["temperature"])  # fmt: skip
        acc.step(per_rank[info.rank], seeded(loss_fn, seed))
        got[name] = handed
    return got if info.is_main else None


def _record(into: list, optimizer, args, kwargs) -> None:
    """The gradients the optimizer is handed, in float64, into `into` (a step pre-hook)."""
    into.extend(None if p.grad is None else p.grad.detach().double().clone()
                for group in optimizer.param_groups for p in group["params"])  # fmt: skip
