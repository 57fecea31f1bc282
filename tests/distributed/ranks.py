"""What the distributed tests share: per-rank ragged data, the global windows it forms, and
the single-process reference that takes each global window as one batch (no engine), at the
ranks' parameters of that window; a rank's engine over DDP whose optimizer only records.

The process harness and the gradient recorders are `gradaccum.testing`'s, re-exported here.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch.nn.parallel import DistributedDataParallel

from gradaccum import Accumulator
from gradaccum.testing import (  # noqa: F401 - re-exported for the tests
    GradRecorder,
    adamw,
    full,
    record_grads,
    replay_adamw,
    run_ranks,
    step_errors,
    step_tolerance,
    valid_tokens,
)
from tests.reference import big_batch, big_batch_grads, make_gpt, ragged_batches, token_loss

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


def same_weights_reference(counts: tuple[int, ...], before: list[list[torch.Tensor]]) -> dict:
    """One process, one batch per global window of ranks holding `counts` micro-batches, each
    window at the parameters the ranks held before it (`before`, in the model's order): the
    big-batch gradient and the loss per token, no engine.

    Each window from the ranks' own parameters, not along a trajectory of its own: AdamW
    divides by the root of each element's second moment, so a gradient element that is zero
    up to rounding (an attention key bias, which softmax cancels) steps by up to lr either way
    on its last bits, and two trajectories that agree on every gradient to rounding part by
    about 2 lr per step (`gradaccum.testing.adamw_drift_bound`)."""
    model = make_gpt()
    grads, losses = [], []
    for window, start in zip(global_windows(counts), before, strict=True):
        with torch.no_grad():
            for p, value in zip(model.parameters(), start, strict=True):
                p.copy_(value)
            loss_sum, n = token_loss(model, big_batch(window))
        losses.append(loss_sum.item() / n.item())
        grads.append(big_batch_grads(model, window))
    return {"grads": grads, "losses": losses}


def ddp_recording_engine(model: torch.nn.Module, **engine) -> tuple[Accumulator, GradRecorder]:
    """This rank's engine (`engine`: Accumulator's keywords) over `model` under DDP, with an
    optimizer that records the gradient each window hands it (`.seen`) and leaves the weights
    as they are: every window is taken at the same parameters."""
    ddp = DistributedDataParallel(model)
    opt = GradRecorder(ddp.parameters())
    return Accumulator(ddp, opt, **engine), opt


def assert_steps_are_adamw(got: dict) -> None:
    """The ranks' parameters after each window are one AdamW step (`adamw`) from their
    parameters before it with the gradient they handed over: within the fp32 rounding of
    AdamW's update, against the same step in float64 (`gradaccum.testing.step_tolerance`)."""
    before, last = got["before"], list(got["params"].values())
    replayed = replay_adamw(before, got["grads"])
    settings = adamw([torch.zeros(1, requires_grad=True)]).defaults
    tolerance = step_tolerance(len(before), settings["lr"], settings["betas"], torch.float32)
    assert step_errors(before, last, replayed) <= tolerance


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


def refusal(build) -> str:
    """The ValueError's text where `build()` refuses, else "accepted"."""
    try:
        build()
    except ValueError as err:
        return str(err)
    return "accepted"
