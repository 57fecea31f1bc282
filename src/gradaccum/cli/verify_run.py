"""`gradaccum verify` once its flags are read (`cli/verify.py`): the model under check, the
window, the engine against the big batch, the ranks and the precision study, the table or
JSON."""

from __future__ import annotations

import functools
import math
import os
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from .. import hf, testing
from ..data.tokenizers import ByteTokenizer
from ..models.build import build_model
from ..models.router import moe_spec
from ..testing import EquivalenceSetup, check_equivalences
from ..utils.errors import BadInput
from ..verification.check import (
    TOLERANCE_SOURCE,
    TOLERANCES,
    WRONG_WAYS,
    sample_batches,
    verify,
)
from ..verification.lint import quiet_rng
from ..verification.moe_check import check_mode
from ..verification.precision_study import (
    StudyPoint,
    derive_tolerances,
    precision_study,
    study_table,
    write_plot,
)
from ..verification.ranks import available_memory_bytes, rank_capacity
from ..verification.sft_window import SFTWindow, sft_window
from .common import print_json
from .verify import RANK_BYTES_PER_PARAMETER, parse_sizes

BUILTIN_VOCAB = 256
SFT_VOCAB = ByteTokenizer.vocab_size
"""--task sft: byte tokens and EOS (`gradaccum.data.tokenizers.ByteTokenizer`)."""
W = 66  # width of the label column of the tables
PROGRESS_TOKENS = 16_384
"""Windows above this many tokens (k x micro-batch x seq-len; 10 s measured at 4 x 4 x 1024)
say what verify does, step by step, on stderr."""

__all__ = ["build_case", "parse_sizes", "render", "run", "world_row", "world_setups"]


# ---- models (module-level and picklable: the ranks of --world-size build them too) ----------


def builtin_gpt(seed: int, preset: str, vocab_size: int, seq_len: int):
    """The built-in GPT of a preset, seeded."""
    torch.manual_seed(seed)
    return build_model(preset=preset, vocab_size=vocab_size, seq_len=seq_len)[0]


def hf_causal_lm(seed: int, path: str):
    """A Hugging Face causal LM from its config, random weights, seeded, dropout off (the
    ranks and the single process would draw different masks; see
    `gradaccum.verification.lint.quiet_rng`)."""
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
    seed, seq_len = sizes["seed"], sizes["seq_len"]
    sft = getattr(args, "task", "pretrain") == "sft"
    vocab = SFT_VOCAB if sft else BUILTIN_VOCAB
    try:
        if args.model_config is not None:
            model, info = build_model(config_path=args.model_config, seq_len=seq_len)
            factory = functools.partial(hf_causal_lm, path=args.model_config)
            loss_fn, count, shifted = hf.loss_fn, hf.count_tokens, False
        else:
            model, info = build_model(preset=args.model, vocab_size=vocab, seq_len=seq_len)
            factory = functools.partial(
                builtin_gpt, preset=args.model, vocab_size=vocab, seq_len=seq_len
            )
            loss_fn, count, shifted = testing.token_loss, "auto", True
    except BadInput:
        raise
    except ValueError as err:  # the model's own one-line reason, naming the flag
        raise BadInput(str(err)) from None
    if sft and info.vocab_size < SFT_VOCAB:
        raise BadInput(
            "--model-config",
            args.model_config,
            f"vocabulary of {info.vocab_size}; --task sft feeds byte tokens, ids up to "
            f"{SFT_VOCAB - 1}",
        )
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
    sizes = parse_sizes(args)
    case = build_case(args, sizes)
    moe = _moe_mode(args, case)
    _check_fits(case, sizes)
    progress = _progress(sizes)
    window = _sft(args, case, sizes, sizes["seed"]) if args.task == "sft" else None
    batches = window.micro_batches if window is not None else _sample(case, sizes, sizes["seed"])
    previous = None
    if moe == "global-previous":  # the window before, another draw of the same kind
        before = sizes["seed"] + 1
        sft = window is not None
        previous = _sft(args, case, sizes, before).micro_batches if sft else None
        previous = previous or _sample(case, sizes, before)
    report = verify(
        case.model,
        batches,
        case.loss_fn,
        precision=args.precision,
        count_tokens=case.count_tokens,
        big_batch=window.big_batch if window is not None else None,
        seed=sizes["seed"],
        progress=progress,
        moe_balance=moe,
        moe_shift=not case.shifted,
        previous_window=previous,
    )
    if sizes["world_size"] > 1 and progress is not None:
        progress(f"{sizes['world_size']} gloo ranks, DDP and FSDP2, against one process")
    world = _world(case, sizes, moe) if sizes["world_size"] > 1 else []
    study = _study(case, sizes, args) if args.precision_study else None
    passed = report.passed and all(w["passed"] for w in world)
    if args.json:
        out = {**report.to_dict(), "passed": passed, "world": world, "task": args.task}
        if window is not None:
            out["sft_window"] = _window_dict(window)
        if study is not None:
            out.update(study)
        print_json(out)
    else:
        print(render(case.description, sizes, report, world, study, window))
    return 0 if passed else 1


def _moe_mode(args, case: _Case) -> str | None:
    """The load-balancing mode checked (`moe_check.check_mode`), refused in one line where
    this check cannot take it: on packed rows."""
    mode = check_mode(case.model, args.moe_balance)
    if mode is None:
        return None
    if args.task == "sft" and args.packing != "none":
        raise BadInput(
            "--packing",
            args.packing,
            f"a mixture of experts (--moe-balance {mode}) is checked on padded micro-batches: "
            "--packing none",
        )
    return mode


def _sft(args, case: _Case, sizes: dict, seed: int) -> SFTWindow:
    layout = "shifted" if case.shifted else "unshifted"
    return sft_window(
        args.data,
        sizes["k"],
        sizes["micro_batch"],
        sizes["seq_len"],
        seed,
        layout,
        args.packing,
        args.micro_batch_tokens,
    )


def _sample(case: _Case, sizes: dict, seed: int) -> list[dict]:
    """Ragged token sequences; with an attention_mask for a mixture of experts, whose
    load-balancing loss counts the real tokens by it."""
    moe = moe_spec(case.model) is not None
    return sample_batches(
        sizes["k"], sizes["micro_batch"], sizes["seq_len"], case.vocab_size, seed, case.shifted, moe
    )


def _window_dict(window: SFTWindow) -> dict:
    """The SFT window's counts for --json (no tensors)."""
    out = asdict(window)
    del out["micro_batches"], out["big_batch"]
    return out


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


def world_setups(case: _Case, sizes: dict, moe: str | None = None) -> list:
    """What --world-size checks: DDP and FSDP2, k micro-batches per rank, 2 windows; a mixture
    of experts with its load-balancing mode `moe`."""
    return [
        EquivalenceSetup(
            world_size=sizes["world_size"],
            wrapper=wrapper,
            accum_steps=sizes["k"],
            steps=2,
            seed=sizes["seed"],
            vocab_size=case.vocab_size,
            seq_len=sizes["seq_len"],
            moe_balance=moe,
            moe_shift=not case.shifted,
        )
        for wrapper in ("ddp", "fsdp2")
    ]


def _world(case: _Case, sizes: dict, moe: str | None) -> list[dict]:
    """DDP and FSDP2 over N gloo ranks on CPU against one process (gradaccum.testing), in
    one start of the ranks."""
    reports = check_equivalences(
        case.factory,
        world_setups(case, sizes, moe),
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


def render(
    description: str,
    sizes: dict,
    report,
    world: list[dict],
    study: dict | None,
    window: SFTWindow | None = None,
) -> str:
    """The whole human-readable output; `window`: the SFT window of --task sft."""
    # the cross-entropy's own verdict; a mixture of experts' balance has its own row
    verdict = "PASS" if report.max_rel_err <= report.tolerance else "FAIL"
    first_row = "accumulated (gradaccum)" + (", cross-entropy" if report.moe else "")
    what = (
        f"k = {report.micro_steps} micro-batches of {sizes['micro_batch']} sequences "
        f"(ragged, up to {sizes['seq_len']} tokens), {report.tokens:,} valid tokens"
    )
    if window is not None:
        what = window.describe()
    lines = [
        f"gradaccum verify: {description}",
        f"window: {what}, {report.precision}; reference: one big batch in {report.reference}",
        "",
        f"  {'':<{W}}{'max rel err':>12}",
        f"  {first_row:<{W}}{report.max_rel_err:>12.2e}   {verdict}",
        f"  tolerance {report.tolerance:g} ({TOLERANCE_SOURCE})",
        f"  cosine min {report.cosine_min:.9f}, max abs err {report.max_abs_err:.2e}; "
        f"after one AdamW step (lr 1e-3) max |p - p_big| {report.param_max_abs_err:.2e}",
        "",
        *_render_ways(report),
        "",
        *_render_moe(report.moe),
        *_render_lint(report),
        *_render_world(world),
        *(_render_study(study) if study is not None else []),
    ]
    return "\n".join(lines)


def _render_ways(report) -> list[str]:
    lines = [f"  {'the usual mistakes, same data, same engine':<{W}}{'max rel err':>12}"]
    for name, words in WRONG_WAYS.items():
        err = report.wrong_ways.get(name)
        shown = "n/a" if err is None or not math.isfinite(err) else f"{err:.2e}"
        lines.append(f"  {words:<{W}}{shown:>12}")
    worst = sorted(report.params, key=lambda p: -p.rel_err)[:3]
    lines.append("  worst parameters: " + ", ".join(f"{p.name} {p.rel_err:.1e}" for p in worst))
    return lines


def _render_moe(moe) -> list[str]:
    """The load-balancing lines of a mixture of experts (`VerifyReport.moe`)."""
    if moe is None:
        return []
    verdict = "PASS" if moe.passed else "FAIL"
    head = "mixture of experts: cross-entropy + load-balancing loss"
    against = "the first window's f" if moe.mode == "global-previous" else "the whole window's f"
    lines = [
        f"  {head:<{W}}{'max rel err':>12}",
        f"  {'--moe-balance ' + moe.mode:<{W}}{moe.grad_rel_err:>12.2e}   {verdict}",
        f"  {moe.layers} MoE layers, {moe.n_expert} experts, top-{moe.top_k}, coef {moe.coef:g}; "
        f"against one {moe.reference} big batch whose loss takes {against}",
        f"  and its own P over its {moe.tokens:,} tokens; the loss trained {moe.aux_loss:.6g}, "
        f"the window's {moe.lbl:.6g}",
    ]
    if moe.mode != "micro":
        label = "the loss computed per micro-batch (--moe-balance micro)"
        lines.append(f"  {label:<{W}}{moe.micro_rel_err:>12.2e}")
    if moe.stale_rel_err is not None:
        label = "the second window against its own f (one window stale in f)"
        lines.append(f"  {label:<{W}}{moe.stale_rel_err:>12.2e}")
    return [*lines, ""]


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
    points = [StudyPoint(**p) for p in study["precision_study"]]
    derived = ", ".join(f"{k} {v:g}" for k, v in study["tolerances_derived"].items())
    applied = ", ".join(f"{k} {v:g}" for k, v in study["tolerances_applied"].items())
    lines = ["", "  precision study: relative error of the whole gradient against float64"]
    lines += ["  " + row for row in study_table(points).splitlines()]
    lines.append(f"  tolerances derived on this model (largest x 4, rounded up): {derived}")
    lines.append(f"  tolerances verify applies: {applied}")
    lines.append(f"  plot: {study['plot'] or 'not written (matplotlib not installed)'}")
    return lines
