"""`gradaccum verify`: accumulation against the big batch on a model, with the usual mistakes
for contrast, what breaks equivalence, and optionally N ranks and the precision study.

Exit 0 when the check passes, 1 when it fails (a finding, not an error), 2 on bad input.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass

from ..plan.sizes import parse_count
from ..utils.errors import BadInput
from .common import print_json

BUILTIN_VOCAB = 256
W = 66  # width of the label column of the tables
_MODEL_PRESETS = ("tiny", "small", "gpt2-124m")
DEFAULT_PLOT = "precision_study.png"

MAX_SEQ_LEN = 4096
"""Longest --seq-len, in tokens. Verify's float64 big batch costs about the square of the
length: k 4 x 4 sequences took 10 s at 1024 tokens, 50 s at 2048 and 262 s at 4096 on 2 CPU
cores (tiny preset); at the same growth 8192 would take about 20 minutes."""
PROGRESS_TOKENS = 16_384
"""Windows above this many tokens (k x micro-batch x seq-len; 10 s measured at 4 x 4 x 1024)
say what verify does, step by step, on stderr."""
RANK_BYTES_PER_PARAMETER = 48
"""Memory of one rank of --world-size per model parameter, in bytes: 12 fp32 copies (the
parameters, their gradients, DDP's bucket, AdamW's two moments, and what rank 0 records for
the comparison: the parameters before each of the 2 windows and after, the 2 gradients,
and the copy that carries them back)."""

_EPILOG = """\
The built-in check: a GPT of the chosen preset on token sequences of random lengths (micro-
batches padded to their longest row). Examples:
  gradaccum verify
  gradaccum verify --model-config path/to/config.json --k 8 --precision bf16
  gradaccum verify --world-size 2          # also DDP and FSDP2 over 2 gloo processes on CPU
  gradaccum verify --precision-study --plot study.png
"""


def add_parser(sub, name: str) -> None:
    p = sub.add_parser(
        name,
        help="prove accumulated gradients equal the big-batch gradient on a model",
        description="One window through the engine against the same data as one big batch.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    model = p.add_argument_group("model (one of)")
    model.add_argument("--model", help=f"built-in GPT: {', '.join(_MODEL_PRESETS)} (tiny)")
    model.add_argument("--model-config", metavar="PATH", help="a Hugging Face causal LM config")
    data = p.add_argument_group("the window")
    data.add_argument("--k", default="4", metavar="K", help="micro-batches in the window (4)")
    data.add_argument("--micro-batch", default="4", metavar="N", help="sequences each (4)")
    data.add_argument(
        "--seq-len",
        default="64",
        metavar="N",
        help=f"longest sequence (64; at most {MAX_SEQ_LEN}: the float64 big batch costs about "
        "the square of it; k x micro-batch x seq-len must also fit the available memory at "
        "about 8 bytes x (18 x layers x width + 3 x vocab) per token)",
    )
    data.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"))
    data.add_argument("--seed", default="0", metavar="N", help="data and weights (0)")
    more = p.add_argument_group("more checks")
    more.add_argument(
        "--world-size",
        default="1",
        metavar="N",
        help="also N gloo ranks (DDP, FSDP2); at most 4 per CPU core, and as many as the "
        "available memory holds at 0.3 GB plus 48 bytes per model parameter each",
    )
    more.add_argument("--precision-study", action="store_true", help="k = 1..K-MAX, per precision")
    more.add_argument("--k-max", default="1024", metavar="K", help="largest k of the study (1024)")
    more.add_argument(
        "--plot",
        metavar="PATH",
        help=f"the study's PNG ({DEFAULT_PLOT}); only with --precision-study",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(run=run)


def _count(args, name: str, allow_zero: bool = False) -> int:
    return parse_count(getattr(args, name), "--" + name.replace("_", "-"), allow_zero=allow_zero)


def parse_sizes(args) -> dict:
    sizes = {
        name: _count(args, name) for name in ("k", "micro_batch", "seq_len", "world_size", "k_max")
    }
    sizes["seed"] = _count(args, "seed", allow_zero=True)
    if sizes["seq_len"] < 2:
        raise BadInput("--seq-len", sizes["seq_len"], "must be at least 2 (one input, one target)")
    if sizes["seq_len"] > MAX_SEQ_LEN:
        raise BadInput(
            "--seq-len",
            sizes["seq_len"],
            f"at most {MAX_SEQ_LEN}: verify's float64 big batch costs about the square of the "
            "length (k 4 x 4 sequences of 4096 tokens took 262 s on 2 CPU cores)",
        )
    if sizes["k_max"] & (sizes["k_max"] - 1) or sizes["k_max"] > 1024:
        raise BadInput("--k-max", sizes["k_max"], "must be a power of two, at most 1024")
    if args.model_config is not None and args.model is not None:
        raise BadInput("--model", args.model, "give --model or --model-config, not both")
    args.model = args.model or "tiny"
    if args.model_config is None and args.model not in _MODEL_PRESETS:
        raise BadInput(
            "--model", args.model, f"unknown preset; choose one of {', '.join(_MODEL_PRESETS)}"
        )
    if args.model_config is not None and not os.path.exists(args.model_config):
        raise BadInput("--model-config", args.model_config, "no such file")
    _check_plot(args)
    return sizes


def _check_plot(args) -> None:
    """--plot only with --precision-study, onto a file in a folder that exists: checked
    before the study runs (1024 windows at the default --k-max), not after it."""
    if args.plot is not None and not args.precision_study:
        raise BadInput("--plot", args.plot, "needs --precision-study (the plot is the study's)")
    if not args.precision_study:
        return
    args.plot = args.plot or DEFAULT_PLOT
    folder = os.path.dirname(os.path.abspath(args.plot))
    if os.path.isdir(args.plot):
        raise BadInput("--plot", args.plot, "is a folder; give a file name such as study.png")
    if not os.path.isdir(folder):
        raise BadInput("--plot", args.plot, f"no folder {folder} to write it in")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise BadInput("--plot", args.plot, f"folder {folder} is not writable")


# ---- models (module-level and picklable: the ranks of --world-size build them too) ----------


def builtin_gpt(seed: int, preset: str, vocab_size: int, seq_len: int):
    """The built-in GPT of a preset, seeded."""
    import torch

    from ..models.gpt import build_model

    torch.manual_seed(seed)
    return build_model(preset=preset, vocab_size=vocab_size, seq_len=seq_len)[0]


def hf_causal_lm(seed: int, path: str):
    """A Hugging Face causal LM from its config, random weights, seeded, dropout off (the
    ranks and the single process would draw different masks; see `gradaccum.verification.lint.quiet_rng`)."""
    import torch

    from ..models.gpt import build_model
    from ..verification.lint import quiet_rng

    torch.manual_seed(seed)
    model = build_model(config_path=path)[0]
    quiet_rng(model)
    return model


@dataclass
class _Case:
    """The model under check and how to feed it."""

    model: object
    description: str
    vocab_size: int
    factory: Callable
    loss_fn: Callable
    count_tokens: Callable | str
    shifted: bool
    info: object
    """The model's `ModelInfo` (parameters, layers, width, vocabulary)."""


def build_case(args, sizes: dict) -> _Case:
    from .. import hf, testing
    from ..models.gpt import build_model

    seed, seq_len = sizes["seed"], sizes["seq_len"]
    try:
        if args.model_config is not None:
            model, info = build_model(config_path=args.model_config, seq_len=seq_len)
            factory = functools.partial(hf_causal_lm, path=args.model_config)
            loss_fn, count, shifted = hf.loss_fn, hf.count_tokens, False
        else:
            model, info = build_model(preset=args.model, vocab_size=BUILTIN_VOCAB, seq_len=seq_len)
            factory = functools.partial(
                builtin_gpt, preset=args.model, vocab_size=BUILTIN_VOCAB, seq_len=seq_len
            )
            loss_fn, count, shifted = testing.token_loss, "auto", True
    except BadInput:
        raise
    except ValueError as err:  # the model's own one-line reason, naming the flag
        raise BadInput(str(err)) from None
    model.load_state_dict(factory(seed).state_dict())  # the seeded weights the ranks build
    words = f"{info.source} ({info.params:,} parameters)"
    return _Case(model, words, info.vocab_size, factory, loss_fn, count, shifted, info)


def reference_bytes(tokens: int, info) -> int:
    """Peak memory of verify on a window of `tokens` positions, in bytes: 8 bytes x (18 x
    layers x width + 3 x vocab) per token, what the float64 big batch keeps for backward
    (fitted to the whole run's peak on the tiny preset: 2.6 GB at 4 x 4 x 2048 tokens,
    4.9 GB at 4 x 4 x 4096, 66 kB a token against the 80 kB this gives)."""
    return 8 * tokens * (18 * info.layers * info.hidden + 3 * info.vocab_size)


def _gb(n: float) -> str:
    return f"{n / 1e9:.3g}" if n < 1e12 else f"{n / 1e9:,.0f}"


def _check_fits(case: _Case, sizes: dict) -> None:
    """The window's float64 reference and the ranks of --world-size must fit this machine:
    refused here, before any of the work."""
    from ..verification.ranks import available_memory_bytes, rank_capacity

    k, rows, seq = sizes["k"], sizes["micro_batch"], sizes["seq_len"]
    need, available = reference_bytes(k * rows * seq, case.info), available_memory_bytes()
    if available is not None and need > available:
        per_token = reference_bytes(1, case.info)
        raise BadInput(
            f"--k {k} x --micro-batch {rows} x --seq-len {seq}: verify's float64 big batch "
            f"of {k * rows * seq:,} tokens needs about {_gb(need)} GB "
            f"({per_token / 1e3:.0f} kB a token for this model), {_gb(available)} GB "
            f"available; at most {available // per_token:,} tokens here"
        )
    world = sizes["world_size"]
    limit, rule = rank_capacity(RANK_BYTES_PER_PARAMETER * case.info.params)
    if world > limit:
        raise BadInput(
            "--world-size", world, f"more ranks than this machine holds; at most {limit}: {rule}"
        )


def run(args) -> int:
    from ..verification.check import sample_batches, verify

    sizes = parse_sizes(args)
    case = build_case(args, sizes)
    _check_fits(case, sizes)
    progress = _progress(sizes)
    batches = sample_batches(
        sizes["k"],
        sizes["micro_batch"],
        sizes["seq_len"],
        case.vocab_size,
        sizes["seed"],
        case.shifted,
    )
    report = verify(
        case.model,
        batches,
        case.loss_fn,
        precision=args.precision,
        count_tokens=case.count_tokens,
        seed=sizes["seed"],
        progress=progress,
    )
    if sizes["world_size"] > 1 and progress is not None:
        progress(f"{sizes['world_size']} gloo ranks, DDP and FSDP2, against one process")
    world = _world(case, sizes) if sizes["world_size"] > 1 else []
    study = _study(case, sizes, args) if args.precision_study else None
    passed = report.passed and all(w["passed"] for w in world)
    if args.json:
        out = {**report.to_dict(), "passed": passed, "world": world}
        if study is not None:
            out.update(study)
        print_json(out)
    else:
        print(render(case.description, sizes, report, world, study))
    return 0 if passed else 1


def _progress(sizes: dict) -> Callable[[str], None] | None:
    """A printer of verify's steps on stderr for a window above PROGRESS_TOKENS, else None."""
    import sys

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


def world_setups(case: _Case, sizes: dict) -> list:
    """What --world-size checks: DDP and FSDP2, k micro-batches per rank, 2 windows."""
    from ..testing import EquivalenceSetup

    return [
        EquivalenceSetup(
            world_size=sizes["world_size"],
            wrapper=wrapper,
            accum_steps=sizes["k"],
            steps=2,
            seed=sizes["seed"],
            vocab_size=case.vocab_size,
            seq_len=sizes["seq_len"],
        )
        for wrapper in ("ddp", "fsdp2")
    ]


def _world(case: _Case, sizes: dict) -> list[dict]:
    """DDP and FSDP2 over N gloo ranks on CPU against one process (gradaccum.testing), in
    one start of the ranks."""
    from ..testing import check_equivalences

    reports = check_equivalences(
        case.factory,
        world_setups(case, sizes),
        timeout_s=600.0,
        loss_fn=case.loss_fn,
        count_tokens=case.count_tokens,
        rank_bytes=RANK_BYTES_PER_PARAMETER * case.info.params,
    )
    return [world_row(r) for r in reports]


def world_row(report) -> dict:
    """One wrapper's line of the --world-size check, as --json prints it."""
    return {
        "wrapper": report.setup.wrapper,
        "world_size": report.setup.world_size,
        "passed": report.passed,
        "grad_rel_err": report.grad_rel_error,
        "loss_rel_err": report.loss_rel_error,
        "step_err": report.step_error,
        "tolerance": report.setup.tolerance,
        "step_tolerance": report.step_tolerance,
        "steps": report.steps,
        "windows": report.windows,
        "tokens": report.tokens,
        "tokens_expected": report.tokens_expected,
        "reference": report.reference,
    }


def _study(case: _Case, sizes: dict, args) -> dict:
    import sys

    from ..verification.check import TOLERANCES, sample_batches
    from ..verification.precision_study import derive_tolerances, precision_study, write_plot

    batches = sample_batches(
        sizes["k_max"], 1, sizes["seq_len"], case.vocab_size, sizes["seed"] + 1, case.shifted
    )

    def progress(k: int) -> None:
        if not args.json:
            print(f"  precision study: k = {k} done", file=sys.stderr, flush=True)

    points = precision_study(
        case.model,
        batches,
        case.loss_fn,
        count_tokens=case.count_tokens,
        seed=sizes["seed"],
        progress=progress,
    )
    written = write_plot(points, args.plot, title=f"window gradient error: {case.description}")
    return {
        "precision_study": [asdict(p) for p in points],
        "tolerances_derived": derive_tolerances(points),
        "tolerances_applied": dict(TOLERANCES),
        "plot": os.path.abspath(args.plot) if written else None,
    }


# ---- the table for people -------------------------------------------------------------------


def render(description: str, sizes: dict, report, world: list[dict], study: dict | None) -> str:
    """The whole human-readable output."""
    from ..verification.check import TOLERANCE_SOURCE

    verdict = "PASS" if report.passed else "FAIL"
    lines = [
        f"gradaccum verify: {description}",
        f"window: k = {report.micro_steps} micro-batches of {sizes['micro_batch']} sequences "
        f"(ragged, up to {sizes['seq_len']} tokens), {report.tokens:,} valid tokens, "
        f"{report.precision}; reference: one big batch in {report.reference}",
        "",
        f"  {'':<{W}}{'max rel err':>12}",
        f"  {'accumulated (gradaccum)':<{W}}{report.max_rel_err:>12.2e}   {verdict}",
        f"  tolerance {report.tolerance:g} ({TOLERANCE_SOURCE})",
        f"  cosine min {report.cosine_min:.9f}, max abs err {report.max_abs_err:.2e}; "
        f"after one AdamW step (lr 1e-3) max |p - p_big| {report.param_max_abs_err:.2e}",
        "",
        *_render_ways(report),
        "",
        *_render_lint(report),
        *_render_world(world),
        *(_render_study(study) if study is not None else []),
    ]
    return "\n".join(lines)


def _render_ways(report) -> list[str]:
    from ..verification.check import WRONG_WAYS

    lines = [f"  {'the usual mistakes, same data, same engine':<{W}}{'max rel err':>12}"]
    for name, words in WRONG_WAYS.items():
        err = report.wrong_ways.get(name)
        shown = "n/a" if err is None or not math.isfinite(err) else f"{err:.2e}"
        lines.append(f"  {words:<{W}}{shown:>12}")
    worst = sorted(report.params, key=lambda p: -p.rel_err)[:3]
    lines.append("  worst parameters: " + ", ".join(f"{p.name} {p.rel_err:.1e}" for p in worst))
    return lines


def _render_lint(report) -> list[str]:
    if not report.lint and not report.notes:
        return ["  lint: nothing breaks equivalence in this model"]
    lines = ["  lint:"]
    for f in report.lint:
        lines += [f"  [{f.severity}] {f.module}: {f.problem}", f"      fix: {f.fix}"]
    lines += [f"  note: {note}" for note in report.notes]
    return lines


def _render_world(world: list[dict]) -> list[str]:
    if not world:
        return []
    first = world[0]
    title = f"{first['world_size']} gloo ranks on CPU against one process, per window"
    lines = ["", f"  {title:<{W - 12}}{'grad rel err':>12}{'step err':>12}"]
    for w in world:
        verdict = "PASS" if w["passed"] else "FAIL"
        label = f"{w['wrapper']} ({w['steps']} steps, {w['windows']} windows)"
        lines.append(
            f"  {label:<{W - 12}}{w['grad_rel_err']:>12.2e}{w['step_err']:>12.2e}   {verdict}"
        )
    lines += [
        f"  each window from the ranks' parameters: gradient and loss within {first['tolerance']:g}"
        f" of a {first['reference']} big batch;",
        f"  its AdamW step within {first['step_tolerance']:g} x (|p| + lr) of a float64 step with "
        "that gradient (fp32 rounding, x 4)",
    ]
    return lines


def _render_study(study: dict) -> list[str]:
    from ..verification.precision_study import StudyPoint, study_table

    points = [StudyPoint(**p) for p in study["precision_study"]]
    derived = ", ".join(f"{k} {v:g}" for k, v in study["tolerances_derived"].items())
    applied = ", ".join(f"{k} {v:g}" for k, v in study["tolerances_applied"].items())
    lines = ["", "  precision study: relative error of the whole gradient against float64"]
    lines += ["  " + row for row in study_table(points).splitlines()]
    lines.append(f"  tolerances derived on this model (largest x 4, rounded up): {derived}")
    lines.append(f"  tolerances verify applies: {applied}")
    lines.append(f"  plot: {study['plot'] or 'not written (matplotlib not installed)'}")
    return lines
