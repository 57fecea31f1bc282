"""`gradaccum verify` once its flags are read (`cli/verify.py`): the case
(`verification.cases`), what fits (`verification.budget`), the engine against the big batch,
the ranks and the precision study, the table or JSON (`verification.render`)."""

from __future__ import annotations

import sys
from collections.abc import Callable

from gradaccum.cli.common import print_json
from gradaccum.cli.verify import parse_sizes
from gradaccum.settings.command import namespace
from gradaccum.train.tasks.registry import rules_of
from gradaccum.utils.choices import LOSS_TYPES
from gradaccum.verification.budget import check_fits
from gradaccum.verification.cases import (
    build_case,
    check_beyond_window,
    moe_mode,
    previous_window,
    sample,
    sft_examples,
    study,
    world_check,
)
from gradaccum.verification.check import verify
from gradaccum.verification.grpo import OBJECTIVE, grpo_case
from gradaccum.verification.grpo_check import check_grpo
from gradaccum.verification.grpo_render import grpo_json, render_grpo
from gradaccum.verification.render import all_checks, render, report_json, world_row

PROGRESS_TOKENS = 16_384
"""Windows above this many tokens (k x micro-batch x seq-len; 10 s measured at 4 x 4 x 1024)
say what verify does, step by step, on stderr."""

__all__ = ["run"]


def run(args) -> int:
    args = namespace(args)
    sizes = parse_sizes(args)
    rules = rules_of(args.task)
    if rules.takes_rl:
        return _run_grpo(args, sizes)
    case = build_case(args, sizes)
    moe = moe_mode(args, case)
    check_fits(case.info, sizes)
    check_beyond_window(case, sizes, args.precision_study)
    progress = _progress(sizes)
    seed = sizes["seed"]
    window = sft_examples(args, case, sizes, seed) if rules.counts_examples else None
    batches = window.micro_batches if window is not None else sample(case, sizes, seed)
    previous = previous_window(args, case, sizes) if moe == "global-previous" else None
    report = verify(
        case.model,
        batches,
        case.loss_fn,
        precision=case.precision,
        count_tokens=case.count_tokens,
        big_batch=window.big_batch if window is not None else None,
        seed=seed,
        progress=progress,
        moe_balance=moe,
        moe_shift=not case.shifted,
        previous_window=previous,
        reference_model=case.reference,
    )
    if sizes["world_size"] > 1 and progress is not None:
        progress(
            f"{sizes['world_size']} gloo ranks, DDP (window) and FSDP2 ({sizes['sync']}), "
            "against one process"
        )
    world = [world_row(r) for r in world_check(case, sizes, moe)] if sizes["world_size"] > 1 else []
    studied = None
    if args.precision_study:
        studied = study(case, sizes, args.plot, None if args.json else _study_progress)
    passed = all(check["passed"] for check in all_checks(report, world))
    if args.json:
        print_json(report_json(report, world, args.task, window, studied, case.adapters))
    else:
        print(render(case.description, sizes, report, world, studied, window, case.adapters))
    return 0 if passed else 1


def _run_grpo(args, sizes: dict) -> int:
    """--task grpo (`verification.grpo`): the window sampled, each loss type checked against
    the float64 big batch with the mistakes beside it."""
    case, window = grpo_case(args, sizes)
    objective = {name: getattr(args, name) for name in OBJECTIVE}
    loss_types = LOSS_TYPES if args.loss_type is None else (args.loss_type,)
    if sizes["world_size"] > 1 and not args.json:
        print(f"verify: the window on {sizes['world_size']} gloo ranks too (DDP)",
              file=sys.stderr, flush=True)  # fmt: skip
    checks = check_grpo(case.model, window, loss_types, objective, case.precision,
                        sizes["seed"], case.reference, sizes["world_size"])  # fmt: skip
    shown = (case.description, window, checks, case.precision, objective, case.adapters)
    if args.json:
        print_json(grpo_json(*shown))
    else:
        print(render_grpo(*shown))
    return 0 if all(c.passed for c in checks) else 1


def _progress(sizes: dict) -> Callable[[str], None] | None:
    """A printer of verify's steps on stderr for a window above PROGRESS_TOKENS, else None."""
    tokens = sizes["k"] * sizes["micro_batch"] * sizes["seq_len"]
    if tokens <= PROGRESS_TOKENS:
        return None
    print(
        f"verify: a window of {sizes['k']} x {sizes['micro_batch']} sequences of up to "
        f"{sizes['seq_len']} tokens ({tokens:,} positions): the float64 big batch, the engine, "
        "the usual mistakes and the lint each run it whole",
        file=sys.stderr,
        flush=True,
    )
    return lambda step: print(f"  verify: {step}", file=sys.stderr, flush=True)


def _study_progress(k: int) -> None:
    print(f"  precision study: k = {k} done", file=sys.stderr, flush=True)
