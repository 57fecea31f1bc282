"""What each micro-batch's backward multiplies its loss by (`backward_scale`), once per window:
the numerical rule of docs/design.md ("Numerical rules") as arithmetic, without torch."""

from __future__ import annotations


def backward_scale(
    normalize: str,
    tokens: float,
    micro_steps: int,
    world: int,
    wrapper_averages: bool,
    loss_scale: float = 1.0,
) -> float:
    """What each micro-batch's backward multiplies its loss by, for one window.

    normalize "tokens": the loss is the micro-batch's summed token loss and `tokens` is N, the
      window's valid tokens over all ranks: scale = world / N (docs/design.md, numerical rules).
    normalize "micro_batch_mean": the loss is the micro-batch's own mean, and the window's
      gradient is the mean over its `micro_steps` x `world` micro-batches.
    world: ranks in the data-parallel group. wrapper_averages: whether the sync divides the
      summed gradient by `world` (DDP, FSDP2), which the factor `world` undoes; the engine's
      own all-reduce (bf16/fp16 parameters under DDP) sums, so it needs none.
    loss_scale: the fp16 loss scale (1 otherwise); unscaled once at the window's end.
    """
    undo_average = world if wrapper_averages else 1
    if normalize == "tokens":
        return undo_average * loss_scale / max(tokens, 1)
    return undo_average * loss_scale / max(micro_steps * world, 1)
