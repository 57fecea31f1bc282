"""Mixture-of-experts models in a hand-written loop: the load-balancing loss weighted right
for the window, and balanced over the whole window (micro-batches and ranks) when asked.

    from gradaccum import Accumulator, moe
    acc = Accumulator(model, optimizer)
    balance = moe.Balance(model, "global")          # "micro" | "global" | "global-previous"
    result, stats = balance.step(acc, micro_batches)
    # result.loss: the token-mean cross-entropy; result.aux_loss: the balance term trained
    # stats.lbl: the window's load-balancing loss; stats.load, stats.max_load: expert load

With Hugging Face batches (labels unshifted, as `gradaccum.hf` takes them) pass
`shift=True`. The definitions and what each mode keeps exact are
`gradaccum.moe.balance`'s (docs/design.md, "Mixture of experts"); the router logits are
read by `gradaccum.moe.router` (the built-in GPT with n_expert > 0, and Hugging Face
Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE).
"""

from __future__ import annotations

from gradaccum.utils.choices import MOE_BALANCES
from gradaccum.utils.lazy import lazy_exports

# imported on first use: the package's settings module loads without torch
__getattr__ = lazy_exports(
    __name__,
    {
        "Balance": "balance",
        "BalanceStats": "balance",
        "MoESpec": "router",
        "moe_spec": "router",
    },
)

__all__ = ["MOE_BALANCES", "Balance", "BalanceStats", "MoESpec", "moe_spec"]
