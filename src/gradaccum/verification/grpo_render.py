"""The output of `gradaccum verify --task grpo`: the table for people and the dict --json prints
(`verification.grpo`'s window and checks)."""

from __future__ import annotations

from gradaccum.verification.check import TOLERANCE_SOURCE
from gradaccum.verification.grpo import LENGTH_SPREAD, GRPOWindow
from gradaccum.verification.grpo_check import MISTAKES, LossCheck, checks_verdict
from gradaccum.verification.qlora import Adapters

SHOWN = 6
"""Micro-batches whose counts the table lists one by one; more are given as a range."""
COLUMNS = {"per_micro_batch_over_k": "per-mb / k", "window_over_k_again": "window / k again",
           "group_split": "group split"}  # fmt: skip
"""The table's head of each mistake (MISTAKES)."""
UNITS = {"grpo": "completions", "bnpo": "tokens", "dapo": "tokens", "dr_grpo": "completions x L"}
"""What each loss type's count is of (`rl.window_count`)."""


def grpo_json(description: str, window: GRPOWindow, checks: list[LossCheck], precision: str,
              objective: dict, adapters: Adapters | None = None) -> dict:  # fmt: skip
    """What --json prints: the verdict (`report.verdict`: passed, the worst loss type's
    max_rel_err and tolerance), the window's counts, and per loss type our error, each
    mistake's and the counts each micro-batch holds."""
    out = {
        "task": "grpo",
        **checks_verdict(checks),
        "model": description,
        "precision": precision,
        "reference": "float64",
        "window": window_dict(window, objective),
        "loss_types": {
            c.loss_type: {
                "max_rel_err": c.ours,
                "tolerance": c.tolerance,
                "passed": c.passed,
                "counts": c.counts,
                "wrong_ways": dict(c.mistakes),
                **_ranks_json(c),
            }
            for c in checks
        },
    }
    if adapters is not None:
        out["lora"] = adapters.to_dict()
        q = adapters.quantization
        out["quantization"] = None if q is None else q.to_dict()
    return out


def _ranks_json(check: LossCheck) -> dict:
    """With --world-size: the ranks and their error, for --json; nothing on one process."""
    if check.ranks is None:
        return {}
    return {"world_size": check.world_size, "ranks_max_rel_err": check.ranks}


def _ranks_lines(ranks: int | None, micro_batch: int) -> list[str]:
    if not ranks:
        return []
    return [
        f"  {ranks} ranks: prompt j's group on rank j mod {ranks} (as train deals them), "
        f"micro-batches of up to {micro_batch} completions, DDP, the count over the ranks"
    ]


def window_dict(window: GRPOWindow, objective: dict) -> dict:
    """The window's counts and settings for --json (no tensors)."""
    return {
        "prompts": len(window.prompt_lengths),
        "num_generations": window.num_generations,
        "completions": len(window.lengths),
        "micro_batches": list(window.sizes),
        "prompt_lengths": list(window.prompt_lengths),
        "sampled_lengths": list(window.sampled_lengths),
        "completion_lengths": list(window.lengths),
        "lengths_cut": window.cut,
        "length_spread": window.spread,
        "rewards": [float(r) for r in window.rewards],
        "scale_rewards": "group" if window.scale_rewards else "none",
        "ref_noise": window.ref_noise,
        "tokenizer": window.tokenizer,
        **objective,
    }


def render_grpo(description: str, window: GRPOWindow, checks: list[LossCheck], precision: str,
                objective: dict, adapters: Adapters | None = None) -> str:  # fmt: skip
    """The whole human-readable output."""
    passed = all(c.passed for c in checks)
    tolerance = checks[0].tolerance
    k, G = len(window.sizes), window.num_generations
    ranks = checks[0].world_size if checks[0].ranks is not None else None
    head = f"  {'loss type':<11}{'counts per micro-batch':<34}{'gradaccum':>10}      "
    head += f"{f'{ranks} ranks':>12}      " if ranks else ""
    head += "".join(f"{COLUMNS[name]:>18}" for name in MISTAKES)
    lines = [
        f"gradaccum verify: {description}",
        *([f"adapters: {adapters.lora.describe()}"] if adapters is not None else []),
        *_window_lines(window, objective, precision),
        "",
        f"  {'':<45}{'max rel err against the float64 big batch'}",
        head,
    ]
    for c in checks:
        verdict = "PASS" if c.passed else "FAIL"
        row = f"  {c.loss_type:<11}{_counts(c):<34}{c.ours:>10.2e}  {verdict}"
        if ranks:
            row += f"{c.ranks:>12.2e}  {'PASS' if c.ranks <= c.tolerance else 'FAIL'}"
        lines.append(row + "".join(f"{c.mistakes[name]:>18.2e}" for name in MISTAKES))
    lines += [
        f"  tolerance {tolerance:g} ({TOLERANCE_SOURCE})",
        *_ranks_lines(ranks, max(window.sizes)),
        "",
        "  the mistakes, on the same completions through the same engine:",
        "    per-mb / k: each micro-batch normalised by its own count, the sum divided by k "
        "(TRL's grpo, bnpo, dr_grpo);",
        "      right only where every micro-batch holds as much of the count as every other",
        f"    window / k again: the window's count, then divided by k once more (ms-swift "
        f"10117): 1 - 1/k = {1 - 1 / k:.4g}",
        f"    group split: micro-batch boundaries moved by G/2 = {G // 2} completions, cutting "
        "groups; advantages within each part,",
        "      normalised per micro-batch, / k",
        "",
        f"{'PASS' if passed else 'FAIL'}: "
        + ("every" if passed else "not every")
        + f" loss type's accumulated gradient within {tolerance:g} of the float64 big batch",
    ]
    return "\n".join(lines)


def _window_lines(window: GRPOWindow, objective: dict, precision: str) -> list[str]:
    """The window in words: prompts, completions, their lengths, rewards and KL."""
    P, G, C = len(window.prompt_lengths), window.num_generations, len(window.lengths)
    lengths = f"completions of {_span(window.lengths)} tokens ({window.spread:.1f}x apart)"
    if window.cut:
        lengths += (
            f"; sampled {_span(window.sampled_lengths)}, less than {LENGTH_SPREAD}x apart, so "
            "each was cut to a length drawn from --seed"
        )
    elif window.spread < LENGTH_SPREAD:
        lengths += f": less than {LENGTH_SPREAD}x apart, the per-micro-batch mistakes stay small"
    scale = (
        "over the group's std" if window.scale_rewards else "centred only (--scale-rewards none)"
    )
    kl = "no KL term (--beta 0)"
    if objective["beta"]:
        kl = (
            f"KL (--beta {objective['beta']:g}) to the model with its weights moved by seeded "
            f"noise ({window.ref_noise:g} x each tensor's mean |w|)"
        )
    return [
        f"window: {P} built-in prompts x G = {G}: {C} completions sampled at temperature "
        f"{objective['temperature']:g}, at most {objective['max_completion_length']} tokens "
        f"({window.tokenizer}); k = {len(window.sizes)} micro-batches of "
        f"{_span(window.sizes)} completions; {precision}",
        lengths,
        f"rewards drawn from --seed, advantages {scale}; on-policy (ratio 1, the clip inactive); "
        + kl,
        "reference: every completion in one batch, float64, the loss written out",
    ]


def _counts(check: LossCheck) -> str:
    counts = check.counts
    shown = ", ".join(map(str, counts)) if len(counts) <= SHOWN else _span(counts)
    return f"{shown} {UNITS[check.loss_type]}"


def _span(values: list[int]) -> str:
    low, high = min(values), max(values)
    return str(low) if low == high else f"{low}..{high}"
