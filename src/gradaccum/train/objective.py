"""What a window's micro-batches are trained on: the task's summed loss and its count, or
that with a mixture of experts' load-balancing term (`gradaccum.train.moe.MoETraining`, the
same interface; it composes with the tasks whose loss is the next-token cross-entropy).
The loop calls `begin_window` once per window (its token count over ranks: the engine's one
collective), `backward` per micro-step, `end` with the window's result, `abandon` for a
window dropped."""

from __future__ import annotations

from collections.abc import Sequence

import torch


class TaskObjective:
    """The task's loss alone (`Task.loss`): the engine divides once by the window's count."""

    def __init__(self, task):
        self.task = task

    def begin_window(self, acc, model: torch.nn.Module, micro_batches: Sequence[dict]):
        return acc.begin_window(micro_batches)

    def backward(self, window, model: torch.nn.Module, micro: dict, weight: float) -> None:
        loss_sum, count = self.task.loss(model, micro, weight)
        window.backward(loss_sum, count, weight)  # world / N

    def end(self, result) -> None:
        pass

    def abandon(self) -> None:
        pass

    def record_fields(self) -> dict:
        return {}

    def progress(self) -> str | None:
        return None
