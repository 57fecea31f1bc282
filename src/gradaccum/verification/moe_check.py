"""The mixture-of-experts part of `verify`: the window's gradient of cross-entropy plus the
load-balancing loss (LBL) through the engine and `gradaccum.moe.balance.Balance`, against
one big batch whose LBL uses the whole window's token fractions f and probabilities P.

The reference (`moe_big_batch`) is computed here without `Balance` or `models.router`: every
micro-batch padded into one batch (`concat_batches`), in float64 where the model runs in it,
one forward with router logits, then

    CE summed over the targets / N + coef * E * mean over layers l of sum_i f[l,i] * P[l,i]

over the window's real tokens (attention_mask 1), f[l,i] the fraction of them whose top-k
contains expert i (no gradient), P[l,i] their mean softmax probability of expert i; one
backward. "global" must match it; "micro" (each micro-batch's own LBL, weighted by its
tokens) differs from it in f, and that difference is the finding; "global-previous" runs two
windows and the second must match the big batch of its own P with the first window's f.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from gradaccum.engine.accumulator import Accumulator
from gradaccum.models.gpt import GPT
from gradaccum.models.loss import IGNORE_INDEX
from gradaccum.moe.balance import Balance
from gradaccum.moe.router import moe_spec
from gradaccum.utils.choices import MOE_BALANCES
from gradaccum.utils.errors import BadInput
from gradaccum.verification.lint import Finding, suspects
from gradaccum.verification.reference import (
    GradRecorder,
    Grads,
    concat_batches,
    max_rel_error,
    trainable,
)

BALANCE_FLAG = "--moe-balance"


@dataclass
class MoEReport:
    """The load-balancing part of verify for a mixture-of-experts model."""

    mode: str
    """The balance checked: micro, global or global-previous."""
    passed: bool
    """`grad_rel_err` within `tolerance`."""
    tolerance: float
    """The same tolerance as the rest of verify (per precision)."""
    grad_rel_err: float
    """Largest relative error over parameters of the engine's window gradient (CE + LBL in
    `mode`) against the exact one: the big batch with the window's own f and P ("micro",
    "global"); for "global-previous", the second window's big batch with the first window's
    f and its own P."""
    micro_rel_err: float
    """The same error of the LBL computed per micro-batch ("micro") against the big batch
    with the window's own f and P: what computing it per forward costs."""
    lbl: float
    """The window's LBL, f and P of the whole window (the big batch's)."""
    micro_lbl: float
    """The LBL as "micro" trains it: each micro-batch's own, weighted by its tokens."""
    aux_loss: float
    """The balance term the engine trained in `mode` (`StepResult.aux_loss`)."""
    tokens: int
    """Routed (real) tokens in the window."""
    n_expert: int
    top_k: int
    layers: int
    """MoE layers (routers)."""
    coef: float
    """The model's load-balancing coefficient."""
    reference: str
    """The big batch's dtype."""
    stale_rel_err: float | None = None
    """"global-previous": the second window's error against its own f's exact gradient (how
    far one window's staleness in f moves it); None otherwise."""
    notes: list[str] = field(default_factory=list)


def check_mode(model: torch.nn.Module, mode: str | None) -> str | None:
    """The balance verify checks: `mode` for an MoE model ("global" when None), None for a
    dense one without a mode; BadInput for an unknown mode or a mode on a dense model."""
    spec = moe_spec(model)
    if mode is not None and mode not in MOE_BALANCES:
        raise BadInput(BALANCE_FLAG, mode, f"choose one of {', '.join(MOE_BALANCES)}")
    if spec is None:
        if mode is None:
            return None
        raise BadInput(
            BALANCE_FLAG,
            mode,
            f"{type(model).__name__} is not a mixture of experts whose router logits gradaccum "
            "reads: use --model tiny-moe or an MoE --model-config (Mixtral, Qwen2-MoE, "
            "Qwen3-MoE, OLMoE)",
        )
    return mode or "global"


# ---- the reference, without the balance --------------------------------------------------


@dataclass
class _BigBatch:
    grads: Grads
    f: torch.Tensor  # (L, E) float64, the window's own token fractions
    lbl: float  # with the window's own f and P
    tokens: int  # routed
    dtype: torch.dtype
    ce: float  # the cross-entropy summed over the targets
    targets: int


def _loss_figures(model) -> tuple[float, int]:
    """(coef, top_k) from the model's own config."""
    cfg = model.config
    if isinstance(model, GPT):
        return float(cfg.router_aux_coef), int(cfg.expert_top_k)
    return float(cfg.router_aux_loss_coef), int(cfg.num_experts_per_tok)


def _forward(model, batch: dict):
    if isinstance(model, GPT):
        return model(batch["input_ids"], output_router_logits=True)
    return model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        use_cache=False,
        output_router_logits=True,
    )


def moe_big_batch(
    model: torch.nn.Module,
    micro_batches: Sequence[dict],
    shift: bool,
    f: torch.Tensor | None = None,
) -> _BigBatch:
    """The big batch's gradient of CE / N + LBL (module docstring) on a copy of `model`, in
    float64 (float32 where the model will not run in it). shift: labels unshifted (position
    t predicts label t + 1). f: the (L, E) token fractions the LBL takes (default the
    window's own)."""
    whole = concat_batches(list(micro_batches))
    for dtype in (torch.float64, torch.float32):
        ref = copy.deepcopy(model).to(dtype)
        if hasattr(ref, "set_experts_implementation"):  # grouped_mm takes no float64
            ref.set_experts_implementation("eager")
        try:
            out = _forward(ref, whole)
            break
        except (RuntimeError, TypeError):
            if dtype == torch.float32:
                raise
    logits, labels = out.logits, whole["labels"]
    if shift:
        logits, labels = logits[:, :-1], labels[:, 1:]
    ce = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]),
        labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
    n = int((labels != IGNORE_INDEX).sum())
    real = whole["attention_mask"].reshape(-1) == 1
    tokens = int(real.sum())
    coef, top_k = _loss_figures(ref)
    probs = [torch.softmax(r[real].to(dtype), dim=-1) for r in out.router_logits]
    experts = probs[0].shape[-1]
    counts = torch.stack(
        [torch.bincount(p.topk(top_k).indices.flatten(), minlength=experts) for p in probs]
    ).double()
    own_f = counts / tokens
    big_p = torch.stack([p.sum(0) for p in probs]) / tokens
    lbl = coef * experts * (own_f.to(dtype) * big_p).sum(1).mean()
    used = lbl if f is None else coef * experts * (f.to(dtype) * big_p).sum(1).mean()
    (ce / n + used).backward()
    grads = [None if p.grad is None else p.grad.detach().clone() for _, p in trainable(ref)]
    return _BigBatch(grads, own_f, float(lbl.detach()), tokens, dtype, float(ce.detach()), n)


# ---- the engine, through the balance -----------------------------------------------------


def _engine(model, windows: list, mode: str, shift: bool, precision: str, seed: int):
    """Each window through `Balance.step` on a copy of `model` whose optimizer only records
    (the parameters stay): the gradients handed to it, per window, and (StepResult,
    BalanceStats) per window."""
    model = copy.deepcopy(model)
    recorder = GradRecorder([p for _, p in trainable(model)])
    acc = Accumulator(model, recorder, precision=precision)
    balance = Balance(model, mode, shift=shift)
    torch.manual_seed(seed)
    outs = [balance.step(acc, window) for window in windows]
    acc.close()
    return recorder.seen, outs


def moe_check(
    model: torch.nn.Module,
    micro_batches: Sequence[dict],
    mode: str,
    *,
    shift: bool,
    precision: str,
    tolerance: float,
    previous_window: Sequence[dict] | None = None,
    seed: int = 0,
) -> MoEReport:
    """The window's CE + LBL gradient through the engine in `mode` against the big batch
    (module docstring). "global-previous" needs `previous_window`, run first: the window
    checked is the second."""
    micro_batches = list(micro_batches)
    if any("attention_mask" not in b for b in micro_batches):
        raise BadInput(
            "micro_batches",
            "without attention_mask",
            "the load-balancing check counts the real tokens by the attention_mask",
        )
    spec = moe_spec(model)
    want = moe_big_batch(model, micro_batches, shift)
    micro_grads, [(micro_result, _)] = _engine(
        model, [micro_batches], "micro", shift, precision, seed
    )
    micro_err = max_rel_error(micro_grads[0], want.grads)
    notes, stale = [], None
    if mode == "micro":
        err, aux = micro_err, micro_result.aux_loss
    elif mode == "global":
        grads, [(result, stats)] = _engine(model, [micro_batches], mode, shift, precision, seed)
        err, aux = max_rel_error(grads[0], want.grads), result.aux_loss
        if stats.routing_agrees is False:
            notes.append("the training forwards routed otherwise than the routing pass")
    else:
        if previous_window is None:
            raise BadInput(
                "previous_window",
                "None",
                "--moe-balance global-previous checks a second window against the first "
                "one's f: pass the window before",
            )
        first = moe_big_batch(model, previous_window, shift)
        target = moe_big_batch(model, micro_batches, shift, f=first.f)
        grads, outs = _engine(
            model, [list(previous_window), micro_batches], mode, shift, precision, seed
        )
        err, aux = max_rel_error(grads[1], target.grads), outs[1][0].aux_loss
        stale = max_rel_error(grads[1], want.grads)
        notes.append(
            "global-previous: the second of 2 windows, against the exact gradient with the "
            "first window's f (one window stale in f, exact in P)"
        )
    return MoEReport(
        mode=mode,
        passed=err <= tolerance,
        tolerance=tolerance,
        grad_rel_err=err,
        micro_rel_err=micro_err,
        lbl=want.lbl,
        micro_lbl=float(micro_result.aux_loss),
        aux_loss=float(aux),
        tokens=want.tokens,
        n_expert=spec.n_expert,
        top_k=spec.top_k,
        layers=spec.layers,
        coef=spec.coef,
        reference=str(want.dtype).replace("torch.", ""),
        stale_rel_err=stale,
        notes=notes,
    )


def moe_finding(model: torch.nn.Module, report: MoEReport) -> Finding | None:
    """The per-micro-batch LBL's error as a finding: an error when "micro" is the mode
    checked, a note otherwise; None when it is within the tolerance."""
    if report.micro_rel_err <= report.tolerance:
        return None
    names = suspects(model)
    routers = [n for n in names if n.rsplit(".", 1)[-1] in ("router", "gate")]
    return Finding(
        module=(routers or names or [type(model).__name__])[0],
        problem=f"the load-balancing loss computed per micro-batch is off by "
        f"{report.micro_rel_err:.1e} from the global batch's (largest relative error of the "
        f"window gradient; the loss {report.micro_lbl:.6g} against {report.lbl:.6g}): each "
        "micro-batch balanced on its own, with its own token fractions f",
        fix="--moe-balance global makes it exact (gradaccum.moe.Balance(model, 'global'): f "
        "over the whole window from a routing pass); global-previous is exact in P with the "
        "previous window's f",
        severity="error" if report.mode == "micro" else "note",
    )
