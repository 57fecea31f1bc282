"""How far a window gradient lands from the exact one, per precision, as k grows.

For k = 1, 2, 4, ... micro-batches (up to 1024), the window gradient through `Accumulator` in
four modes, each against a float64 reference of the same weights (the per-micro-batch
gradients of the summed loss, in float64, added up and divided by the window's tokens):

- fp32: fp32 parameters and gradients;
- bf16_fp32_buffer: bf16 parameters, each gradient added into the fp32 buffer (the engine's
  way), handed to fp32 master weights;
- bf16_accumulation: bf16 parameters, gradients summed in bf16 (the mistake);
- fp16_loss_scaler: fp16 autocast on fp32 parameters, with the loss scaler.

The error is the relative error of the whole gradient; the largest over parameters, as
`verify` measures it, is kept too, and the tolerance `verify` applies per precision is derived
from that one (`derive_tolerances`; docs/design.md
"Tolerances of verify").
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from gradaccum.utils.atomic import write_atomic
from gradaccum.verification.lint import quiet_rng
from gradaccum.verification.reference import (
    Grads,
    cast_floats,
    engine_grads,
    max_rel_error,
    seeded,
    trainable,
    whole_rel_error,
)

MODES = {
    "fp32": "fp32 parameters and gradients",
    "bf16_fp32_buffer": "bf16 parameters, gradients added into the fp32 buffer",
    "bf16_accumulation": "bf16 parameters, gradients summed in bf16",
    "fp16_loss_scaler": "fp16 autocast on fp32 parameters, loss scaler",
}
# verify's precision -> the study's mode its tolerance is derived from
PRECISION_MODES = {"fp32": "fp32", "bf16": "bf16_fp32_buffer", "fp16": "fp16_loss_scaler"}
HEADROOM = 4.0
# No tighter than this in fp32: an fp32 backward's rounding grows with depth, width and
# sequence length, and the models a study runs on in seconds are small.
FLOORS = {"fp32": 1e-5}


@dataclass
class StudyPoint:
    """One mode at one k."""

    k: int
    """Micro-batches in the window."""
    mode: str
    """A key of MODES."""
    rel_err: float
    """|g - g_ref| / |g_ref| against the float64 reference, g the whole gradient (every
    parameter's, as one vector)."""
    max_param_rel_err: float
    """The largest of the same per parameter, as `verify` measures it (tolerances derive from
    this one)."""


def powers_of_two(k_max: int) -> list[int]:
    """1, 2, 4, ... up to k_max."""
    return [2**i for i in range(int(math.log2(k_max)) + 1)] if k_max >= 1 else []


def fp64_references(
    model: torch.nn.Module, micro_batches: Sequence, loss_fn: Callable, ks: Sequence[int], seed=0
) -> dict[int, Grads]:
    """For each k in `ks`, the exact window gradient of the first k micro-batches: each one's
    gradient of its summed loss in float64 on a float64 copy of `model`, added up in float64
    and divided by the window's valid tokens."""
    ref = copy.deepcopy(model).double()
    params = [p for _, p in trainable(ref)]
    loss = seeded(loss_fn, seed)
    total, tokens, out = None, 0, {}
    for i, batch in enumerate(micro_batches[: max(ks)], start=1):
        ref.zero_grad(set_to_none=True)
        loss_sum, n = loss(ref, _as_double(batch))
        loss_sum.backward()
        grads = [None if p.grad is None else p.grad.detach().clone() for p in params]
        total = grads if total is None else [_add(a, b) for a, b in zip(total, grads, strict=True)]
        tokens += int(n)
        if i in ks:
            out[i] = [None if g is None else g / max(tokens, 1) for g in total]
    return out


def _add(a, b):
    if a is None or b is None:
        return b if a is None else a
    return a + b


def _as_double(batch):
    return cast_floats(batch, torch.float64)


def precision_study(
    model: torch.nn.Module,
    micro_batches: Sequence,
    loss_fn: Callable,
    ks: Sequence[int] | None = None,
    count_tokens: Callable | str | None = "auto",
    seed: int = 0,
    progress: Callable[[int], None] | None = None,
) -> list[StudyPoint]:
    """The four modes' errors for each k in `ks` (default: powers of two up to the number of
    micro-batches, at most 1024), on copies of `model` with dropout off."""
    ks = sorted(ks or powers_of_two(min(len(micro_batches), 1024)))
    if not ks or ks[0] < 1 or ks[-1] > len(micro_batches):
        raise ValueError(f"ks {ks}: need 1 <= k <= {len(micro_batches)} (the micro-batches given)")
    full = copy.deepcopy(model).float()
    quiet_rng(full)
    low = copy.deepcopy(full).to(torch.bfloat16)
    refs = {"full": fp64_references(full, micro_batches, loss_fn, ks, seed)}
    refs["low"] = fp64_references(low, micro_batches, loss_fn, ks, seed)
    runs = {
        "fp32": (full, "full", {}),
        "bf16_fp32_buffer": (low, "low", {"precision": "bf16", "master_weights": True}),
        "bf16_accumulation": (low, "low", {"precision": "bf16", "accum_dtype": torch.bfloat16}),
        "fp16_loss_scaler": (full, "full", {"precision": "fp16"}),
    }
    points = []
    for k in ks:
        for mode, (net, ref, options) in runs.items():
            got, _ = engine_grads(
                net, [micro_batches[:k]], loss_fn, seed=seed, count_tokens=count_tokens, **options
            )
            points.append(StudyPoint(k, mode, *_errors(got, refs[ref][k])))
        if progress is not None:
            progress(k)
    return points


def _errors(got: Grads, want: Grads) -> tuple[float, float]:
    """(whole-gradient relative error, largest per-parameter one); inf for a skipped window."""
    if all(g is None for g in got):
        return math.inf, math.inf
    return whole_rel_error(got, want), max_rel_error(got, want)


def nice_ceil(x: float) -> float:
    """The smallest of 1, 2, 5 times a power of ten that is >= x."""
    if not x > 0 or not math.isfinite(x):
        return x
    exponent = math.floor(math.log10(x))
    for m in (1, 2, 5, 10):
        if m * 10.0**exponent >= x * (1 - 1e-12):
            return float(f"{m * 10.0**exponent:.1e}")
    raise AssertionError("unreachable")


def derive_tolerances(points: Sequence[StudyPoint]) -> dict[str, float]:
    """Per precision of verify: its mode's largest per-parameter error over k, times
    HEADROOM, rounded up to 1, 2 or 5 times a power of ten, and at least FLOORS[precision]."""
    out = {}
    for precision, mode in PRECISION_MODES.items():
        errors = [p.max_param_rel_err for p in points if p.mode == mode]
        if errors:
            out[precision] = max(nice_ceil(HEADROOM * max(errors)), FLOORS.get(precision, 0.0))
    return out


def study_table(points: Sequence[StudyPoint]) -> str:
    """k down the side, one column per mode, relative errors in scientific notation."""
    ks = sorted({p.k for p in points})
    err = {(p.k, p.mode): p.rel_err for p in points}
    head = f"{'k':>5}  " + "  ".join(f"{mode:>18}" for mode in MODES)
    rows = [
        f"{k:>5}  " + "  ".join(f"{err.get((k, mode), math.nan):>18.2e}" for mode in MODES)
        for k in ks
    ]
    return "\n".join([head, *rows])


def write_plot(points: Sequence[StudyPoint], path: str, title: str = "") -> bool:
    """Relative error against k, one line per mode, log-log, written atomically as a PNG.
    Returns False, writing nothing, when matplotlib is not installed (an optional extra).
    No room on the disk raises DiskFull (`PATH: not written (No space left on device)`, one
    line and exit 1 on the command line), leaving what was at `path` as it was."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return False
    fig = Figure(figsize=(7, 4.5))
    ax = fig.add_subplot()
    for mode, words in MODES.items():
        ours = sorted((p.k, p.rel_err) for p in points if p.mode == mode)
        if ours:
            ax.plot([k for k, _ in ours], [e for _, e in ours], marker="o", label=words)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("k (micro-batches per window)")
    ax.set_ylabel("relative error vs float64")
    ax.set_title(title or "window gradient error by precision")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    write_atomic(path, lambda f: fig.savefig(f, format="png", dpi=120))
    return True
