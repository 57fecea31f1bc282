"""--save-best: the checkpoint with the lowest eval loss so far.

Rank 0 evaluates; an evaluation with a lower eval loss than any before (strictly: a tie keeps
the earlier step) saves its step's checkpoint at once, a save step or not, and records it as
the best (`Outputs.save_best`). Pruning keeps it beside the newest --keep-checkpoints
(`checkpoint.save(best=)`) until a lower eval loss comes; the trainer state of every later
checkpoint names it, so a resumed run knows it (`restored`). At the end it is exported as
--out/best/ in the form of the final export (`Outputs.export_best`).

An eval loss is only compared with one measured on the same eval set: each best carries the
eval set's fingerprint (its task's `eval_fingerprint`), and a resume on another eval set (with
--allow-data-change) looks for the best anew.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass

import torch

from gradaccum.models import lora
from gradaccum.train import adapters
from gradaccum.train.rundir import checkpoint

BEST_FOLDER = "best"
"""The folder under --out of the best checkpoint's export."""
STATE_KEY = "best"
"""The best's entry in trainer.pt."""


@dataclass
class Best:
    """The checkpoint with the lowest eval loss so far; all None before the first."""

    step: int | None = None
    """Its optimizer step."""
    eval_loss: float | None = None
    """Its eval loss, nats per counted token."""
    eval_set: str | None = None
    """The fingerprint of the eval set the loss was measured on (the task's `eval_fingerprint`)."""

    def improved_by(self, eval_loss: float) -> bool:
        """Whether `eval_loss` is finite and lower than the best's (the first finite one is)."""
        if not math.isfinite(eval_loss):
            return False
        return self.eval_loss is None or eval_loss < self.eval_loss

    def folder(self, out: str) -> str | None:
        """Its checkpoint folder under `out` (None before the first best)."""
        if self.step is None:
            return None
        return os.path.join(out, checkpoint.CHECKPOINTS, f"step-{self.step:08d}")

    def state_dict(self) -> dict:
        return asdict(self)


def restored(config, step: int, eval_set: str, state: dict | None) -> tuple[Best, list[str]]:
    """The best a run resumed at `step` continues from (a checkpoint's `state`, None when it
    has none), and a line when the one recorded cannot be: measured on another eval set than
    the run's (`eval_set`, its task's fingerprint of it), or its folder gone (a resume that
    fell back past a newer best)."""
    if not config.save_best or not state or state.get("step") is None:
        return Best(), []
    best = Best(**state)
    was = f"the best checkpoint so far (step {best.step}, eval loss {best.eval_loss:.4f})"
    again = f"the best is looked for anew from step {step}"
    if best.eval_set != eval_set:
        return Best(), [f"{was} was measured on another eval set; {again}"]
    if not os.path.isdir(best.folder(config.out)):
        return Best(), [f"{was} is no longer in {checkpoint.CHECKPOINTS}/; {again}"]
    return best, []


def load_weights(model: torch.nn.Module, model_info, folder: str) -> None:
    """The weights of checkpoint `folder` into `model` (unwrapped): LoRA's adapters (the
    frozen base is the run's own), or the whole state_dict."""
    state = checkpoint.read_model_state(folder)  # model.pt, or a sharded run's shards whole
    if adapters.record_of(model_info) is not None:
        lora.load_adapter_state_dict(model, state)
    else:
        model.load_state_dict(state)
