"""The accumulation engine: one window of micro-batches, one optimizer step, exactly.

- `accumulator`: `Accumulator`, which runs windows on a model and its optimizer, and
  `windows`, which groups micro-batches into windows;
- `window`: one window in progress (`Window`) and what it reads of the engine that begins
  it (`WindowOwner`);
- `step_result`: what one window did (`StepResult`);
- `scale`: the backward scale each micro-batch carries (`backward_scale`), without torch;
- `grad_norm`: the window gradient's norm, FSDP2 shards included (`total_norm`);
- `loss_contract`: the checks of what `loss_fn` returns, in one-line errors;
- `grad_store`: where the window's gradient lives (fp32 buffers for 16-bit parameters, master
  weights) until the optimizer takes it;
- `precision`: autocast for a precision name and the fp16 loss scaler;
- `noise`: the gradient noise scale from the per-micro-batch gradients;
- `balance`: a mixture of experts' load-balancing loss weighted for the window (`Balance`,
  also `gradaccum.moe`); not imported here, it loads the models' router code.
"""

from gradaccum.utils.lazy import lazy_exports

# imported on first use: the package's settings module loads without torch
__getattr__ = lazy_exports(
    __name__,
    {
        "Accumulator": "accumulator",
        "LossFn": "accumulator",
        "count_labels": "accumulator",
        "windows": "accumulator",
        "StepResult": "step_result",
        "Window": "window",
        "backward_scale": "scale",
    },
)

__all__ = [
    "Accumulator",
    "LossFn",
    "StepResult",
    "Window",
    "backward_scale",
    "count_labels",
    "windows",
]
