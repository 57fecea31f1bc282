"""The planner: batch arithmetic, memory, communication and cost of a run. Pure arithmetic,
no torch: `import gradaccum.plan` leaves torch unimported.

- `make`: the plan of a run (`make_plan`), from `batch` (global batch = micro-batch x k x
  world, the micro-batch that fits) and `costs` (memory, time, FLOPs, LR scaling);
- `inputs`: what a plan is asked (`PlanInputs`), checked; `result`: the `Plan` it gives;
- `memory`: bytes per device, term by term; `communication`: gradient traffic per step;
- `batch_schedule`, `schedule_plan`: a batch that grows with tokens seen, phase by phase;
- `presets`: model shapes by name (`MODEL_SHAPES`); `sizes`: 4M / 4Mi / 262k / 80GB / 900ms
  parsing and formatting;
- `table`: the plan as a table for people.
"""

from gradaccum.plan.batch import accum_steps_for
from gradaccum.plan.inputs import LR_RULES, PlanInputs
from gradaccum.plan.make import make_plan
from gradaccum.plan.result import MemoryReport, Plan
from gradaccum.plan.table import render_table
from gradaccum.utils.errors import BadInput

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
