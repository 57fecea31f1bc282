"""A plan as a table for people: one row per number, its unit, and where it comes from;
with a batch schedule, a second table of its phases."""

from __future__ import annotations

import io
import math

from rich.console import Console
from rich.table import Table
from rich.text import Text

from gradaccum.plan.quantized import held_in_fp32
from gradaccum.plan.sync import INTER_NODE_BW, INTRA_NODE_BW, mesh_words
from gradaccum.utils.sizes import fmt_bytes, fmt_count, fmt_int, fmt_seconds

_LR_RULE = {"none": "unchanged", "linear": "x c", "sqrt": "x sqrt(c)"}
_PHASE_ROWS = 15  # more phases (a long ramp) show the first and last few and one row between


def flops_text(x: float) -> str:
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
    assumed = "assumed: --gpus not given" if plan.world_size_assumed else ""
    add("devices", w, str(w), "GPUs (world size)", assumed)
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
    schedule = plan.batch_schedule
    if schedule is not None:
        shape = "linear ramp" if schedule.linear else "step-wise"
        n = len(schedule.phases)
        add("batch schedule", n, f"{n} phases", shape, "batch rows: the first phase")
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
        how = f"landed {plan.target_deviation:+.2%} off"
        add("target", target, fmt_int(target), unit, how + (" (first phase)" if schedule else ""))
    how_steps = "phases summed" if schedule else ""
    add("optimizer steps", plan.steps, fmt_int(plan.steps or 0), "steps", how_steps)
    tokens_how = ""
    if plan.total_tokens_requested and plan.total_tokens != plan.total_tokens_requested:
        tokens_how = f"--total-tokens {fmt_count(plan.total_tokens_requested)}, whole steps"
    add("total tokens", plan.total_tokens, fmt_count(plan.total_tokens or 0), "tokens", tokens_how)
    if plan.micro_step_time_s is not None:
        add("micro-step time", 1, fmt_seconds(plan.micro_step_time_s), "per micro-batch")
    how_step = f"{k} x micro-step" if plan.time_from == "--micro-step-time" else plan.time_from
    add("step time", plan.step_time_s, fmt_seconds(plan.step_time_s or 0), "per step", how_step)
    total_s = (plan.total_time_h or 0) * 3600
    how_total = "phases, steps x step time at their k" if schedule else "steps x step time"
    add("total time", plan.total_time_h, fmt_seconds(total_s), "wall clock", how_total)
    add("device-hours", plan.device_hours, f"{plan.device_hours or 0:,.1f}", "GPU-hours", f"x {w}")
    n = f"6 N D, N = {fmt_count(plan.active_params)} active" if plan.active_params else "6 N D"
    add("FLOPs / step", plan.flops_per_step, flops_text(plan.flops_per_step or 0), "FLOP", n)
    add("FLOPs total", plan.flops_total, flops_text(plan.flops_total or 0), "FLOP", n)
    add("MFU (implied)", plan.mfu_implied, f"{plan.mfu_implied or 0:.3f}", "fraction of peak")
    if plan.lr is not None:
        how = f"{plan.lr_rule}: base {_LR_RULE[plan.lr_rule]}, c = {plan.lr_scale:.4g}"
        add("learning rate", plan.lr, f"{plan.lr:.4g}", "dimensionless", how)
    rows += memory_rows(plan)
    rows += _communication_rows(plan)
    return rows


def memory_rows(plan) -> list[tuple[str, str, str, str]]:
    m = plan.memory
    setup = f"{plan.precision}, {plan.optimizer}, ZeRO-{plan.zero}"
    setup += ", checkpointing" if plan.checkpointing == "full" else ""
    setup += ", flash attention" if plan.flash_attention else ""
    # fp32 parameters accumulate in .grad: under fp32, and the fp32 adapters of a k-bit base
    fp32_grads = plan.precision == "fp32" or held_in_fp32(plan.base_bits)
    base = None
    if m.frozen_base_gb is not None and plan.base_bits != 16:
        ratio = m.frozen_base_gb / m.frozen_base_16bit_gb if m.frozen_base_16bit_gb else 0.0
        base = (
            f"memory: {plan.base_bits}-bit frozen base",
            m.frozen_base_gb,
            f"{ratio:.3f} x the {fmt_bytes(m.frozen_base_16bit_gb * 1e9)} of bf16",
        )
    items = [
        ("memory: parameters", m.params_gb, setup),
        *([base] if base else []),
        ("memory: gradients", m.grads_gb, ".grad" if fp32_grads else "in flight"),
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
    if plan.sync is not None:  # the sync table below says it per policy, in fp32
        return _all_gather_rows(c)
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
    return rows + _all_gather_rows(c)


def _all_gather_rows(c) -> list[tuple[str, str, str, str]]:
    if not c.param_all_gather_bytes:
        return []
    bytes_sent = fmt_bytes(c.param_all_gather_bytes)
    return [("ZeRO-3 param all-gather", bytes_sent, "sent / device / step", "")]


def _phase_cells(p) -> list[str]:
    time = "-" if p.time_s is None else fmt_seconds(p.time_s)
    lr = [] if p.lr is None else [f"{p.lr:.4g}"]
    return [
        fmt_count(p.start_tokens),
        fmt_count(p.end_tokens),
        str(p.accum_steps),
        fmt_int(p.tokens_per_step),
        fmt_int(p.steps),
        fmt_count(p.tokens),
        time,
        f"{p.lr_factor:.4g}",
        *lr,
    ]


def _phases_between(phases) -> list[str]:
    """One row for the phases a long ramp passes through, summed."""
    times = [p.time_s for p in phases]
    time = "-" if None in times else fmt_seconds(sum(times))
    ks = f"{phases[0].accum_steps}..{phases[-1].accum_steps}"
    steps, tokens = sum(p.steps for p in phases), sum(p.tokens for p in phases)
    first, last = phases[0].start_tokens, phases[-1].end_tokens
    return [fmt_count(first), fmt_count(last), ks, "", fmt_int(steps), fmt_count(tokens), time]


def _phase_table(plan) -> Table:
    """Each phase: tokens seen from and to, k, tokens per step, steps, tokens, time, LR."""
    s = plan.batch_schedule
    micro = fmt_int(plan.micro_tokens)
    if plan.seq_len:
        micro = f"{plan.micro_batch} x {fmt_int(plan.seq_len)}"
    title = (
        f"batch schedule {s.schedule}: tokens / step = {micro} x k x {plan.world_size}, "
        f"LR rule {s.lr_rule}"
    )
    table = Table(title=title, title_justify="left")
    for name in ("phase", "from tokens", "to tokens", "k", "tokens / step", "steps", "tokens"):
        table.add_column(name, justify="left" if name == "phase" else "right")
    table.add_column("time", justify="right")
    table.add_column("LR x", justify="right")
    if s.phases[0].lr is not None:
        table.add_column("LR", justify="right")
    phases = s.phases
    shown = list(enumerate(phases, 1))
    if len(phases) > _PHASE_ROWS:
        head = _PHASE_ROWS // 2
        shown = shown[:head] + [(None, phases[head:-head])] + shown[-head:]
    for number, p in shown:
        if number is None:
            table.add_row(f"{len(p)} more", *_phases_between(p))
        else:
            table.add_row(str(number), *_phase_cells(p))
    table.add_section()
    time = "-" if s.total_time_s is None else fmt_seconds(s.total_time_s)
    end = fmt_count(s.total_tokens)
    steps, tokens = fmt_int(s.total_steps), fmt_count(s.total_tokens)
    table.add_row("total", "0", end, "", "", steps, tokens, time)
    return table


def _sync_table(plan) -> Table:
    """The gradient-sync policies side by side, a column each: per device and optimizer step."""
    sync = plan.sync
    assumed = []
    if sync.intra_node_bw_gb_s * 1e9 == INTRA_NODE_BW:
        assumed.append("--intra-node-bw 300GB/s (NVLink, HCCS)")
    if sync.inter_node_bw_gb_s * 1e9 == INTER_NODE_BW:
        assumed.append("--inter-node-bw 400Gb/s (a 400 Gb/s NIC per device)")
    title = f"gradient sync: {mesh_words(sync)}"
    if assumed:
        title += f"; assumed: {', '.join(assumed)}"
    table = Table(title=title, title_justify="left")
    table.add_column("per device, per step")
    for c in sync.policies:
        table.add_column(c.policy + (" *" if c.policy == sync.policy else ""))
    rows = [
        ("collectives (fp32)", lambda c: c.collectives.removesuffix(", fp32")),
        ("state held as", lambda c: f"ZeRO-{c.zero}"),
        ("gradient held", lambda c: f"{fmt_bytes(c.grad_memory_bytes)} fp32"),
        ("sent within the node", lambda c: fmt_bytes(c.intra_node_bytes)),
        ("sent across nodes", lambda c: fmt_bytes(c.inter_node_bytes)),
        ("sync time", lambda c: fmt_seconds(c.sync_time_s)),
        ("memory: total", lambda c: _gb_or_dash(c.memory_total_gb)),
        ("fits", lambda c: "-" if c.fits is None else ("yes" if c.fits else "NO")),
    ]
    for name, cell in rows:
        table.add_row(name, *(Text(cell(c)) for c in sync.policies))
    return table


def _gb_or_dash(gb: float | None) -> str:
    return "-" if gb is None else fmt_bytes(gb * 1e9)


def _sync_lines(plan) -> list[str]:
    """What the sync table's columns mean, and --sync's choice."""
    sync = plan.sync
    lines = [
        "sync: time = bytes within the node / its bandwidth + bytes across nodes / theirs, "
        "not overlapped with backward; memory: the device's total under that policy (micro "
        "and hsdp shard the gradient, at ZeRO 2 or more; hsdp over a node's devices)"
    ]
    if sync.policy is not None:
        how = "--sync auto chose" if sync.why else "--sync"
        lines.append(f"sync: * {how} {sync.policy}" + (f": {sync.why}" if sync.why else ""))
    return lines


def rows_table(title: str, rows) -> Table:
    """A table of (quantity, value, unit, how) rows."""
    table = Table(title=title, title_justify="left")
    table.add_column("quantity")
    table.add_column("value", justify="right")
    table.add_column("unit")
    table.add_column("how")
    for row in rows:
        table.add_row(*(Text(cell) for cell in row))
    return table


def render_rows(title: str, rows, width: int = 110) -> str:
    """`rows_table` as text."""
    out = io.StringIO()
    Console(file=out, width=width, color_system=None, highlight=False).print(
        rows_table(title, rows)
    )
    return out.getvalue()


def render_table(plan, width: int = 110) -> str:
    """The plan as a table for people, units on every row (and the phases of a batch
    schedule), then one line per warning and note."""
    table = rows_table("gradaccum plan", _rows(plan))
    out = io.StringIO()
    console = Console(file=out, width=width, color_system=None, highlight=False)
    console.print(table)
    if plan.batch_schedule is not None:
        console.print(_phase_table(plan))
    if plan.sync is not None:
        console.print(_sync_table(plan))
        for text in _sync_lines(plan):
            console.print(text, markup=False, soft_wrap=True)
    for text in plan.warnings:
        console.print(f"warning: {text}", markup=False, soft_wrap=True)
    for text in plan.notes:
        console.print(f"note: {text}", markup=False, soft_wrap=True)
    return out.getvalue()
