"""Accumulator.step against the shortest correct hand-written accumulation loop.

Same model, data, micro-batch and k; the two alternate (A B, then B A, ...) for several rounds
and the script prints the median tokens/s ratio engine / hand loop. Goal: >= 0.98. A third
contestant, the engine with `noise_scale=True`, measures what the noise-scale estimate costs:
goal, its tokens/s within 3% of the engine's without it (ratio >= 0.97).

    python benchmarks/engine_overhead.py [--rounds 15] [--windows 6] [--device auto]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time

import torch

from gradaccum import Accumulator
from gradaccum.models.gpt import GPT, GPTConfig
from gradaccum.models.loss import causal_lm_loss
from gradaccum.parallel import devices
from gradaccum.utils.atomic import exit_on_disk_full, write_text_atomic

IGNORE = -100


def make_windows(n_windows, k, micro_batch, seq_len, vocab, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_windows):
        window = []
        for _ in range(k):
            ids = torch.randint(0, vocab, (micro_batch, seq_len + 1), generator=g)
            lengths = torch.randint(seq_len // 2, seq_len + 1, (micro_batch,), generator=g)
            labels = ids[:, 1:].clone()
            labels[torch.arange(seq_len)[None, :] >= lengths[:, None]] = IGNORE
            window.append({"input_ids": ids[:, :-1].to(device), "labels": labels.to(device)})
        out.append(window)
    return out


def hand_loop(model, opt, windows, max_grad_norm):
    """The shortest correct loop: count the window's tokens, backward loss_sum / N per
    micro-batch, clip, step and zero once per window."""
    params = [p for p in model.parameters()]
    losses = []
    for window in windows:
        n = sum((b["labels"] != IGNORE).sum() for b in window)
        total = 0.0
        for batch in window:
            loss_sum, _ = causal_lm_loss(model, batch)
            (loss_sum / n).backward()
            total += loss_sum.detach()
        torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append((total / n).item())
    return losses


def engine_loop(acc, windows):
    return [acc.step(window, causal_lm_loss).loss for window in windows]


def timed(fn, device):
    devices.synchronize(device)
    start = time.perf_counter()
    fn()
    devices.synchronize(device)
    return time.perf_counter() - start


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15, help="median over rounds")
    ap.add_argument("--windows", type=int, default=6, help="windows (optimizer steps) per timing")
    ap.add_argument("--accum-steps", type=int, default=8)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--out", default=os.path.join(os.path.dirname(__file__), "results", "engine_overhead.json")
    )
    args = ap.parse_args(argv)
    device = devices.resolve(args.device)
    vocab = 256
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=vocab, seq_len=args.seq_len, n_layer=2, n_head=4, n_embd=128)
    base = GPT(cfg).to(device)
    model_a, model_b, model_c = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
    opt_a = torch.optim.AdamW(model_a.parameters(), lr=1e-3)
    opt_b = torch.optim.AdamW(model_b.parameters(), lr=1e-3)
    opt_c = torch.optim.AdamW(model_c.parameters(), lr=1e-3)
    acc = Accumulator(model_b, opt_b, max_grad_norm=1.0)
    acc_noise = Accumulator(model_c, opt_c, max_grad_norm=1.0, noise_scale=True)
    windows = make_windows(
        args.windows, args.accum_steps, args.micro_batch, args.seq_len, vocab, device
    )
    tokens = sum(int((b["labels"] != IGNORE).sum()) for w in windows for b in w)

    # warm-up, and a check that both compute the same thing
    loss_a = hand_loop(model_a, opt_a, windows[:1], 1.0)
    loss_b = engine_loop(acc, windows[:1])
    loss_c = engine_loop(acc_noise, windows[:1])
    assert abs(loss_a[0] - loss_b[0]) <= 1e-5 * abs(loss_a[0]), (loss_a, loss_b)
    assert abs(loss_c[0] - loss_b[0]) <= 1e-5 * abs(loss_b[0]), (loss_b, loss_c)

    runs = {
        "hand": lambda: hand_loop(model_a, opt_a, windows, 1.0),
        "engine": lambda: engine_loop(acc, windows),
        "noise": lambda: engine_loop(acc_noise, windows),
    }
    ratios, noise_ratios, hand_tps, engine_tps, noise_tps = [], [], [], [], []
    for r in range(args.rounds):
        names = list(runs)
        order = names[r % 3 :] + names[: r % 3]  # each goes first, second and last in turn
        if r % 2:
            order.reverse()
        t = {name: timed(runs[name], device) for name in order}
        hand_tps.append(tokens / t["hand"])
        engine_tps.append(tokens / t["engine"])
        noise_tps.append(tokens / t["noise"])
        ratios.append(engine_tps[-1] / hand_tps[-1])
        noise_ratios.append(noise_tps[-1] / engine_tps[-1])
        print(
            f"round {r + 1}: hand {hand_tps[-1]:,.0f} tok/s  engine {engine_tps[-1]:,.0f} tok/s"
            f"  with noise scale {noise_tps[-1]:,.0f} tok/s  ratio {ratios[-1]:.3f}"
            f"  noise ratio {noise_ratios[-1]:.3f}",
            flush=True,
        )
    result = {
        "device": str(device),
        "torch": torch.__version__,
        "accum_steps": args.accum_steps,
        "micro_batch": args.micro_batch,
        "seq_len": args.seq_len,
        "rounds": args.rounds,
        "hand_tokens_per_s_median": statistics.median(hand_tps),
        "engine_tokens_per_s_median": statistics.median(engine_tps),
        "ratio_median": statistics.median(ratios),
        "ratios": ratios,
        "noise_tokens_per_s_median": statistics.median(noise_tps),
        "noise_ratio_median": statistics.median(noise_ratios),
        "noise_ratios": noise_ratios,
        "cpu_threads": torch.get_num_threads(),
    }
    print(f"median tokens/s ratio engine / hand loop: {result['ratio_median']:.3f} (goal >= 0.98)")
    print(
        f"median tokens/s ratio engine with / without noise scale: "
        f"{result['noise_ratio_median']:.3f} (goal >= 0.97)"
    )
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    write_text_atomic(args.out, json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(exit_on_disk_full(main, os.path.basename(__file__)))
