"""The check of `gradaccum verify --task grpo` on its window (`verification.grpo`): per loss
type, the window through `Accumulator` against one float64 big batch whose loss is written out
here from the formulas of `gradaccum.rl`'s docstring (not through its code), and the mistakes
users hit, on the same completions through the same engine (`MISTAKES`; described in
`verification.grpo`)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from gradaccum import rl
from gradaccum.engine.precision import is_low_precision
from gradaccum.verification.check import TOLERANCES
from gradaccum.verification.grpo import GRPOWindow, logprobs
from gradaccum.verification.grpo_ranks import ranks_grads
from gradaccum.verification.lint import quiet_rng
from gradaccum.verification.reference import engine_grads, max_rel_error, trainable
from gradaccum.verification.report import check_row, verdict

__all__ = ["MISTAKES", "LossCheck", "check_grpo", "checks_verdict", "reference_grads"]

MISTAKES = {
    "per_micro_batch_over_k": "each micro-batch over its own count, then / k",
    "window_over_k_again": "the window's count, divided by k once more",
    "group_split": "groups cut by micro-batches, advantages per part",
}
"""The mistakes checked, in words (the table's column heads explain them)."""


# ---- the reference: the loss written out, in float64 ------------------------------------------


def reference_grads(model64, batch: dict, loss_types: tuple[str, ...], objective: dict) -> dict:
    """{loss type: the window's gradient} in float64 on `model64` (a float64 model), every
    completion in one batch, one forward: per token l = -min(r A, clip(r, 1 - eps, 1 + eps_high)
    A) + beta k3, r = 1 on-policy (exp(logp - logp), the second held constant), summed per
    completion, normalised over the whole window as each loss type says (`gradaccum.rl`)."""
    eps, high, beta = objective["epsilon"], objective["epsilon_high"], objective["beta"]
    high = eps if high is None else high
    logp = logprobs(model64, batch["input_ids"], objective["temperature"])
    mask = batch["completion_mask"].double()
    adv = batch["advantages"].double()[:, None]
    ratio = torch.exp(logp - logp.detach())
    per_token = -torch.minimum(ratio * adv, torch.clamp(ratio, 1 - eps, 1 + high) * adv)
    if beta:
        diff = batch["ref_logprobs"].double() - logp
        per_token = per_token + beta * (torch.exp(diff) - diff - 1)
    per_completion = (per_token * mask).sum(1)
    completions = mask.shape[0]
    losses = {
        "grpo": (per_completion / mask.sum(1)).sum() / completions,
        "bnpo": per_completion.sum() / mask.sum(),
        "dapo": per_completion.sum() / mask.sum(),
        "dr_grpo": per_completion.sum() / (completions * objective["max_completion_length"]),
    }
    params = [p for _, p in trainable(model64)]
    return {
        name: list(torch.autograd.grad(losses[name], params, allow_unused=True, retain_graph=True))
        for name in loss_types
    }


# ---- the check --------------------------------------------------------------------------------


@dataclass
class LossCheck:
    """One loss type's errors against the float64 big batch (max relative error, per
    parameter, `reference.max_rel_error`)."""

    loss_type: str
    ours: float
    """The window through `Accumulator` with `rl.counter` and `rl.PolicyLoss`."""
    tolerance: float
    mistakes: dict[str, float] = field(default_factory=dict)
    """The error of each of MISTAKES."""
    counts: list[int] = field(default_factory=list)
    """What each micro-batch holds of the count this loss type divides by (`rl.window_count`):
    completions, completion tokens, or completions x max_completion_length."""
    ranks: float | None = None
    """With --world-size N: the error of the window dealt to N gloo ranks under DDP
    (`grpo_ranks`); None on one process."""
    world_size: int = 1
    """The ranks of `ranks`."""

    @property
    def passed(self) -> bool:
        return self.ours <= self.tolerance and (self.ranks is None or self.ranks <= self.tolerance)


def check_grpo(
    model, window: GRPOWindow, loss_types: tuple[str, ...], objective: dict, precision: str,
    seed: int, reference_model=None, world_size: int = 1,
) -> list[LossCheck]:  # fmt: skip
    """Each loss type's `LossCheck` on `window` (module docstring). objective: epsilon,
    epsilon_high, beta, max_completion_length and temperature. reference_model: what the
    float64 big batch runs on where `model` cannot be cast (a quantised base's dequantised copy
    with the same adapters); its trainable parameters are `model`'s, in order. world_size
    above 1: the window on that many gloo ranks too (`grpo_ranks`), micro-batches of the
    window's largest. `model` is not changed."""
    prepared = copy.deepcopy(model)
    quiet_rng(prepared)
    model64 = torch.nn.Module.to(copy.deepcopy(reference_model or prepared), torch.float64)
    quiet_rng(model64)
    options = {"precision": precision}
    if any(is_low_precision(p.dtype) for _, p in trainable(prepared)):
        options["master_weights"] = True
    wants = reference_grads(model64, window.batch, loss_types, objective)
    checks = [
        _check_one(prepared, window, name, objective, wants[name], seed, options)
        for name in loss_types
    ]
    if world_size > 1:
        got = ranks_grads(prepared, window, world_size, max(window.sizes), loss_types,
                          objective, options, seed)  # fmt: skip
        for check in checks:
            check.ranks = max_rel_error(got[check.loss_type], wants[check.loss_type])
            check.world_size = world_size
    return checks


def _check_one(model, window: GRPOWindow, loss_type: str, objective: dict, want, seed: int,
               options: dict) -> LossCheck:  # fmt: skip
    most = objective["max_completion_length"]
    loss_fn = rl.PolicyLoss(loss_type, objective["epsilon"], objective["epsilon_high"],
                            objective["beta"], most, objective["temperature"])  # fmt: skip
    run = {"seed": seed, "count_tokens": rl.counter(loss_type, most), **options}
    micro = window.micro_batches()
    k = len(micro)

    def error(batches, fn=loss_fn, **how) -> float:
        got, _ = engine_grads(model, [batches], fn, **run, **how)
        return max_rel_error(got, want)

    def over_k(policy, batch):
        loss_sum, count = loss_fn(policy, batch)
        return loss_sum / k, count

    order, advantages = _split_groups(window)
    mistakes = {
        "per_micro_batch_over_k": error(micro, normalize="micro_batch_mean"),
        "window_over_k_again": error(micro, over_k),
        "group_split": error(window.micro_batches(order, advantages), normalize="micro_batch_mean"),
    }
    counts = [rl.window_count(b["completion_mask"], loss_type, most) for b in micro]
    return LossCheck(loss_type, error(micro), TOLERANCES[options["precision"]], mistakes, counts)


def _split_groups(window: GRPOWindow) -> tuple[list[int], torch.Tensor]:
    """The window rotated by G/2 completions (so micro-batch boundaries fall inside groups), and
    the advantages (C,) each completion gets from the part of its group in its micro-batch."""
    G, total = window.num_generations, len(window.lengths)
    half = G // 2
    order = list(range(half, total)) + list(range(half))
    advantages = torch.zeros(total)
    start = 0
    for size in window.sizes:
        rows = order[start : start + size]
        start += size
        for group in sorted({i // G for i in rows}):
            part = [i for i in rows if i // G == group]
            got = rl.group_advantages(window.rewards[part], len(part), window.scale_rewards)
            advantages[part] = got.to(advantages.dtype)
    return order, advantages


def checks_verdict(checks: list[LossCheck]) -> dict:
    """`report.verdict` over the loss types: passed, and the worst one's error and tolerance."""
    return verdict([check_row(c.loss_type, c.ours, c.tolerance) for c in checks])
