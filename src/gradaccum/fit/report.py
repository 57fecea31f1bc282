"""`gradaccum fit`'s result for people: the candidates measured, the choice, the global batch
it gives, and what the choice traded (the exact batch for speed, or the other way round)."""

from __future__ import annotations

import io
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from gradaccum.fit.target import EXACT, MAX_NOISE
from gradaccum.utils.sizes import fmt_bytes, fmt_int

if TYPE_CHECKING:
    from gradaccum.fit.result import FitResult


def render_table(result: FitResult, fixed_k: bool = True) -> str:
    """The candidates as a table (each with the k and the global batch it would give), the
    choice, the global batch k gives, and why the choice is off the target when it is.
    `fixed_k` False (a fine-tuning run, whose k follows each window's examples): no k, no
    global batch, no target, only the sizes measured and the choice."""
    target = result.target
    table = Table(title="micro-batch candidates (measured)", title_justify="left")
    names = ("micro-batch", "tokens", "checkpointing", "fits", "tokens/s", "peak memory")
    for name in (*names, *(("k", "vs target") if fixed_k else ()), ""):
        table.add_column(name, justify="left" if name in ("checkpointing", "fits") else "right")
    for c in sorted(result.candidates, key=lambda c: (c.checkpointing, c.micro_batch)):
        mark = ""
        if (c.micro_batch, c.checkpointing) == (result.micro_batch, result.checkpointing):
            mark = "<- chosen"
        cells = [
            str(c.micro_batch),
            fmt_int(c.micro_batch * result.seq_len),
            "on" if c.checkpointing else "off",
            "yes" if c.fits else f"no ({c.why})",
            "-" if c.tokens_per_s is None else fmt_int(round(c.tokens_per_s)),
            "-" if c.peak_memory_bytes is None else fmt_bytes(c.peak_memory_bytes),
        ]
        if fixed_k:
            cells.append(str(target.accum_steps(c.micro_batch)) if c.fits else "-")
            cells.append(f"{target.deviation(c.micro_batch):+.2%}" if c.fits else "-")
        table.add_row(*cells, mark)
    out = io.StringIO()
    Console(file=out, width=120, color_system=None, emoji=False).print(table)
    lines = [out.getvalue().rstrip("\n")]
    if result.budget_bytes is not None:
        source = result.memory.source if result.memory else "measured"
        lines.append(f"memory budget {fmt_bytes(result.budget_bytes)} ({source})")
    if result.lora is not None:
        lora = result.lora
        lines.append(
            f"LoRA rank {lora['rank']} on {', '.join(lora['targets'])}: {lora['trainable']:,} "
            f"trainable of {lora['total']:,} parameters, the base frozen (gradients and "
            "optimizer state measured for the adapters only)"
        )
    if result.base_quant is not None:
        quant = result.base_quant
        scheme = "LLM.int8" if quant["bits"] == 8 else quant["quant"].upper()
        lines.append(
            f"base in {quant['bits']} bits ({scheme}, bitsandbytes): {quant['layers']} linear "
            f"layers; the model probed holds {fmt_bytes(quant['stored_bytes'])}, quantisation "
            "constants and adapters included"
        )
    ckpt = "on" if result.checkpointing else "off"
    lines.append(
        f"chosen: micro-batch {result.micro_batch} ({fmt_int(result.micro_batch * result.seq_len)}"
        f" tokens), activation checkpointing {ckpt}"
    )
    if not fixed_k:
        lines.append("k: each window's own, from its examples at this micro-batch (the plan below)")
        return "\n".join(lines) + "\n"
    lines.append(
        f"k = {result.accum_steps}: global batch {fmt_int(result.global_batch_tokens)} tokens "
        f"= {result.micro_batch} x {result.seq_len} x {result.accum_steps} x "
        f"{result.world_size} rank(s), {result.target_deviation:+.2%} from the target "
        f"{fmt_int(result.target_tokens)}"
    )
    return "\n".join(lines + choice_notes(result)) + "\n"


def choice_notes(result: FitResult) -> list[str]:
    """Lines for a choice that trades the exact batch for speed, or the other way round:
    a choice off the target against the fastest size that lands on it, and a faster size
    left out for being past --batch-tolerance."""
    target, tol = result.target, f"{100 * result.batch_tolerance:g}%"
    timed = [c for c in result.candidates if c.fits and c.tokens_per_s]
    chosen = result.tokens_per_s
    lines = []
    if not timed or not chosen:
        return lines
    if not target.lands(result.micro_batch):
        exact = [c for c in timed if target.lands(c.micro_batch)]
        head = (
            f"the global batch is {result.target_deviation:+.2%} off the target, within "
            f"--batch-tolerance {tol}"
        )
        if not exact:
            lines.append(f"{head}; no size timed lands within {EXACT:.0%} of it")
        else:
            e = max(exact, key=lambda c: c.tokens_per_s)
            lines.append(
                f"{head}: micro-batch {result.micro_batch} runs {chosen / e.tokens_per_s:.2f}x "
                f"as fast as the fastest size landing within {EXACT:.0%} of it ({e.micro_batch} "
                f"x k {target.accum_steps(e.micro_batch)}, {fmt_int(round(e.tokens_per_s))} "
                "tokens/s); --batch-tolerance 0 keeps the target"
            )
    fastest = max(timed, key=lambda c: c.tokens_per_s)
    if fastest.tokens_per_s > chosen * (1 + MAX_NOISE):
        lines.append(
            f"micro-batch {fastest.micro_batch} ran {fastest.tokens_per_s / chosen:.2f}x as fast"
            f" but lands {target.deviation(fastest.micro_batch):+.2%} from the target, past "
            f"--batch-tolerance {tol}"
        )
    return lines
