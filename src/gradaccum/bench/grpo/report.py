"""`gradaccum bench --task grpo` figures as JSON and as a table."""

from __future__ import annotations

from gradaccum.bench.grpo.measure import LossRow
from gradaccum.bench.pretrain.measure import median
from gradaccum.bench.pretrain.report import fmt_or, spread

NAMES = ("gradaccum", "trl")


def result(row: LossRow) -> dict:
    """One loss type: per contestant its update error, median tokens/s and spread (None
    where skipped, with the reason), and the median of the rounds' ours / TRL ratios."""
    out = {"loss_type": row.loss_type}
    for name in NAMES:
        rates = row.tokens_per_s.get(name, [])
        out[name] = {
            "update_rel_err": row.update_rel_err.get(name),
            "tokens_per_s": median(rates),
            "spread": spread(rates),
            "skipped": row.skipped.get(name),
        }
    out["ratio"] = median(row.ratios)
    return out


def to_json(rows: list[LossRow], config: dict) -> dict:
    """`results` (one per loss type) and `config`; tokens_per_s counts completion tokens."""
    return {"results": [result(r) for r in rows], "config": config}


def render_table(rows: list[LossRow], config: dict) -> str:
    c = config
    lengths = c["completion_lengths"]
    lines = [
        f"gradaccum bench --task grpo: {c['model']} ({c['parameters']:,} parameters), "
        f"{c['prompts_per_step']} prompts x G {c['num_generations']} = "
        f"{c['completions_per_step']} completions per step (micro-batch {c['micro_batch']} x "
        f"k {c['accum_steps']}), prompts of {c['prompt_tokens']} tokens, completions of "
        f"{lengths['min']} to {lengths['max']} tokens (median {lengths['median']:g}, at most "
        f"{c['max_completion_length']}), {c['rounds']} round(s), {c['device']}, torch "
        f"{c['torch']}, transformers {c['transformers']}, trl {c['trl']}",
        f"generation (the model's generate, the same for both, not in tokens/s): "
        f"{c['generation_s_per_window']:.2f} s per window (median), "
        f"{c['generation_tokens_per_s']:,.0f} completion tokens/s",
        "",
        f"{'loss type':<10} {'ours err':>9} {'TRL err':>9} {'ours tok/s':>11} {'TRL tok/s':>10}"
        f" {'ratio':>6}",
    ]
    for row in rows:
        r = result(row)
        ours, trl = r["gradaccum"], r["trl"]
        lines.append(
            f"{row.loss_type:<10} {fmt_or(ours['update_rel_err'], '.1e'):>9}"
            f" {fmt_or(trl['update_rel_err'], '.1e'):>9} {fmt_or(ours['tokens_per_s'], ',.0f'):>11}"
            f" {fmt_or(trl['tokens_per_s'], ',.0f'):>10} {fmt_or(r['ratio'], '.2f'):>6}"
        )
        if trl["skipped"]:
            lines.append(f"{'':<10} TRL skipped: {trl['skipped']}")
    lines += [
        "",
        "err: |update - exact big-batch gradient| / |gradient| after one SGD step at lr 1 (the "
        "exact one: all completions in one float64 forward, the loss type's normalisation over "
        "the whole window); tok/s: completion tokens per second of forward, backward and "
        "optimizer step (AdamW), median of the rounds; ratio: ours / TRL's in the same round, "
        "median.",
    ]
    return "\n".join(lines) + "\n"
