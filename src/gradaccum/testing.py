"""References that check accumulation without the code under test, and N ranks on one CPU.

Two kinds of helper, public so that the project's tests, `gradaccum verify --world-size` and
the benchmarks share one copy, and so that users can check their own setups the same way:

- the big-batch reference and the relative error (`gradaccum.verification.reference`;
  docs/design.md, "Numerical rules"): every micro-batch padded to one length, stacked into one
  batch, one forward and one backward of the summed token loss divided by the valid-token
  count, in any dtype float64 included (`big_batch_grads`), or the per-micro-batch gradients
  summed exactly in float64 (`exact_fp64_sum`); `max_rel_error`, the largest per-parameter
  relative error; and how far two AdamW runs whose gradients agree only to rounding can drift
  apart (`adamw_drift_bound`). `token_loss` is `gradaccum.models.loss.causal_lm_loss` (labels
  aligned with the logits) under the name the tests use;
- the distributed harness: `run_ranks` (`gradaccum.verification.ranks`) starts N processes
  joined by gloo on CPU, the way torchrun starts them on one node, none outliving its parent;
  `check_equivalence` (`gradaccum.verification.equivalence`) runs accumulation under DDP or
  FSDP2 on them and compares each window, from the same parameters, with one process taking
  it as one batch.

The model is always passed in (a picklable factory `seed -> module` for the harness): this
module builds none of its own.
"""

from __future__ import annotations

from gradaccum.models.loss import IGNORE_INDEX
from gradaccum.models.loss import causal_lm_loss as token_loss
from gradaccum.verification.equivalence import (
    WRAPPERS,
    EquivalenceReport,
    EquivalenceSetup,
    check_equivalence,
    check_equivalences,
    compare,
    rank_batches,
    replay_adamw,
    run_check_rank,
    run_check_ranks,
    single_process_run,
    step_errors,
    step_tolerance,
    wrap,
)
from gradaccum.verification.ranks import check_world_size, free_port, rank_capacity, run_ranks
from gradaccum.verification.reference import (
    GradRecorder,
    adam_ratio_bound,
    adamw,
    adamw_drift_bound,
    big_batch,
    big_batch_grads,
    exact_fp64_sum,
    full,
    max_rel_error,
    ragged_batches,
    record_grads,
    valid_tokens,
    whole_rel_error,
)

__all__ = [
    "IGNORE_INDEX",
    "WRAPPERS",
    "EquivalenceReport",
    "EquivalenceSetup",
    "GradRecorder",
    "adam_ratio_bound",
    "adamw",
    "adamw_drift_bound",
    "big_batch",
    "big_batch_grads",
    "check_equivalence",
    "check_equivalences",
    "check_world_size",
    "compare",
    "exact_fp64_sum",
    "free_port",
    "full",
    "max_rel_error",
    "ragged_batches",
    "rank_batches",
    "rank_capacity",
    "record_grads",
    "replay_adamw",
    "run_check_rank",
    "run_check_ranks",
    "run_ranks",
    "single_process_run",
    "step_errors",
    "step_tolerance",
    "token_loss",
    "valid_tokens",
    "whole_rel_error",
    "wrap",
]
