"""One gradient sync per window (gradaccum) against the loop that all-reduces after every
micro-batch, under DDP: 2 ranks, k = 8, a small GPT.

The two run the same model, data and k on the same ranks; they alternate (A B, then B A, ...)
for several rounds and the script prints the median ratio of wall time per optimizer step
(every-micro-batch loop / gradaccum) and the gradient collectives each launched per step,
counted by a DDP communication hook.

    python benchmarks/ddp_sync.py [--rounds 9]          # 2 gloo processes on CPU
    torchrun --nproc-per-node 2 benchmarks/ddp_sync.py  # one process per GPU (nccl)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from gradaccum import Accumulator
from gradaccum.models.gpt import GPT, GPTConfig
from gradaccum.models.loss import causal_lm_loss
from gradaccum.parallel import backends, devices
from gradaccum.parallel.process_group import init_distributed, teardown
from gradaccum.testing import run_ranks
from gradaccum.utils.atomic import exit_on_disk_full, write_text_atomic
from gradaccum.utils.choices import BUILTIN_MODELS as PRESETS

IGNORE = -100


def make_windows(args, rank: int, device: torch.device) -> list[list[dict]]:
    """This rank's windows: random tokens, rows of random valid lengths (half to full)."""
    g = torch.Generator().manual_seed(1000 + rank)
    b, t = args.micro_batch, args.seq_len
    windows = []
    for _ in range(args.windows):
        window = []
        for _ in range(args.accum_steps):
            ids = torch.randint(0, args.vocab, (b, t + 1), generator=g)
            lengths = torch.randint(t // 2, t + 1, (b,), generator=g)
            labels = ids[:, 1:].clone()
            labels[torch.arange(t)[None, :] >= lengths[:, None]] = IGNORE
            window.append({"input_ids": ids[:, :-1].to(device), "labels": labels.to(device)})
        windows.append(window)
    return windows


def sync_every_micro_batch(model, opt, windows) -> None:
    """The loop people copy: every backward inside DDP, so every micro-batch all-reduces.
    (It also divides each micro-batch's mean by k, wrong for ragged data but not slower.)"""
    for window in windows:
        for batch in window:
            loss_sum, n = causal_lm_loss(model, batch)
            (loss_sum / n / len(window)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def gradaccum_loop(acc, windows) -> None:
    for window in windows:
        acc.step(window, causal_lm_loss)


def timed(fn, device: torch.device) -> float:
    """Seconds for fn() on every rank: the ranks start together and the slowest one counts."""
    devices.synchronize(device)
    dist.barrier()
    start = time.perf_counter()
    fn()
    devices.synchronize(device)
    dist.barrier()
    return time.perf_counter() - start


def bench_rank(info, args) -> dict | None:
    torch.manual_seed(0)
    shape = PRESETS[args.preset]
    cfg = GPTConfig(vocab_size=args.vocab, seq_len=args.seq_len, **shape)
    base = GPT(cfg).to(info.device)
    models = {
        name: DistributedDataParallel(GPT(cfg).to(info.device)) for name in ("plain", "engine")
    }
    for m in models.values():
        m.module.load_state_dict(base.state_dict())
    traffic = {name: backends.count_grad_traffic(m) for name, m in models.items()}
    opts = {name: torch.optim.AdamW(m.parameters(), lr=1e-4) for name, m in models.items()}
    acc = Accumulator(models["engine"], opts["engine"], count_tokens="auto")
    windows = make_windows(args, info.rank, info.device)
    runs = {
        "plain": lambda: sync_every_micro_batch(models["plain"], opts["plain"], windows),
        "engine": lambda: gradaccum_loop(acc, windows),
    }
    for run in runs.values():  # warm-up: allocator, DDP bucket rebuild, kernels
        run()
    times: dict[str, list[float]] = {"plain": [], "engine": []}
    counted = {name: (t.collectives, t.bytes) for name, t in traffic.items()}
    for r in range(args.rounds):
        order = ("plain", "engine") if r % 2 == 0 else ("engine", "plain")
        for name in order:
            times[name].append(timed(runs[name], info.device) / args.windows)
    steps = args.rounds * args.windows
    per_step = {
        name: {
            "collectives": (t.collectives - counted[name][0]) / steps,
            "bytes": (t.bytes - counted[name][1]) / steps,
        }
        for name, t in traffic.items()
    }
    if not info.is_main:
        return None
    ratios = [p / e for p, e in zip(times["plain"], times["engine"], strict=True)]
    return {
        "world_size": info.world_size,
        "backend": info.backend,
        "device": str(info.device),
        "preset": args.preset,
        "params": sum(p.numel() for p in base.parameters()),
        "accum_steps": args.accum_steps,
        "micro_batch": args.micro_batch,
        "seq_len": args.seq_len,
        "tokens_per_step": args.micro_batch * args.seq_len * args.accum_steps * info.world_size,
        "rounds": args.rounds,
        "windows_per_round": args.windows,
        "ms_per_step": {name: [1e3 * t for t in ts] for name, ts in times.items()},
        "median_ms_per_step": {name: 1e3 * statistics.median(ts) for name, ts in times.items()},
        "median_ratio_every_over_once": statistics.median(ratios),
        "grad_collectives_per_step": {n: v["collectives"] for n, v in per_step.items()},
        "grad_mb_per_step": {n: v["bytes"] / 1e6 for n, v in per_step.items()},
    }


def print_table(result: dict) -> None:
    med, coll, mb = (
        result["median_ms_per_step"],
        result["grad_collectives_per_step"],
        result["grad_mb_per_step"],
    )
    print(
        f"DDP, {result['world_size']} ranks ({result['backend']}, {result['device']}), GPT "
        f"{result['preset']} ({result['params'] / 1e6:.2f}M params), k = "
        f"{result['accum_steps']}, micro-batch {result['micro_batch']} x {result['seq_len']}, "
        f"{result['tokens_per_step']} tokens/step, {result['rounds']} rounds"
    )
    print(f"{'loop':<28}{'ms/step':>10}{'collectives/step':>18}{'grad MB/step':>14}")
    labels = {"plain": "all-reduce every micro-batch", "engine": "gradaccum (once per window)"}
    for name, label in labels.items():
        print(f"{label:<28}{med[name]:>10.1f}{coll[name]:>18.1f}{mb[name]:>14.2f}")
    print(
        f"median time ratio (every micro-batch / gradaccum): {result['median_ratio_every_over_once']:.3f}"
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=2, help="ranks to spawn on CPU (no torchrun)")
    p.add_argument("--accum-steps", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per micro-batch")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence")
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--windows", type=int, default=3, help="optimizer steps per timed run")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds before giving up")
    p.add_argument(
        "--out", default=os.path.join(os.path.dirname(__file__), "results", "ddp_sync.json")
    )
    args = p.parse_args(argv)
    return run_and_write(bench_rank, print_table, args)


def run_and_write(bench_rank, print_table, args) -> int:
    """`bench_rank(info, args)` on this rank under torchrun, or on --world-size spawned gloo
    ranks; rank 0's result printed with `print_table` and written to --out."""
    if "WORLD_SIZE" in os.environ:  # under torchrun: this process is one rank
        info = init_distributed(timeout_s=args.timeout)
        try:
            result = bench_rank(info, args)
        finally:
            teardown(info)
    else:
        result = run_ranks(bench_rank, args.world_size, (args,), timeout_s=args.timeout)[0]
    if result is None:
        return 0
    print_table(result)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    write_text_atomic(args.out, json.dumps(result, indent=2))
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(exit_on_disk_full(main, os.path.basename(__file__)))
