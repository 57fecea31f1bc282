"""What `verify` found (`VerifyReport`, with a `ParamError` per parameter), and the verdict over
the checks that decide it (`check_row`, `verdict`), which the other checks of `gradaccum verify`
(--world-size, --task grpo) are held to alike."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from gradaccum.utils.jsonable import finite

if TYPE_CHECKING:
    from gradaccum.verification.lint import Finding
    from gradaccum.verification.moe_check import MoEReport


@dataclass
class ParamError:
    """One parameter's accumulated gradient against the big batch's."""

    name: str
    """The parameter's name in `model.named_parameters()`."""
    numel: int
    """Elements."""
    max_abs_err: float
    """Largest |g_acc - g_big| over its elements."""
    rel_err: float
    """|g_acc - g_big| / |g_big| (Frobenius norms; `reference.rel_errors`, whose floor
    measures a gradient that is zero up to rounding)."""
    cosine: float
    """Cosine of the angle between g_acc and g_big (1 for equal directions)."""
    param_abs_err: float
    """Largest |p_acc - p_big| after one optimizer step, over the elements whose gradient is
    not zero up to rounding (there the optimizer turns rounding noise into full steps)."""


@dataclass
class VerifyReport:
    """What `verify` found. Errors are relative to the big batch's gradient unless named abs."""

    passed: bool
    """Every parameter's relative error within `tolerance`."""
    tolerance: float
    """Largest relative error that passes (`TOLERANCES[precision]` unless given)."""
    precision: str
    """The Accumulator's precision: fp32, bf16 or fp16."""
    micro_steps: int
    """Micro-batches in the window (k)."""
    tokens: int
    """Valid tokens in the window, as loss_fn counted them on the big batch."""
    reference: str
    """The big batch's dtype: "float64", or "float32" where the model would not run in it."""
    max_abs_err: float
    """Largest |g_acc - g_big| over all elements."""
    max_rel_err: float
    """Largest relative error over parameters."""
    cosine_min: float
    """Smallest cosine over parameters."""
    param_max_abs_err: float
    """Largest |p_acc - p_big| after one optimizer step (see `ParamError.param_abs_err`)."""
    params: list[ParamError]
    """Per parameter, in the model's order."""
    wrong_ways: dict[str, float | None]
    """Each usual mistake's largest relative error (None where it could not run: its note
    says why). Keys are those of `WRONG_WAYS`."""
    lint: list[Finding]
    """What breaks equivalence, or was changed for the check."""
    notes: list[str] = field(default_factory=list)
    """What verify did that a reader should know (RNG fixed, reference dtype, ...)."""
    moe: MoEReport | None = None
    """A mixture of experts: cross-entropy plus the load-balancing loss in the balance
    checked, against the big batch's (`verification.moe_check`); None for a dense model."""

    def checks(self) -> list[dict]:
        """Each check that decides `passed`, as `check_row` gives it: "gradient" (the
        window's, `max_rel_err`) and, for a mixture of experts, "moe" (with its balance)."""
        rows = [check_row("gradient", self.max_rel_err, self.tolerance)]
        if self.moe is not None:
            moe = self.moe
            rows.append(check_row("moe", moe.grad_rel_err, moe.tolerance, moe.passed))
        return rows

    def to_dict(self) -> dict:
        """The fields the CLI's --json prints, plus per-parameter rows and notes. Its
        `max_rel_err` and `tolerance` are the worst check's (`verdict`): for a mixture of
        experts whose balance fails, the balance's, not the cross-entropy's alone."""
        out = {
            key: getattr(self, key)
            for key in ("passed", "tolerance", "precision", "micro_steps", "tokens")
        }
        out.update(
            reference=self.reference,
            max_abs_err=self.max_abs_err,
            max_rel_err=self.max_rel_err,
            cosine_min=self.cosine_min,
            param_max_abs_err=self.param_max_abs_err,
            wrong_ways=dict(self.wrong_ways),
            lint=[asdict(f) for f in self.lint],
            params=[asdict(p) for p in self.params],
            notes=list(self.notes),
            moe=None if self.moe is None else asdict(self.moe),
        )
        out.update(verdict(self.checks()))
        return out

    def to_json(self) -> str:
        """`to_dict` as JSON text; a non-finite number becomes null."""
        return json.dumps(finite(self.to_dict()), indent=2)


def check_row(name: str, err: float, tolerance: float, passed: bool | None = None) -> dict:
    """One check that decides verify's verdict: its name, its largest relative error, the
    tolerance it is held to and whether it passed (default: err within the tolerance; NaN
    fails)."""
    ok = err <= tolerance if passed is None else passed
    return {"check": name, "max_rel_err": err, "tolerance": tolerance, "passed": bool(ok)}


def verdict(checks: list[dict]) -> dict:
    """The top-level fields of --json over `checks` (`check_row`s): `passed` (every check
    passed), and the worst check's `max_rel_err`, `tolerance` and name (`max_rel_err_check`):
    a failing check before a passing one, then the largest error relative to its tolerance
    (a non-finite error the largest). With all checks held to one tolerance, that is the
    largest error, and `passed` is `max_rel_err <= tolerance`."""

    def badness(row: dict) -> tuple[bool, float]:
        err = row["max_rel_err"]
        ratio = err / row["tolerance"] if math.isfinite(err) else math.inf
        return (not row["passed"], ratio)

    worst = max(checks, key=badness)  # the first of equals: "gradient" leads
    return {
        "passed": all(row["passed"] for row in checks),
        "max_rel_err": worst["max_rel_err"],
        "tolerance": worst["tolerance"],
        "max_rel_err_check": worst["check"],
        "checks": checks,
    }
