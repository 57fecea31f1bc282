"""The output of `gradaccum verify`: the table for people, and the dict --json prints (the
engine's report, the rows of --world-size, the SFT window's counts, the LoRA and its quantised
base, the precision study)."""

from __future__ import annotations

import math
from dataclasses import asdict

from gradaccum.verification.check import TOLERANCE_SOURCE
from gradaccum.verification.precision_study import StudyPoint, study_table
from gradaccum.verification.qlora import B_STD, Adapters
from gradaccum.verification.report import check_row, verdict
from gradaccum.verification.sft import SFTWindow
from gradaccum.verification.wrong_ways import WRONG_WAYS

W = 66  # width of the label column of the tables


# ---- --json ---------------------------------------------------------------------------------


def all_checks(report, world: list[dict]) -> list[dict]:
    """The checks deciding verify's verdict (`report.check_row`s): the window's gradient, a
    mixture of experts' balance (`VerifyReport.checks`), each wrapper of --world-size."""
    return report.checks() + [world_check_row(w) for w in world]


def report_json(
    report,
    world: list[dict],
    task: str,
    window: SFTWindow | None,
    study: dict | None,
    adapters: Adapters | None = None,
) -> dict:
    """What --json prints: the engine's report, the verdict over it and the ranks, the rows of
    --world-size (`world_row`), the SFT window's counts, the precision study, and with
    --lora-rank or --base-bits "lora" (the adapters) and "quantization" (how the base is
    stored and how far that moved its weights: information, not in the verdict; null for a
    full base). The top-level `max_rel_err`, `tolerance` and `max_rel_err_check` are those of
    the worst of the checks deciding `passed` (`report.verdict`): the window's gradient, a
    mixture of experts' balance, each wrapper of --world-size."""
    out = {**report.to_dict(), **verdict(all_checks(report, world)), "world": world, "task": task}
    if window is not None:
        out["sft_window"] = window_dict(window)
    if adapters is not None:
        out["lora"] = adapters.to_dict()
        q = adapters.quantization
        out["quantization"] = None if q is None else q.to_dict()
    if study is not None:
        out.update(study)
    return out


def world_row(report) -> dict:
    """One wrapper's line of the --world-size check, as --json prints it: "mesh" is
    [replicas, shards] (`EquivalenceSetup.mesh_shape`), "traffic" the gradient bytes counted
    per window against the planner's (`traffic.TrafficCheck`)."""
    return {
        "wrapper": report.setup.wrapper,
        "world_size": report.setup.world_size,
        "sync": report.setup.sync,
        "mesh": list(report.setup.mesh_shape),
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
        "traffic": None if report.traffic is None else asdict(report.traffic),
    }


def world_check_row(row: dict) -> dict:
    """A wrapper of --world-size as a check (`report.check_row`): its gradient's or loss's
    error, whichever is larger, and its verdict (which also holds its AdamW step within
    `step_tolerance` and its token counts to the single process's)."""
    err = max(row["grad_rel_err"], row["loss_rel_err"])
    sync = "" if row.get("sync", "window") == "window" else f" ({row['sync']})"
    name = f"{row['wrapper']}{sync} on {row['world_size']} ranks"
    return check_row(name, err, row["tolerance"], row["passed"])


def window_dict(window: SFTWindow) -> dict:
    """The SFT window's counts for --json (no tensors)."""
    out = asdict(window)
    del out["micro_batches"], out["big_batch"]
    return out


# ---- the table for people -------------------------------------------------------------------


def render(
    description: str,
    sizes: dict,
    report,
    world: list[dict],
    study: dict | None,
    window: SFTWindow | None = None,
    adapters: Adapters | None = None,
) -> str:
    """The whole human-readable output; `window`: the SFT window of --task sft; `adapters`:
    the LoRA of --lora-rank or --base-bits and its quantised base."""
    # the cross-entropy's own verdict; a mixture of experts' balance has its own row
    verdict = "PASS" if report.max_rel_err <= report.tolerance else "FAIL"
    first_row = "accumulated (gradaccum)" + (", cross-entropy" if report.moe else "")
    what = (
        f"k = {report.micro_steps} micro-batches of {sizes['micro_batch']} sequences "
        f"(ragged, up to {sizes['seq_len']} tokens), {report.tokens:,} valid tokens"
    )
    if window is not None:
        what = window.describe()
    reference = f"one big batch in {report.reference}"
    if adapters is not None and adapters.quantization is not None:
        reference += " on the dequantised base, the same adapters"
    lines = [
        f"gradaccum verify: {description}",
        *_render_adapters(adapters),
        f"window: {what}, {report.precision}; reference: {reference}",
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
        *_render_quantization(adapters),
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


def _render_adapters(adapters: Adapters | None) -> list[str]:
    """The LoRA's line, and the base's where it is quantised."""
    if adapters is None:
        return []
    lines = [
        f"adapters: {adapters.lora.describe()}; B drawn from --seed (normal, std {B_STD:g}), "
        "not zero, so that A has a gradient"
    ]
    q = adapters.quantization
    if q is not None:
        lines.append(
            f"base: {q.spec.describe()}: {len(q.rel_errs)} block linear layers as bitsandbytes "
            f"{q.layer_type}, {q.stored_bytes / 1e6:,.2f} MB held"
        )
    return lines


def _render_quantization(adapters: Adapters | None) -> list[str]:
    """How far the dequantised base is from the original weights: information, apart from
    the verdict."""
    q = None if adapters is None else adapters.quantization
    if q is None:
        return []
    label = "quantisation (information, not part of the verdict)"
    return [
        f"  {label:<{W}}{'rel err':>12}",
        f"  {'dequantised weights against the original, worst layer':<{W}}{q.max_rel_err:>12.2e}",
        f"  worst layer {q.worst_layer}; mean over the {len(q.rel_errs)} layers "
        f"{q.mean_rel_err:.2e}; ||W_deq - W|| / ||W|| per layer",
        f"  the original weights: {q.original}",
        "",
    ]


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
        label = f"{_policy(w)} ({w['steps']} steps, {w['windows']} windows)"
        lines.append(
            f"  {label:<{W - 12}}{w['grad_rel_err']:>12.2e}{w['step_err']:>12.2e}   {verdict}"
        )
    lines += [
        f"  each window from the ranks' parameters: gradient and loss within {first['tolerance']:g}"
        f" of a {first['reference']} big batch;",
        f"  its AdamW step within {first['step_tolerance']:g} x (|p| + lr) of a float64 step with "
        "that gradient (fp32 rounding, x 4)",
    ]
    return lines + _render_traffic(world)


def _policy(row: dict) -> str:
    """'ddp, window', 'fsdp2, micro', 'fsdp2, hsdp 2 x 2' (replicas x shards)."""
    words = f"{row['wrapper']}, {row['sync']}"
    if row["sync"] == "hsdp":
        words += " {} x {}".format(*row["mesh"])
    return words


def _render_traffic(world: list[dict]) -> list[str]:
    """Each wrapper's gradient bytes per window, counted on rank 0, against the planner's."""
    rows = [w for w in world if w.get("traffic")]
    if not rows:
        return []
    cols = ("window", "collectives", "bytes in", "sent", "planner")
    head = f"{cols[0]:>8}" + "".join(f"{c:>12}" for c in cols[1:])
    lines = ["", f"  {'gradient traffic, rank 0':<24}{head}"]
    for w in rows:
        t = w["traffic"]
        for i, sent in enumerate(t["counted_wire_bytes"]):
            shown = (t["collectives"][i], t["input_bytes"][i], sent, t["planned_wire_bytes"][i])
            label = _policy(w) if i == 0 else ""
            lines.append(
                f"  {label:<24}{i + 1:>8}"
                + "".join(f"{n:>12,}" for n in shown)
                + f"   {'equal' if t['equal'] else 'FAIL'}"
            )
        padded = f", padded to {t['padded_params']:,} over {t['shards']} shards"
        padding = padded if t["padded_params"] != t["params"] else ""
        lines.append(f"  {'':<24}planner: {t['planned']}; G = 4 x {t['params']:,} "
                     f"parameters{padding}")  # fmt: skip
    lines += [
        "  bytes in: each collective's input; sent: bytes per rank on a ring, (n - 1)/n of a",
        "  reduce-scatter's input and 2 (n - 1)/n of an all-reduce's (n ranks in it); planner:",
        "  `gradaccum plan`'s bytes per rank for the same gradient, k and mesh (plan.sync)",
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
