"""`gradaccum bench --task sft` figures as JSON and as a table."""

from __future__ import annotations

from gradaccum.bench.pretrain import report
from gradaccum.bench.pretrain.measure import Entry
from gradaccum.bench.pretrain.report import fmt_or


def result(entry: Entry) -> dict:
    """One contestant (`report.result`) with the padding share of its computed positions
    (None for a skipped one)."""
    fields = report.result(entry)
    fields["padding"] = entry.padding if entry.skipped is None else None
    return fields


def to_json(entries: list[Entry], config: dict) -> dict:
    """`results` and `config`; tokens_per_s counts targets (labels the loss counts), ratio is
    the median over rounds of tokens/s over config["baseline"]'s in the same round."""
    return {"results": [result(e) for e in entries], "config": config}


def render_table(entries: list[Entry], config: dict) -> str:
    c = config
    t, g = c["lengths"]["tokens"], c["lengths"]["targets"]
    trained = "" if c["trainable"] == c["parameters"] else f", {c['trainable']:,} train"
    adapters = "" if c["lora_rank"] is None else f", peft {c['peft']}"
    adapters += "" if c["base_quant"] is None else f", bitsandbytes {c['bitsandbytes']}"
    lines = [
        f"gradaccum bench --task sft: {c['model']} ({c['parameters']:,} parameters{trained}, "
        f"{c['attention']} attention), {c['examples_per_step']} examples per step (micro-batch "
        f"{c['micro_batch']} x k {c['accum_steps']}; gradaccum window / padding-free "
        f"{c['micro_batch_tokens']:,} positions per micro-batch), {c['rounds']} round(s), "
        f"{c['device']}, torch {c['torch']}, transformers {c['transformers']}, trl {c['trl']}"
        + adapters,
        f"examples ({c['lengths']['examples']:,}): tokens median {t['median']}, p90 {t['p90']}, "
        f"p99 {t['p99']}, max {t['max']}; targets median {g['median']}, p90 {g['p90']}, "
        f"p99 {g['p99']}, max {g['max']}",
        "",
        f"{'contestant':<40} {'targets/s':>10} {'vs ' + c['baseline']:>8} {'spread':>7}"
        f" {'padding':>8} {'peak GB':>8} {'update err':>11}",
    ]
    for entry in entries:
        r = result(entry)
        label = entry.contestant.label
        if r["skipped"]:
            lines.append(f"{label:<40} skipped: {r['skipped']}")
            continue
        lines.append(
            f"{label:<40} {r['tokens_per_s']:>10,.0f} {fmt_or(r['ratio'], '.3f'):>8}"
            f" {fmt_or(r['spread'], '.1%'):>7} {fmt_or(r['padding'], '.1%'):>8}"
            f" {fmt_or(r['peak_memory_gb'], '.3f'):>8} {fmt_or(r['update_rel_err'], '.1e'):>11}"
        )
    lines += [
        "",
        "targets/s: target (label) tokens per second, median of the rounds; padding: share of "
        "the positions computed that hold no token; peak GB: on the CPU, the peak growth of "
        "resident memory over a run plus weights and optimizer state; update err: |update - "
        "exact big-batch gradient| / |gradient| after one SGD step at lr 1.",
    ]
    if c["base_quant"] is not None:
        lines.append(
            "The exact big batch of a quantised base: float64 on the dequantised weights (what "
            "the quantised layers compute with); the adapters' update only."
        )
    return "\n".join(lines) + "\n"
