"""Proof on the user's own model that accumulation gives the big-batch gradient.

`verify(model, micro_batches, loss_fn)` runs the same data twice on copies of the model (the
model passed in is never changed): once as one big batch, the micro-batches concatenated and
padded where their lengths differ, in float64 where the model computes in it; and once as one
window through `Accumulator`. It compares the gradients handed to the optimizer per parameter
and the parameters after one optimizer step (AdamW by default). Then it runs the usual
mistakes on the same data through the same engine (`wrong_ways`), and names what in the model
breaks equivalence (docs/design.md, "Verify"; the lint is in `gradaccum.verification.lint`).
What it found is a `report.VerifyReport`.

The tolerance per precision (`TOLERANCES`) comes from the precision study
(`gradaccum.verification.precision_study`, docs/design.md "Tolerances of verify").
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence

import torch

from gradaccum.engine.precision import is_low_precision
from gradaccum.models.loss import IGNORE_INDEX
from gradaccum.models.optimizer import adamw
from gradaccum.utils.choices import PRECISIONS
from gradaccum.utils.errors import BadInput
from gradaccum.verification.lint import lint, list_names, quiet_rng
from gradaccum.verification.moe_check import check_mode, moe_check, moe_finding
from gradaccum.verification.reference import (
    Grads,
    big_batch_reference,
    concat_batches,
    dense,
    engine_grads,
    grad_norm,
    rel_errors,
    trainable,
)
from gradaccum.verification.report import ParamError, VerifyReport, check_row, verdict
from gradaccum.verification.wrong_ways import WRONG_WAYS, WrongWayInputs, measure_wrong_ways

__all__ = ["TOLERANCES", "TOLERANCE_SOURCE", "WRONG_WAYS", "ParamError", "VerifyReport"]
__all__ += ["check_row", "concat_batches", "sample_batches", "verdict", "verify"]

# Largest relative error of a window gradient against the float64 big batch that passes, per
# precision: the precision study's largest per-parameter error over k = 1..1024 on the built-in
# GPT (`gradaccum verify --precision-study`), times 4, rounded up to 1, 2 or 5 times a power of
# ten, never below 1e-5 in fp32 (`precision_study.derive_tolerances`).
TOLERANCES = {"fp32": 1e-5, "bf16": 1e-1, "fp16": 5e-3}
TOLERANCE_SOURCE = "from the precision study: docs/design.md, Tolerances of verify"


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
    micro_batches, tolerance = _checked(micro_batches, precision, tolerance)
    mode = check_mode(model, moe_balance)
    make_optimizer = optimizer or _adamw
    with _forked_rng(model):
        prepared, quieted, exact = _copies(model, reference_model)
        whole = _whole_batch(micro_batches, big_batch, concat)
        say("the big batch in float64")
        ref = big_batch_reference(exact, whole, loss_fn, seed)
        options = _engine_options(prepared, precision, count_tokens)
        say(f"the window through the engine, {len(micro_batches)} micro-batches")
        got, after = engine_grads(
            prepared, [micro_batches], loss_fn, make_optimizer, seed, **options
        )
        ref_after = _step_with(prepared, ref.grads, make_optimizer)
        params = _param_rows(prepared, got, ref.grads, after, ref_after)
        same = WrongWayInputs(
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
        ways = measure_wrong_ways(same, big_batch) if wrong_ways else {}
        say("the lint")
        findings = lint(prepared, micro_batches, whole, loss_fn, ref, quieted, seed, exact)
        report = _report(
            params, ref, precision, tolerance, len(micro_batches), ways, findings, quieted
        )
        if mode is not None:
            say(f"the load-balancing loss, --moe-balance {mode}, against the big batch's")
            _add_moe(report, prepared, micro_batches, mode, moe_shift, previous_window, seed)
    return report


def _forked_rng(model: torch.nn.Module):
    """A context that restores, on leaving, the RNG state of the CPU and of the model's first
    accelerator: verify's seeded runs leave the caller's RNG as it was."""
    devices = [p.device for p in model.parameters() if p.device.type != "cpu"][:1]
    return torch.random.fork_rng(
        devices=devices, device_type=devices[0].type if devices else "cuda"
    )


def _copies(model: torch.nn.Module, reference_model: torch.nn.Module | None) -> tuple:
    """(prepared, quieted, exact): the copy of `model` verify runs, its RNG fixed (`quiet_rng`),
    what that fixed, and what the big batches run on (`prepared`, or a copy of
    `reference_model` with its RNG fixed alike)."""
    prepared = copy.deepcopy(model)
    quieted = quiet_rng(prepared)
    exact = prepared
    if reference_model is not None:
        exact = copy.deepcopy(reference_model)
        quiet_rng(exact)
    return prepared, quieted, exact


def _engine_options(prepared: torch.nn.Module, precision: str, count_tokens) -> dict:
    """The Accumulator's options for the window: master weights for 16-bit parameters."""
    options = {"precision": precision, "count_tokens": count_tokens}
    if any(is_low_precision(p.dtype) for _, p in trainable(prepared)):
        options["master_weights"] = True  # the fp32 buffer itself reaches the optimizer
    return options


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


def _checked(micro_batches, precision: str, tolerance) -> tuple[list, float]:
    """The micro-batches as a list and the tolerance (`TOLERANCES[precision]` unless given);
    BadInput on arguments that cannot work."""
    if precision not in PRECISIONS:
        raise BadInput("precision", repr(precision), f"expected one of {', '.join(PRECISIONS)}")
    micro_batches = list(micro_batches)
    if not micro_batches:
        raise BadInput("micro_batches", "[]", "needs at least one micro-batch")
    if tolerance is not None and not tolerance > 0:
        raise BadInput("tolerance", tolerance, "must be positive")
    return micro_batches, TOLERANCES[precision] if tolerance is None else tolerance


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
