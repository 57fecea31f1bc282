"""The accumulation engine: one window of micro-batches, one optimizer step, exactly.

- `accumulator`: `Accumulator`, which runs windows on a model and its optimizer, and
  `windows`, which groups micro-batches into windows;
- `window`: one window in progress (`Window`), its result (`StepResult`) and the backward
  scale each micro-batch carries (`backward_scale`), with the checks of `loss_fn`'s contract;
- `grad_store`: where the window's gradient lives (fp32 buffers for 16-bit parameters, master
  weights) until the optimizer takes it;
- `precision`: the precisions, autocast and the fp16 loss scaler;
- `noise`: the gradient noise scale from the per-micro-batch gradients.
"""

from .accumulator import Accumulator, LossFn, count_labels, windows
from .window import StepResult, Window, backward_scale

__all__ = [
    "Accumulator",
    "LossFn",
    "StepResult",
    "Window",
    "backward_scale",
    "count_labels",
    "windows",
]
