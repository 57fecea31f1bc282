"""What the load-balancing modes cost, side by side in one run, and what they train to.

Part 1, cost: the built-in MoE GPT (`--model tiny-moe`) on the same ragged windows through
`Balance.step` in each of --moe-balance micro, global and global-previous; the modes
alternate (A B C, then C A B, ...) for several rounds, each from the same weights, and the
script prints the median tokens/s of each and its ratio to "micro" (which adds nothing to a
plain forward but the router's softmax, as any MoE training does).

Part 2, training (--train-steps > 0): `gradaccum train --model tiny-moe` with the same seed,
data and tokens per step in "micro" and in "global": the held-out loss and the expert load
(max / mean token fraction per layer, 1 = balanced) at the end of each.

    OMP_NUM_THREADS=1 python benchmarks/moe_balance.py [--rounds 7] [--windows 4]
        [--train-steps 200 --train-micro-batch 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time

import torch

from gradaccum import Accumulator
from gradaccum.bench.pretrain.data import make_windows
from gradaccum.models.build import build_model
from gradaccum.models.loss import IGNORE_INDEX
from gradaccum.moe.balance import Balance
from gradaccum.train.config import TrainConfig
from gradaccum.train.loop import train
from gradaccum.train.rundir.metrics import read_metrics
from gradaccum.utils.atomic import write_text_atomic
from gradaccum.utils.choices import MOE_BALANCES


def ragged_windows(n_windows, k, micro_batch, seq_len, vocab, seed=0):
    """`gradaccum.bench.pretrain.data.make_windows` (rows of 1 to seq_len real tokens, labels -100 past
    them) with the padding said in an attention_mask, as the trainer's SFT micro-batches do:
    the balance routes only the real tokens."""
    windows = make_windows(n_windows, k, micro_batch, seq_len, vocab, seed)
    for window in windows:
        for batch in window:
            batch["attention_mask"] = (batch["labels"] != IGNORE_INDEX).long()
    return windows


def run_mode(model, windows, mode) -> tuple[float, int]:
    """Seconds and routed tokens of the windows after the first through `Balance.step`
    (AdamW, one step per window), from a copy of `model`. The first window is not timed: in
    "global-previous" it has no previous f and takes its own (as "global" does)."""
    m = copy.deepcopy(model)
    acc = Accumulator(m, torch.optim.AdamW(m.parameters(), lr=1e-3), max_grad_norm=1.0)
    balance = Balance(m, mode)
    balance.step(acc, windows[0])
    tokens = 0
    t0 = time.perf_counter()
    for window in windows[1:]:
        _, stats = balance.step(acc, window)
        tokens += stats.tokens
    seconds = time.perf_counter() - t0
    acc.close()
    return seconds, tokens


def cost(args) -> dict:
    torch.manual_seed(args.seed)
    model, _ = build_model(preset="tiny-moe", vocab_size=args.vocab, seq_len=args.seq_len)
    windows = ragged_windows(args.windows, args.k, args.micro_batch, args.seq_len, args.vocab)
    run_mode(model, windows[:2], "micro")  # warm-up
    rates: dict[str, list[float]] = {mode: [] for mode in MOE_BALANCES}
    order = list(MOE_BALANCES)
    for r in range(args.rounds):
        for mode in order if r % 2 == 0 else order[::-1]:
            seconds, tokens = run_mode(model, windows, mode)
            rates[mode].append(tokens / seconds)
    medians = {mode: statistics.median(v) for mode, v in rates.items()}
    return {
        mode: {
            "tokens_per_s": medians[mode],
            "ratio_to_micro": medians[mode] / medians["micro"],
            "spread": (max(v) - min(v)) / medians[mode],
        }
        for mode, v in rates.items()
    }


def train_mode(args, mode: str, out: str) -> dict:
    """`gradaccum train --model tiny-moe --moe-balance MODE --micro-batch B` on the built-in
    corpus: its summary (--json) and, over the last tenth of its windows, the mean expert
    load per layer and LBL from metrics.jsonl."""
    config = TrainConfig(
        out=out,
        model="tiny-moe",
        moe_balance=mode,
        micro_batch=args.train_micro_batch,
        max_steps=args.train_steps,
        seed=args.seed,
        eval_every=0,
        save_every=0,
    )
    summary = train(config)
    records = [r for r in read_metrics(os.path.join(out, "metrics.jsonl")) if "moe_load" in r]
    tail = records[-max(1, len(records) // 10) :]
    layers = len(tail[0]["moe_load"])
    row = {key: summary.get(key) for key in SUMMARY_KEYS}
    row["load_per_layer_last_tenth"] = [
        round(statistics.mean(r["moe_load"][i] for r in tail), 4) for i in range(layers)
    ]
    row["lbl_last_tenth"] = statistics.mean(r["moe_lbl"] for r in tail)
    return row


SUMMARY_KEYS = (
    "final_loss",
    "final_eval_loss",
    "final_moe_lbl",
    "final_moe_load_max",
    "micro_batch",
    "accum_steps",
    "tokens",
    "tokens_per_s",
    "wall_s",
)


def training(args) -> dict:
    with tempfile.TemporaryDirectory(prefix="moe-balance-") as tmp:
        return {
            mode: train_mode(args, mode, os.path.join(tmp, mode)) for mode in ("micro", "global")
        }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7, help="part 1 when > 0")
    p.add_argument("--windows", type=int, default=4, help="per run, the first untimed")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train-steps", type=int, default=0, help="part 2 when > 0")
    p.add_argument("--train-micro-batch", type=int, default=2)
    p.add_argument("--json", default=None, help="also write the results to this file")
    args = p.parse_args(argv)
    machine = (
        f"{os.cpu_count()} CPU cores, torch {torch.__version__}, threads {torch.get_num_threads()}"
    )
    result = {"machine": machine}
    if args.rounds > 0:
        result["cost"] = cost(args)
        print(f"cost of the modes ({machine}; median of {args.rounds} rounds):")
        for mode, row in result["cost"].items():
            print(
                f"  {mode:16s} {row['tokens_per_s']:9,.0f} routed tok/s  "
                f"x{row['ratio_to_micro']:.3f} of micro  (spread {row['spread']:.1%})"
            )
    if args.train_steps:
        result["training"] = training(args)
        for mode, row in result["training"].items():
            print(f"  train {mode}: {json.dumps(row)}")
    if args.json:
        write_text_atomic(args.json, json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
