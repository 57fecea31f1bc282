"""`Window.run`, the engine's one window loop, ended early by its `before_micro_step` hook
(the trainer's stop and out-of-memory agreement): the window is abandoned, nothing stepped or
counted, and the answer returned; the next window is exact (one process)."""

from __future__ import annotations

import torch

from gradaccum import Accumulator
from tests.reference import (
    GradRecorder,
    big_batch_grads,
    make_mlp,
    max_rel_error,
    ragged_batches,
    token_loss,
)


def test_a_window_ended_before_a_micro_step_is_abandoned_and_the_next_is_exact():
    model = make_mlp(seed=8)
    opt = GradRecorder(model.parameters())
    acc = Accumulator(model, opt, precision="fp16")
    scale, before = acc.scaler.scale, [p.detach().clone() for p in model.parameters()]
    data = ragged_batches("mlp", 7, seed=23)
    window = acc.begin_window(data[:4])
    asked: list[int] = []

    def forward_backward(batch, weight: float) -> None:
        window.backward(*token_loss(model, batch), weight)

    def stop_at_third(i: int) -> str | None:
        asked.append(i)
        return "stop" if i == 2 else None

    answer = window.run(data[:4], forward_backward, before_micro_step=stop_at_third)
    assert (answer, asked, window.state, window.micro_steps_run) == (
        "stop",
        [0, 1, 2],
        "abandoned",
        2,
    )
    assert all(p.grad is None for p in model.parameters())
    assert (acc.scaler.scale, acc.steps, acc.skipped_total, opt.seen) == (scale, 0, 0, [])
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    result = acc.step(data[4:], token_loss)  # the next window: begun freely, exact
    assert not result.skipped and (result.step, result.micro_steps) == (1, 3)
    assert max_rel_error(opt.seen[0], big_batch_grads(make_mlp(seed=8), data[4:])) <= 5e-2
