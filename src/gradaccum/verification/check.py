"""Proof on the user's own model that accumulation gives the big-batch gradient.

`verify(model, micro_batches, loss_fn)` runs the same data twice on copies of the model (the
model passed in is never changed): once as one big batch, the micro-batches concatenated and
padded where their lengths differ, in float64 where the model computes in it; and once as one
window through `Accumulator`. It compares the gradients handed to the optimizer per parameter
and the parameters after one optimizer step (AdamW by default). Then it runs the usual
mistakes on the same data through the same engine, and names what in the model breaks
equivalence (docs/design.md, "Verify"; the lint is in `gradaccum.verification.lint`).

The tolerance per precision (`TOLERANCES`) comes from the precision study
(`gradaccum.verification.precision_study`, docs/design.md "Tolerances of verify").
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch

from gradaccum.engine.precision import is_low_precision
from gradaccum.models.loss import IGNORE_INDEX
from gradaccum.models.optimizer import adamw
from gradaccum.utils.choices import PRECISIONS
from gradaccum.utils.errors import BadInput
from gradaccum.utils.jsonable import finite
from gradaccum.verification.lint import Finding, lint, list_names, quiet_rng
from gradaccum.verification.moe_check import MoEReport, check_mode, moe_check, moe_finding
from gradaccum.verification.reference import (
    Grads,
    Reference,
    big_batch_reference,
    concat_batches,
    dense,
    engine_grads,
    grad_norm,
    max_rel_error,
    rel_errors,
    trainable,
)

# Largest relative error of a window gradient against the float64 big batch that passes, per
# precision: the precision study's largest per-parameter error over k = 1..1024 on the built-in
# GPT (`gradaccum verify --precision-study`), times 4, rounded up to 1, 2 or 5 times a power of
# ten, never below 1e-5 in fp32 (`precision_study.derive_tolerances`).
TOLERANCES = {"fp32": 1e-5, "bf16": 1e-1, "fp16": 5e-3}
TOLERANCE_SOURCE = "from the precision study: docs/design.md, Tolerances of verify"

WRONG_WAYS = {
    "mean_over_k": "each micro-batch's mean loss divided by k",
    "no_division": "each micro-batch's mean loss, not divided",
    "step_every_micro_batch": "an optimizer step after every micro-batch (error of the update)",
    "short_window_over_k": "a short last window (k/2 micro-batches), each mean divided by k",
    "bf16_accumulation": "bf16 parameters, gradients summed in bf16",
}


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


# ---- verify -----------------------------------------------------------------------------------


def _adamw(params) -> torch.optim.Optimizer:
    return adamw(params, lr=1e-3)


def verify(
    model: torch.nn.Module,
    micro_batches: Sequence,
    loss_fn: Callable,
    precision: str = "fp32",
    optimizer: Callable | None = None,
    *,
    count_tokens: Callable | str | None = "auto",
    big_batch=None,
    concat: Callable | None = None,
    tolerance: float | None = None,
    wrong_ways: bool = True,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
    moe_balance: str | None = None,
    moe_shift: bool = False,
    previous_window: Sequence | None = None,
    reference_model: torch.nn.Module | None = None,
) -> VerifyReport:
    """Check that one window of `micro_batches` through `Accumulator` gives the gradient of
    the same data as one big batch, on copies of `model`.

    loss_fn(model, batch) -> (loss summed over valid tokens, their count), as for Accumulator.
    optimizer: a callable(params) -> optimizer for the one step compared after the gradients
      (default AdamW, lr 1e-3).
    count_tokens: passed to Accumulator (`gradaccum.hf.count_tokens` for shifted labels).
    big_batch / concat: the whole batch, or how to form it, where `concat_batches` cannot.
    tolerance: largest relative error that passes (default `TOLERANCES[precision]`).
    wrong_ways: also run the usual mistakes (`WRONG_WAYS`) for contrast.
    progress: called with a few words before each part of the work (for long windows).
    moe_balance: a mixture of experts' load-balancing mode checked (default global; none for
      a dense model): `VerifyReport.moe`, part of `passed`. moe_shift: labels unshifted, as
      `gradaccum.hf` takes them. previous_window: the window "global-previous" takes f from.
    reference_model: the model the float64 big batches and the lint's runs use in place of a
      copy of `model`, where `model` cannot be cast to float64 (a quantised base: its
      dequantised copy with the same adapters, `verification.qlora`); its trainable
      parameters are `model`'s, in the same order. Not changed.
    Raises BadInput on arguments that cannot work.
    """
    say = progress or (lambda words: None)
    micro_batches = _check(micro_batches, precision, tolerance)
    mode = check_mode(model, moe_balance)
    tolerance = TOLERANCES[precision] if tolerance is None else tolerance
    devices = [p.device for p in model.parameters() if p.device.type != "cpu"][:1]
    with torch.random.fork_rng(devices=devices, device_type=devices[0].type if devices else "cuda"):
        prepared = copy.deepcopy(model)
        quieted = quiet_rng(prepared)
        exact = prepared
        if reference_model is not None:
            exact = copy.deepcopy(reference_model)
            quiet_rng(exact)
        whole = _whole_batch(micro_batches, big_batch, concat)
        say("the big batch in float64")
        ref = big_batch_reference(exact, whole, loss_fn, seed)
        options = {"precision": precision, "count_tokens": count_tokens}
        if any(is_low_precision(p.dtype) for _, p in trainable(prepared)):
            options["master_weights"] = True  # the fp32 buffer itself reaches the optimizer
        make_optimizer = optimizer or _adamw
        say(f"the window through the engine, {len(micro_batches)} micro-batches")
        got, after = engine_grads(
            prepared, [micro_batches], loss_fn, make_optimizer, seed, **options
        )
        ref_after = _step_with(prepared, ref.grads, make_optimizer)
        params = _param_rows(prepared, got, ref.grads, after, ref_after)
        context = _Context(
            prepared,
            micro_batches,
            loss_fn,
            seed,
            count_tokens,
            ref,
            concat,
            make_optimizer,
            ref_after,
            exact,
        )
        if wrong_ways:
            say(f"the usual mistakes ({len(WRONG_WAYS)}), same data, same engine")
        ways = _wrong_ways(context, big_batch) if wrong_ways else {}
        say("the lint")
        findings = lint(prepared, micro_batches, whole, loss_fn, ref, quieted, seed, exact)
        report = _report(
            params, ref, precision, tolerance, len(micro_batches), ways, findings, quieted
        )
        if mode is not None:
            say(f"the load-balancing loss, --moe-balance {mode}, against the big batch's")
            _add_moe(report, prepared, micro_batches, mode, moe_shift, previous_window, seed)
    return report


def _add_moe(report: VerifyReport, model, micro_batches, mode, shift, previous, seed) -> None:
    """The mixture of experts' part (`moe_check`) into `report`: its row, its verdict, the
    per-micro-batch loss's finding and its notes."""
    moe = moe_check(
        model, micro_batches, mode, shift=shift, precision=report.precision,
        tolerance=report.tolerance, previous_window=previous, seed=seed,
    )  # fmt: skip
    report.moe, report.passed = moe, report.passed and moe.passed
    found = moe_finding(model, moe)
    if found is not None:  # errors first, as `lint` orders them
        report.lint.insert(0 if found.severity == "error" else len(report.lint), found)
    report.notes += moe.notes


def _check(micro_batches, precision: str, tolerance) -> list:
    if precision not in PRECISIONS:
        raise BadInput("precision", repr(precision), f"expected one of {', '.join(PRECISIONS)}")
    micro_batches = list(micro_batches)
    if not micro_batches:
        raise BadInput("micro_batches", "[]", "needs at least one micro-batch")
    if tolerance is not None and not tolerance > 0:
        raise BadInput("tolerance", tolerance, "must be positive")
    return micro_batches


def _whole_batch(micro_batches: list, big_batch, concat: Callable | None):
    if big_batch is not None:
        return big_batch
    return (concat or concat_batches)(micro_batches)


def _step_with(model: torch.nn.Module, grads: Grads, make_optimizer: Callable) -> torch.nn.Module:
    """A copy of `model` after one step of `make_optimizer` with `grads` (fp32 for 16-bit)."""
    model = copy.deepcopy(model)
    params = [p for _, p in trainable(model)]
    if any(is_low_precision(p.dtype) for p in params):
        model = model.float()
        params = [p for _, p in trainable(model)]
    optimizer = make_optimizer(params)
    for p, g in zip(params, grads, strict=True):
        p.grad = None if g is None else g.to(p.dtype)
    optimizer.step()
    return model


def _param_rows(model, got: Grads, want: Grads, after, ref_after) -> list[ParamError]:
    rels = rel_errors(got, want)
    floor = 1e-7 * grad_norm(want) / math.sqrt(max(sum(p.numel() for _, p in trainable(model)), 1))
    rows = []
    pairs = zip(
        trainable(model), got, want, trainable(after), trainable(ref_after), rels, strict=True
    )
    for (name, p), g, w, (_, a), (_, r), rel in pairs:
        g, w = dense(g, w if w is not None else p), dense(w, g if g is not None else p)
        denom = g.norm() * w.norm()
        cosine = float((g * w).sum() / denom) if denom > 0 else float(g.norm() == w.norm())
        moving = w.abs() >= floor
        step_err = (a.detach().double() - r.detach().double()).abs()[moving]
        rows.append(
            ParamError(
                name=name,
                numel=p.numel(),
                max_abs_err=float((g - w).abs().max()) if p.numel() else 0.0,
                rel_err=rel,
                cosine=cosine,
                param_abs_err=float(step_err.max()) if step_err.numel() else 0.0,
            )
        )
    return rows


def _report(params, ref, precision, tolerance, k, ways, findings, quieted) -> VerifyReport:
    notes = []
    if ref.dtype != torch.float64:
        notes.append("the model would not run in float64: the big batch ran in float32")
    if quieted:
        notes.append(
            "RNG fixed: dropout turned off (training flag False) in "
            f"{list_names(quieted)}, every forward seeded alike"
        )
    max_rel = max((p.rel_err for p in params), default=0.0)
    return VerifyReport(
        passed=max_rel <= tolerance,
        tolerance=tolerance,
        precision=precision,
        micro_steps=k,
        tokens=ref.tokens,
        reference=str(ref.dtype).replace("torch.", ""),
        max_abs_err=max((p.max_abs_err for p in params), default=0.0),
        max_rel_err=max_rel,
        cosine_min=min((p.cosine for p in params), default=1.0),
        param_max_abs_err=max((p.param_abs_err for p in params), default=0.0),
        params=params,
        wrong_ways=ways,
        lint=findings,
        notes=notes,
    )


# ---- the usual mistakes, through the same engine ----------------------------------------------


@dataclass
class _Context:
    model: torch.nn.Module
    micro_batches: list
    loss_fn: Callable
    seed: int
    count_tokens: Callable | str | None
    ref: Reference
    concat: Callable | None
    make_optimizer: Callable
    ref_after: torch.nn.Module
    exact: torch.nn.Module
    """What the big batches run on: `model`, or verify's `reference_model`."""


def _wrong_ways(c: _Context, big_batch) -> dict[str, float | None]:
    """Each mistake's largest relative error against the big batch's gradient."""
    k = len(c.micro_batches)
    run = {"seed": c.seed, "count_tokens": c.count_tokens}
    out: dict[str, float | None] = {}

    def scaled(model, batch):  # the mean of each micro-batch, not divided by k
        loss_sum, n = c.loss_fn(model, batch)
        return loss_sum * k, n

    out["mean_over_k"] = _try(
        lambda: engine_grads(
            c.model, [c.micro_batches], c.loss_fn, normalize="micro_batch_mean", **run
        )
    )
    out["no_division"] = _try(
        lambda: engine_grads(
            c.model, [c.micro_batches], scaled, normalize="micro_batch_mean", **run
        )
    )
    out = {name: _error(result, c.ref.grads) for name, result in out.items()}
    out["step_every_micro_batch"] = _step_every(c)
    out["short_window_over_k"] = _short_window(c) if k >= 2 and big_batch is None else None
    # torch's cast, not a subclass's: transformers refuses .to(dtype) for a model it loaded
    # with a quantised base, whose packed integer weights torch's cast leaves as they are
    bf16 = torch.nn.Module.to(copy.deepcopy(c.model), torch.bfloat16)
    out["bf16_accumulation"] = _error(
        _try(
            lambda: engine_grads(
                bf16,
                [c.micro_batches],
                c.loss_fn,
                precision="bf16",
                accum_dtype=torch.bfloat16,
                **run,
            )
        ),
        c.ref.grads,
    )
    return out


def _step_every(c: _Context) -> float | None:
    """k optimizer steps of one micro-batch each: the parameters' change against the big
    batch's one step (the gradients alone would hide that the optimizer moved k times)."""
    result = _try(
        lambda: engine_grads(
            c.model,
            [[b] for b in c.micro_batches],
            c.loss_fn,
            c.make_optimizer,
            seed=c.seed,
            count_tokens=c.count_tokens,
        )
    )
    if result is None:
        return None
    before = [p.detach().double() for _, p in trainable(c.model)]
    moved = [
        p.detach().double() - b for (_, p), b in zip(trainable(result[1]), before, strict=True)
    ]
    want = [
        p.detach().double() - b for (_, p), b in zip(trainable(c.ref_after), before, strict=True)
    ]
    return max_rel_error(moved, want)


def _short_window(c: _Context) -> float | None:
    """The last window holds k/2 micro-batches and each one's mean is still divided by k
    (what a loop that divides by its configured k does): the engine divides each mean by
    the k/2 it ran, and the loss here is scaled by (k/2)/k to make that a division by k."""
    k = len(c.micro_batches)
    short = c.micro_batches[: k // 2]
    ref = big_batch_reference(c.exact, (c.concat or concat_batches)(short), c.loss_fn, c.seed)

    def over_k(model, batch):
        loss_sum, n = c.loss_fn(model, batch)
        return loss_sum * len(short) / k, n

    result = _try(
        lambda: engine_grads(
            c.model,
            [short],
            over_k,
            seed=c.seed,
            count_tokens=c.count_tokens,
            normalize="micro_batch_mean",
        )
    )
    return _error(result, ref.grads)


def _try(run: Callable):
    try:
        return run()
    except (RuntimeError, TypeError, ValueError):  # a model that cannot run this way
        return None


def _error(result, want: Grads) -> float | None:
    if result is None:
        return None
    got, _ = result
    return max_rel_error(got, want)


# ---- data for the built-in check --------------------------------------------------------------


def sample_batches(
    count: int,
    rows: int,
    seq_len: int,
    vocab_size: int,
    seed: int = 0,
    shifted: bool = True,
    mask: bool = False,
) -> list[dict]:
    """`count` micro-batches of `rows` token sequences of random lengths (2..seq_len), each
    micro-batch as wide as its longest row, padded with token 0 and label -100.

    Each next token is the previous one plus 1 (mod vocab_size) three times in four, else
    random: data with something to learn, so that gradients of different micro-batches share
    a direction, as in training. `shifted`: labels already aligned with the inputs (the
    built-in GPT); otherwise labels equal the inputs and the model shifts them (Hugging Face
    causal LMs), and the batch carries an attention_mask (`mask`: shifted ones too, which a
    mixture of experts' load-balancing check counts the real tokens by).
    """
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        lengths = torch.randint(2, seq_len + 1, (rows,), generator=g)
        width = int(lengths.max())
        seq = torch.empty(rows, width + 1, dtype=torch.long)
        seq[:, 0] = torch.randint(0, vocab_size, (rows,), generator=g)
        for t in range(1, width + 1):
            follow = torch.rand(rows, generator=g) < 0.75
            fresh = torch.randint(0, vocab_size, (rows,), generator=g)
            seq[:, t] = torch.where(follow, (seq[:, t - 1] + 1) % vocab_size, fresh)
        valid = torch.arange(width)[None, :] < lengths[:, None]
        ids = torch.where(valid, seq[:, :width], 0)
        if shifted:
            labels = torch.where(valid, seq[:, 1:], IGNORE_INDEX)
            extra = {"attention_mask": valid.long()} if mask else {}
            out.append({"input_ids": ids, "labels": labels, **extra})
        else:
            labels = torch.where(valid, ids, IGNORE_INDEX)
            out.append({"input_ids": ids, "labels": labels, "attention_mask": valid.long()})
    return out
