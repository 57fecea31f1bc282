"""The same token budget three ways, on the built-in corpus with the tiny GPT:

- small: micro-batch b, no accumulation (b sequences per optimizer step, k times the steps);
- accumulated: micro-batch b, k micro-batches per step (b x k sequences per step);
- big: one batch of b x k sequences per step.

All three see the same sequences in the same order (the data order is by global batch) and
use the same peak LR, warmup share and cosine schedule in optimizer steps. The accumulated
run is the big-batch run computed in k pieces, so its curve lies on the big one; the small
batch is a different optimisation (k times more, noisier steps) and its curve does not.

Writes benchmarks/results/accumulation_curves.png and .json (the curves, final losses, and
the largest per-step loss gap between accumulated and big).

On this easy corpus the small batch learns faster per token (the big batch is above the
task's critical batch size, so k times more steps pay off); the point is not which is better
but that accumulating k micro-batches gives the big batch's run, not the small batch's.

    python benchmarks/accumulation_curves.py [--tokens 250k] [--micro-batch 8] [--k 4]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import sys
import tempfile
import time

from gradaccum.train.loop import TrainConfig, train
from gradaccum.train.rundir.metrics import read_metrics
from gradaccum.utils.atomic import exit_on_disk_full, write_atomic, write_text_atomic
from gradaccum.utils.sizes import parse_count

HERE = os.path.dirname(os.path.abspath(__file__))


def run(
    name: str,
    out: str,
    micro_batch: int,
    k: int,
    steps: int,
    eval_every: int,
    seq_len: int,
    lr: float,
) -> dict:
    config = TrainConfig(
        out=os.path.join(out, name),
        seq_len=seq_len,
        micro_batch=micro_batch,
        accum_steps=k,
        max_steps=steps,
        eval_every=eval_every,
        save_every=0,
        lr=lr,
        json=True,
    )
    started = time.perf_counter()
    with contextlib.redirect_stderr(io.StringIO()):
        summary = train(config)
    records = read_metrics(os.path.join(config.out, "metrics.jsonl"))
    train_lines = [r for r in records if "eval_loss" not in r]
    evals = [r for r in records if "eval_loss" in r]
    print(
        f"{name:12s} b {micro_batch:3d} k {k:2d} {steps:5d} steps  final loss "
        f"{summary['final_loss']:.4f}  held-out {summary['final_eval_loss']:.4f}  "
        f"{time.perf_counter() - started:.0f} s",
        file=sys.stderr,
    )
    return {
        "micro_batch": micro_batch,
        "accum_steps": k,
        "steps": steps,
        "tokens_per_step": summary["tokens_per_step"],
        "final_loss": summary["final_loss"],
        "final_eval_loss": summary["final_eval_loss"],
        "entropy_floor": summary["entropy_floor"],
        "tokens": [r["tokens"] for r in train_lines],
        "loss": [r["loss"] for r in train_lines],
        "eval_tokens": [r["tokens"] for r in evals],
        "eval_loss": [r["eval_loss"] for r in evals],
    }


def rolling(values: list[float], width: int) -> list[float]:
    """Mean of each run of `width` steps: the small run's loss over the tokens of one big step."""
    return [sum(values[i : i + width]) / width for i in range(0, len(values) - width + 1, width)]


def plot(curves: dict, floor: float, k: int, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=130)
    small, acc, big = curves["small"], curves["accumulated"], curves["big"]
    ax.plot(small["tokens"], small["loss"], color="tab:orange", alpha=0.25, lw=0.8)
    ax.plot(
        small["tokens"][k - 1 :: k],
        rolling(small["loss"], k),
        color="tab:orange",
        lw=1.6,
        label=f"small: b {small['micro_batch']}, k 1 (mean over {k} steps)",
    )
    ax.plot(
        big["tokens"],
        big["loss"],
        color="tab:blue",
        lw=3.5,
        alpha=0.45,
        label=f"big: b {big['micro_batch']}, k 1",
    )
    ax.plot(
        acc["tokens"],
        acc["loss"],
        color="black",
        lw=1.2,
        ls=(0, (4, 2)),
        label=f"accumulated: b {acc['micro_batch']}, k {acc['accum_steps']}",
    )
    ax.axhline(floor, color="gray", ls="--", lw=1, label=f"entropy floor {floor:.3f}")
    ax.set_xlabel("tokens")
    ax.set_ylabel("training loss (nats per token)")
    ax.set_title("Same tokens, three batchings: accumulation reproduces the big batch")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    write_atomic(path, lambda f: fig.savefig(f, format="png"))
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="250k", help="token budget of each run (default 250k)")
    ap.add_argument("--micro-batch", type=int, default=8, help="sequences (default 8)")
    ap.add_argument("--k", type=int, default=4, help="accumulation steps (default 4)")
    ap.add_argument("--seq-len", type=int, default=64, help="tokens per sequence (default 64)")
    ap.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default 3e-3)")
    ap.add_argument("--out", default=os.path.join(HERE, "results"), help="results folder")
    args = ap.parse_args(argv)
    b, k, seq = args.micro_batch, args.k, args.seq_len
    big_steps = math.ceil(parse_count(args.tokens, "--tokens") / (b * k * seq))
    evals = max(1, big_steps // 4)  # held-out loss 4 times a run: eval is forward-only but not free
    curves = {}
    with tempfile.TemporaryDirectory() as runs:
        curves["small"] = run("small", runs, b, 1, big_steps * k, evals * k, seq, args.lr)
        curves["accumulated"] = run("accumulated", runs, b, k, big_steps, evals, seq, args.lr)
        curves["big"] = run("big", runs, b * k, 1, big_steps, evals, seq, args.lr)
    pairs = zip(curves["accumulated"]["loss"], curves["big"]["loss"], strict=True)
    gap = max(abs(x - y) for x, y in pairs)
    floor = curves["big"]["entropy_floor"]
    result = {
        "tokens_per_run": curves["big"]["tokens"][-1],
        "seq_len": seq,
        "lr": args.lr,
        "entropy_floor": floor,
        "ln_vocab": math.log(512),
        "final_loss": {name: c["final_loss"] for name, c in curves.items()},
        "final_eval_loss": {name: c["final_eval_loss"] for name, c in curves.items()},
        "max_step_loss_gap_accumulated_vs_big": gap,
        "curves": curves,
    }
    os.makedirs(args.out, exist_ok=True)
    write_text_atomic(
        os.path.join(args.out, "accumulation_curves.json"), json.dumps(result, indent=1)
    )
    plot(curves, floor, k, os.path.join(args.out, "accumulation_curves.png"))
    print(json.dumps({key: result[key] for key in result if key != "curves"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(exit_on_disk_full(main, os.path.basename(__file__)))
