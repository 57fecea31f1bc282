"""What in a model or a loss breaks the equivalence of accumulation and the big batch.

Each check names the module and the fix (docs/design.md, "Verify"):
- layers whose output depends on the other rows of the batch (BatchNorm in training mode);
- random numbers: dropout is turned off for the check (`quiet_rng`), any other draw found by
  running the big batch under two seeds;
- a loss averaged inside the model or the loss_fn, and auxiliary terms computed per batch:
  found by comparing the big batch's summed loss with the micro-batches' (a sum over tokens
  adds up; a mean shrinks k times; a per-batch term adds up to k of itself);
- parameters that receive no gradient.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from gradaccum.moe.router import moe_spec
from gradaccum.verification.reference import Reference, cast_floats, seeded, trainable

# Attribute names under which modules keep a dropout probability they apply themselves
# (attention dropout inside fused kernels reads the module's own training flag).
_DROPOUT_ATTRS = ("dropout", "dropout_p", "attn_dropout", "attention_dropout", "resid_dropout")
_AUX_WORDS = ("router", "gate", "moe", "expert", "aux", "balanc")


@dataclass
class Finding:
    """Something in the model or the loss that breaks equivalence, or that verify changed."""

    module: str
    """Where: a module or parameter name, or "loss_fn"."""
    problem: str
    """What is wrong, in words."""
    fix: str
    """What to do about it."""
    severity: str = "error"
    """"error" breaks equivalence; "warning" is worth a look; "note" was handled by verify."""


def list_names(names: list[str], shown: int = 3) -> str:
    """The first `shown` names, and how many more."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def _dropout_p(module: nn.Module) -> float:
    if isinstance(module, nn.modules.dropout._DropoutNd):
        return float(module.p)
    values = [getattr(module, a, None) for a in _DROPOUT_ATTRS]
    probs = [float(v) for v in values if isinstance(v, float)]
    probs += [float(c.p) for c in module.children() if isinstance(c, nn.modules.dropout._DropoutNd)]
    return max(probs, default=0.0)


def quiet_rng(model: nn.Module) -> list[str]:
    """Turn off dropout for the check: the training flag of every dropout module, and of every
    module that holds one or a dropout probability of its own, set to False (that module only,
    not its children, so BatchNorm and the rest stay as they are). Returns their names.

    Fixing the seed is not enough: the big batch draws one mask of its shape, the micro-batches
    k masks of theirs, and the two never agree."""
    names = []
    for name, module in model.named_modules():
        if module.training and _dropout_p(module) > 0:
            module.training = False
            names.append(name or type(module).__name__)
    return names


def lint(
    model: nn.Module,
    micro_batches: Sequence,
    whole,
    loss_fn: Callable,
    ref: Reference,
    quieted: list[str],
    seed: int = 0,
    reference_model: nn.Module | None = None,
) -> list[Finding]:
    """Every finding for `model` (already quieted) on this data, errors first.
    reference_model: what the runs in `ref.dtype` use in place of `model` (verify's: a
    quantised base's dequantised copy)."""
    findings = batch_layers(model)
    if quieted:
        findings.append(
            Finding(
                module=list_names(quieted),
                problem="dropout draws different masks for the big batch and the micro-batches",
                fix="nothing to fix: verify ran with dropout off in these modules; in training "
                "the masks differ but follow the same distribution",
                severity="note",
            )
        )
    reference = copy.deepcopy(model if reference_model is None else reference_model).to(ref.dtype)
    findings += other_rng(reference, whole, loss_fn, seed)
    explained = any(f.severity == "error" for f in findings)
    findings += loss_scale(reference, micro_batches, whole, loss_fn, seed, explained)
    findings += no_gradient(model, ref)
    order = {"error": 0, "warning": 1, "note": 2}
    return sorted(findings, key=lambda f: order.get(f.severity, 3))


def batch_layers(model: nn.Module) -> list[Finding]:
    """BatchNorm (any variant) in training mode: normalized by each micro-batch's statistics."""
    out = []
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.training:
            out.append(
                Finding(
                    module=name or type(module).__name__,
                    problem=f"{type(module).__name__} normalizes with each micro-batch's own "
                    "mean and variance, not the whole batch's; its running statistics also "
                    "update once per micro-batch",
                    fix="use LayerNorm or GroupNorm, or freeze it (module.eval(): running "
                    "statistics); SyncBatchNorm shares statistics across ranks, not across "
                    "micro-batches",
                )
            )
    return out


def other_rng(model: nn.Module, whole, loss_fn: Callable, seed: int) -> list[Finding]:
    """The big batch's loss under two seeds: if it moves, the forward draws random numbers
    outside dropout modules."""
    batch = cast_floats(whole, next(model.parameters()).dtype)
    with torch.no_grad():
        a, _ = seeded(loss_fn, seed)(model, batch)
        b, _ = seeded(loss_fn, seed + 1)(model, batch)
    if torch.equal(a, b):
        return []
    return [
        Finding(
            module="model",
            problem="the forward draws random numbers outside dropout modules (the loss "
            f"changes with the seed: {float(a):.6g} vs {float(b):.6g}), so the big batch and "
            "the micro-batches see different noise",
            fix="switch that randomness off to verify (or make it depend on the data, not the "
            "batch's shape)",
        )
    ]


def loss_scale(
    model: nn.Module, micro_batches: Sequence, whole, loss_fn: Callable, seed: int, explained: bool
) -> list[Finding]:
    """Compare the big batch's summed loss with the sum of the micro-batches' ones.

    Summed over tokens they agree. A loss averaged inside the model is about the same for
    every batch size, so the big batch's is k times smaller than the sum; a term computed once
    per batch (an auxiliary load-balancing loss) is counted k times in the sum, once in the big
    batch. `explained`: an earlier finding already accounts for a mismatch."""
    dtype = next(model.parameters()).dtype
    loss = seeded(loss_fn, seed)
    with torch.no_grad():
        big, n_big = (float(x) for x in loss(model, cast_floats(whole, dtype)))
        parts = [[float(x) for x in loss(model, cast_floats(b, dtype))] for b in micro_batches]
    total, n_total = sum(p[0] for p in parts), sum(p[1] for p in parts)
    k = len(micro_batches)
    out = []
    if round(n_big) != round(n_total):
        out.append(_count_finding(n_big, n_total))
    if math.isclose(big, total, rel_tol=1e-4, abs_tol=1e-12) or explained:
        return out
    ratio = big / total if total else math.inf
    if k >= 2 and ratio > 0 and abs(math.log(ratio * k)) < abs(math.log(ratio)):
        out.append(_mean_finding(big, total, k))
    else:
        out.append(_aux_finding(model, big, total))
    return out


def _count_finding(n_big: float, n_total: float) -> Finding:
    return Finding(
        module="loss_fn",
        problem=f"the token count of the big batch ({round(n_big)}) is not the sum of the "
        f"micro-batches' ({round(n_total)})",
        fix="count the labels the loss is taken over, and only those (padding excluded)",
    )


def _mean_finding(big: float, total: float, k: int) -> Finding:
    return Finding(
        module="loss_fn",
        problem=f"the loss is averaged, not summed: loss_fn returned {big:.6g} for the big "
        f"batch and {total:.6g} summed over the micro-batches, about k = {k} times more (a "
        "mean per batch, where Accumulator expects the sum over valid tokens and divides by "
        "the window's N itself; it cannot tell the two apart, and the update comes out about "
        "as many times too small as a micro-batch has tokens)",
        fix="return the loss summed over valid tokens (reduction='sum'), not the model's mean "
        "loss; for Hugging Face models use gradaccum.hf.loss_fn",
    )


def suspects(model: nn.Module) -> list[str]:
    """Names of the modules that look like routers or auxiliary losses, in the model's order."""
    return [
        name
        for name, module in model.named_modules()
        if name and any(w in f"{name} {type(module).__name__}".lower() for w in _AUX_WORDS)
    ]


def _aux_finding(model: nn.Module, big: float, total: float) -> Finding:
    names = suspects(model)
    mismatch = f"big batch {big:.6g}, micro-batches {total:.6g}"
    if moe_spec(model) is not None:  # the model's own load-balancing loss, per forward
        return Finding(
            module=names[0] if names else "loss_fn",
            problem=f"the loss does not add up over micro-batches ({mismatch}): the model's "
            "own mixture-of-experts load-balancing loss is computed once per forward, so it "
            "is counted once per micro-batch and balances each micro-batch on its own tokens",
            fix="leave it out of loss_fn (the cross-entropy summed over tokens) and let "
            "gradaccum add it over the window: gradaccum.moe.Balance(model, 'global'), or "
            "--moe-balance global",
        )
    return Finding(
        module=names[0] if names else "loss_fn",
        problem=f"a term of the loss does not add up over micro-batches ({mismatch}): an "
        "auxiliary loss computed once per batch is counted once per micro-batch",
        fix="scale per-batch terms by the micro-batch's tokens (loss_sum + aux * num_tokens), "
        "so that the window's 1/N turns them into a token-weighted mean",
    )


def no_gradient(model: nn.Module, ref: Reference) -> list[Finding]:
    """Parameters that require grad but got none from the big batch's backward."""
    out = []
    for (name, _), g in zip(trainable(model), ref.grads, strict=True):
        if g is None:
            out.append(
                Finding(
                    module=name,
                    problem="receives no gradient from this loss",
                    fix="freeze it (requires_grad_(False)) or remove it; under DDP it would "
                    "need find_unused_parameters=True",
                    severity="warning",
                )
            )
    return out
