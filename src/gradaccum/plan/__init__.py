"""The planner: batch arithmetic, memory, communication and cost of a run. Pure arithmetic,
no torch: `import gradaccum.plan` leaves torch unimported.

- `batch`: global batch = micro-batch x k x world, time, FLOPs, LR scaling (`make_plan`);
- `inputs`: what a plan is asked (`PlanInputs`), checked;
- `memory`: bytes per device, term by term; `communication`: gradient traffic per step;
- `presets`: model shapes by name; `sizes`: 4M / 4Mi / 262k / 80GB / 900ms parsing;
- `table`: the plan as a table for people.
"""

from ..utils.errors import BadInput
from .batch import (
    LR_RULES,
    MemoryReport,
    Plan,
    PlanInputs,
    accum_steps_for,
    make_plan,
    render_table,
)

PlanError = BadInput
"""The planner's name for the one bad-input type (gradaccum.utils.errors.BadInput)."""

__all__ = [
    "LR_RULES",
    "MemoryReport",
    "Plan",
    "PlanError",
    "PlanInputs",
    "accum_steps_for",
    "make_plan",
    "render_table",
]
