"""A mixture of experts' load-balancing loss under accumulation: settings component (no
torch)."""

from __future__ import annotations

from dataclasses import dataclass

from gradaccum.settings.field import setting
from gradaccum.utils.choices import MOE_BALANCES


@dataclass
class MoESettings:
    """mixture of experts"""

    moe_balance: str | None = setting(
        None, "choice", choices=MOE_BALANCES, metavar="MODE", default_text="global for an MoE model"
    )
    """The load-balancing loss per micro-batch (micro), over the whole window from a routing
    pass (global, exact), or with the previous window's token fractions (global-previous, no
    extra pass)."""
