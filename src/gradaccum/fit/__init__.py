"""The micro-batch that fits and is fastest here, with the global batch held by k.

- `probe`: runs forward, backward and the optimizer step at growing sizes, measuring memory and
  timing them (`find_micro_batch`, `measure_step`);
- `memory`: one step's memory by term, counted on CPU with saved-tensor hooks (`MemoryUse`);
- `search`: which sizes to probe and time, and the choice among them (no torch);
- `target`: the global batch aimed at (`Target`) and how far the choice may stray from it;
- `result`: each size tried and the choice (`Candidate`, `FitResult`, `NothingFits`);
- `report`: the table and the lines that explain the choice.
"""

from gradaccum.utils.lazy import lazy_exports

# imported on first use: the package's settings module loads without torch
__getattr__ = lazy_exports(
    __name__,
    {
        "MemoryUse": "memory",
        "find_micro_batch": "probe",
        "measure_step": "probe",
        "choice_notes": "report",
        "render_table": "report",
        "Candidate": "result",
        "FitResult": "result",
        "NothingFits": "result",
        "BATCH_TOLERANCE": "target",
        "choose": "search",
        "largest_fitting": "search",
        "to_time": "search",
        "set_checkpointing": "gradaccum.models.checkpointing",
    },
)

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
