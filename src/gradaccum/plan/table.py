"""A plan as a table for people: one row per number, its unit, and where it comes from."""

from __future__ import annotations

import io
import math

from rich.console import Console
from rich.table import Table
from rich.text import Text

from .sizes import fmt_bytes, fmt_count, fmt_int, fmt_seconds


def _flops(x: float) -> str:
    exponent = int(math.floor(math.log10(x))) if x > 0 else 0
    return f"{x / 10**exponent:.2f}e{exponent}"


def _rows(plan) -> list[tuple[str, str, str, str]]:
    """(quantity, value, unit, how) for every number the plan determines."""
    rows: list[tuple[str, str, str, str]] = []

    def add(quantity: str, value, text: str, unit: str, how: str = "") -> None:
        if value is not None:
            rows.append((quantity, text, unit, how))

    w, b, k, s = plan.world_size, plan.micro_batch, plan.accum_steps, plan.seq_len
    if plan.model or plan.params:
        add(
            "model",
            plan.params,
            fmt_count(plan.params or 0),
            "parameters",
            plan.model or "--params",
        )
    add("devices", w, str(w), "GPUs (world size)")
    add("micro-batch", b, fmt_int(b or 0), "sequences / device", plan.micro_batch_from or "")
    add("sequence length", s, fmt_int(s or 0), "tokens")
    add("micro-batch tokens", plan.micro_tokens, fmt_int(plan.micro_tokens or 0), "tokens / device")
    how_k = plan.accum_steps_from or ""
    if plan.accum_steps_from == "target":
        micro = plan.micro_tokens if plan.target_sequences is None else b
        target = plan.target_tokens if plan.target_sequences is None else plan.target_sequences
        if micro and target:
            how_k = f"round({fmt_int(target)} / ({fmt_int(micro)} x {w})), at least 1"
    add("accumulation steps k", k, str(k), "micro-batches / optimizer step", how_k)
    gs, gt = plan.global_batch_sequences, plan.global_batch_tokens
    add("global batch", gs, fmt_int(gs or 0), "sequences / step", f"{b} x {k} x {w}")
    add(
        "global batch",
        gt,
        fmt_int(gt or 0),
        "tokens / step",
        f"{fmt_int(plan.micro_tokens or 0)} x {k} x {w}",
    )
    if plan.target_deviation is not None:
        target = plan.target_tokens or plan.target_sequences
        unit = "tokens" if plan.target_tokens else "sequences"
        add("target", target, fmt_int(target), unit, f"landed {plan.target_deviation:+.2%} off")
    add("optimizer steps", plan.steps, fmt_int(plan.steps or 0), "steps")
    tokens_how = ""
    if plan.total_tokens_requested and plan.total_tokens != plan.total_tokens_requested:
        tokens_how = f"--total-tokens {fmt_count(plan.total_tokens_requested)}, whole steps"
    add("total tokens", plan.total_tokens, fmt_count(plan.total_tokens or 0), "tokens", tokens_how)
    if plan.micro_step_time_s is not None:
        add("micro-step time", 1, fmt_seconds(plan.micro_step_time_s), "per micro-batch")
    how_step = f"{k} x micro-step" if plan.time_from == "--micro-step-time" else plan.time_from
    add("step time", plan.step_time_s, fmt_seconds(plan.step_time_s or 0), "per step", how_step)
    total_s = (plan.total_time_h or 0) * 3600
    add("total time", plan.total_time_h, fmt_seconds(total_s), "wall clock", "steps x step time")
    add("device-hours", plan.device_hours, f"{plan.device_hours or 0:,.1f}", "GPU-hours", f"x {w}")
    add("FLOPs / step", plan.flops_per_step, _flops(plan.flops_per_step or 0), "FLOP", "6 N D")
    add("FLOPs total", plan.flops_total, _flops(plan.flops_total or 0), "FLOP", "6 N D")
    add("MFU (implied)", plan.mfu_implied, f"{plan.mfu_implied or 0:.3f}", "fraction of peak")
    if plan.lr is not None:
        rule = "x c" if plan.lr_rule == "linear" else "x sqrt(c)"
        how = f"{plan.lr_rule}: base {rule}, c = {plan.lr_scale:.4g}"
        add("learning rate", plan.lr, f"{plan.lr:.4g}", "dimensionless", how)
    rows += _memory_rows(plan)
    rows += _communication_rows(plan)
    return rows


def _memory_rows(plan) -> list[tuple[str, str, str, str]]:
    m = plan.memory
    setup = f"{plan.precision}, {plan.optimizer}, ZeRO-{plan.zero}"
    setup += ", checkpointing" if plan.checkpointing == "full" else ""
    setup += ", flash attention" if plan.flash_attention else ""
    items = [
        ("memory: parameters", m.params_gb, setup),
        ("memory: gradients", m.grads_gb, "in flight" if plan.precision != "fp32" else ".grad"),
        ("memory: fp32 accum buffer", m.accum_buffer_gb, ""),
        ("memory: optimizer state", m.optimizer_gb, ""),
        (
            "memory: activations",
            m.activations_gb,
            f"logits {fmt_bytes((m.logits_gb or 0) * 1e9)} of it",
        ),
        ("memory: total", m.total_gb, "per device"),
        ("device memory", m.device_memory_gb, ""),
    ]
    # GB in --json; here the unit follows the size, so a small model does not read 0.00 GB
    rows = [(q, fmt_bytes(v * 1e9), "bytes", how) for q, v, how in items if v is not None]
    if m.fits is not None:
        rows.append(("fits", "yes" if m.fits else "NO", "yes / no", "total <= device memory"))
    if m.max_micro_batch is not None:
        rows.append(("max micro-batch", fmt_int(m.max_micro_batch), "sequences / device", ""))
    return rows


def _communication_rows(plan) -> list[tuple[str, str, str, str]]:
    c = plan.communication
    if c is None:
        return []
    rows = [
        (
            "grad sync once per window",
            fmt_bytes(c.sync_per_window_bytes),
            "sent / device / step",
            f"{c.collective}, grads {c.sync_per_window_grads_gb:,.2f} GB",
        )
    ]
    if c.sync_every_micro_batch_bytes is not None:
        rows.append(
            (
                "grad sync every micro-batch",
                fmt_bytes(c.sync_every_micro_batch_bytes),
                "sent / device / step",
                f"{c.collective} x {plan.accum_steps}, "
                f"grads {c.sync_every_micro_batch_grads_gb:,.2f} GB",
            )
        )
    if c.param_all_gather_bytes:
        rows.append(
            (
                "ZeRO-3 param all-gather",
                fmt_bytes(c.param_all_gather_bytes),
                "sent / device / step",
                "",
            )
        )
    return rows


def render(plan, width: int = 110) -> str:
    """The table, then one line per warning and note."""
    table = Table(title="gradaccum plan", title_justify="left")
    table.add_column("quantity")
    table.add_column("value", justify="right")
    table.add_column("unit")
    table.add_column("how")
    for row in _rows(plan):
        table.add_row(*(Text(cell) for cell in row))
    out = io.StringIO()
    console = Console(file=out, width=width, color_system=None, highlight=False)
    console.print(table)
    for text in plan.warnings:
        console.print(f"warning: {text}", markup=False, soft_wrap=True)
    for text in plan.notes:
        console.print(f"note: {text}", markup=False, soft_wrap=True)
    return out.getvalue()
