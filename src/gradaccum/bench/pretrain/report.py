"""The bench's figures as JSON for machines and as a table for people."""

from __future__ import annotations

from gradaccum.bench.pretrain.measure import Entry, median

EXACT = 1e-4
"""An update further than this from the big batch's is not the big batch's update."""


def spread(values: list[float]) -> float | None:
    """(largest - smallest) / median of the rounds' tokens/s: 0.05 is 5 %."""
    if not values:
        return None
    return (max(values) - min(values)) / median(values)


def result(entry: Entry) -> dict:
    """One contestant as the JSON lists it; a skipped one has only `name` and `skipped`."""
    ran = entry.skipped is None
    peak = entry.peak_bytes
    return {
        "name": entry.contestant.name,
        "tokens_per_s": median(entry.tokens_per_s) if ran else None,
        "ratio": median(entry.ratios) if ran else None,
        "spread": spread(entry.tokens_per_s) if ran else None,
        "peak_memory_gb": None if peak is None or not ran else peak / 1e9,
        "update_rel_err": entry.update_rel_err if ran else None,
        "skipped": entry.skipped,
    }


def to_json(entries: list[Entry], config: dict) -> dict:
    """`results`, `overhead_ratio` (gradaccum's tokens/s over the hand loop's, median of
    the rounds' ratios) and `config`."""
    results = [result(e) for e in entries]
    ours = next(r for r in results if r["name"] == "gradaccum")
    return {"results": results, "overhead_ratio": ours["ratio"], "config": config}


def fmt_or(value, spec: str, missing: str = "n/a") -> str:
    return missing if value is None else format(value, spec)


def render_table(entries: list[Entry], config: dict) -> str:
    """The table, a line on who divides by k, and the overhead ratio."""
    data = to_json(entries, config)
    c = config
    lines = [
        f"gradaccum bench: model {c['model']}, micro-batch {c['micro_batch']} x {c['seq_len']}"
        f" tokens, k = {c['accum_steps']}, {c['rounds']} rounds, {c['device']}, "
        f"torch {c['torch']}",
        "",
        f"{'contestant':<36} {'tokens/s':>10} {'vs hand':>8} {'spread':>7} {'peak GB':>8}"
        f" {'update err':>11}",
    ]
    for entry, r in zip(entries, data["results"], strict=True):
        label = entry.contestant.label
        if r["skipped"]:
            lines.append(f"{label:<36} skipped: {r['skipped']}")
            continue
        lines.append(
            f"{label:<36} {r['tokens_per_s']:>10,.0f} {fmt_or(r['ratio'], '.3f'):>8}"
            f" {fmt_or(r['spread'], '.1%'):>7} {fmt_or(r['peak_memory_gb'], '.3f'):>8}"
            f" {fmt_or(r['update_rel_err'], '.1e'):>11}"
        )
    lines += ["", _k_note(entries, data["results"]), _footer(data)]
    return "\n".join(line for line in lines if line is not None) + "\n"


def _k_note(entries: list[Entry], results: list[dict]) -> str | None:
    off = [
        (e.contestant.label, r["update_rel_err"])
        for e, r in zip(entries, results, strict=True)
        if not r["skipped"] and e.contestant.divides_by_k and r["update_rel_err"] > EXACT
    ]
    if not off:
        return None
    names = ", ".join(label for label, _ in off)
    worst = max(err for _, err in off)
    return (
        f"{names} divide each micro-batch's mean loss by k: micro-batches hold different "
        f"numbers of valid tokens, so their update is off the exact one by up to {worst:.1e}."
    )


def _footer(data: dict) -> str:
    ratio = data["overhead_ratio"]
    return (
        "update err: |update - exact big-batch gradient| / |gradient| after one SGD step at"
        f" lr 1. overhead ratio (gradaccum / hand loop, tokens/s): {fmt_or(ratio, '.3f')}"
    )
