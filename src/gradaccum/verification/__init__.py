"""Proof on the user's own model that accumulation equals the big batch.

- `check`: `verify`, one window through the engine against the same data as one batch, with
  the mistakes it demonstrates and what breaks equivalence;
- `report`: what `verify` found (`VerifyReport`) and the verdict over the checks;
- `wrong_ways`: the usual mistakes, run on the same data through the same engine;
- `reference`: the float64 big-batch reference, the window through the engine beside it, the
  one relative-error measure, and the bounds of AdamW's drift;
- `lint`: what in a model or loss breaks equivalence (batch statistics, dropout RNG, means);
- `precision_study`: the error of accumulating in each precision as k grows;
- `qlora`: LoRA adapters on the model, a quantised base (--base-bits) checked against its
  dequantised copy in float64, and the quantisation error reported apart;
- `ranks` and `equivalence`: N gloo ranks on CPU (DDP, FSDP2) against one process taking the
  whole batch (`gradaccum.testing` re-exports them); `world_setup`: what they run
  (`EquivalenceSetup`); `traffic`: the gradient bytes counted against the planner's.
"""

from gradaccum.utils.lazy import lazy_exports

# imported on first use: the package's settings module loads without torch
__getattr__ = lazy_exports(
    __name__,
    {
        "VerifyReport": "report",
        "verify": "check",
    },
)

__all__ = ["VerifyReport", "verify"]
