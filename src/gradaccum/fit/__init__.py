"""The micro-batch that fits and is fastest here, with the global batch held by k.

- `probe`: runs forward, backward and the optimizer step at growing sizes, measuring memory and
  timing them (`find_micro_batch`, `measure_step`);
- `memory`: one step's memory by term, counted on CPU with saved-tensor hooks (`MemoryUse`);
- `search`: which sizes to probe and time, and the choice among them (no torch);
- `result`: each size tried and the choice (`Candidate`, `FitResult`, `NothingFits`);
- `report`: the table and the lines that explain the choice.
"""

from ..models.checkpointing import set_checkpointing
from .memory import MemoryUse
from .probe import find_micro_batch, measure_step
from .report import choice_notes, render_table
from .result import Candidate, FitResult, NothingFits
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
    "render_table",
    "set_checkpointing",
    "to_time",
]
