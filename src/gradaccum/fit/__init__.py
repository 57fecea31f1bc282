"""The micro-batch that fits and is fastest here, with the global batch held by k.

- `probe`: runs forward, backward and the optimizer step at growing sizes, counting memory and
  timing them (`find_micro_batch`, `measure_step`);
- `search`: which sizes to probe and time, and the choice among them (no torch);
- `report`: the table and the lines that explain the choice.
"""

from .probe import (
    Candidate,
    FitResult,
    MemoryUse,
    NothingFits,
    find_micro_batch,
    measure_step,
    out_of_memory_errors,
    set_checkpointing,
)
from .report import choice_notes, render_table
from .search import BATCH_TOLERANCE, choose, largest_fitting, to_time

__all__ = [
    "BATCH_TOLERANCE",
    "Candidate",
    "FitResult",
    "MemoryUse",
    "NothingFits",
    "choice_notes",
    "choose",
    "find_micro_batch",
    "largest_fitting",
    "measure_step",
    "out_of_memory_errors",
    "render_table",
    "set_checkpointing",
    "to_time",
]
