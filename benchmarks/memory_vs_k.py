"""Peak memory of one window against k: `Accumulator.step` and a plain loop, side by side.

Accumulation's premise is that memory is that of one micro-batch whatever k is. Each
measurement runs in a fresh process (so peaks do not mix): build a small causal transformer
(fp32), run ONE window of k micro-batches of 32 x 64 tokens through the engine or through the
shortest correct hand-written loop, and report the process's peak resident memory (and peak
device memory on an accelerator). Micro-batches are generated on demand from their index, so
neither side holds the window's data: what is measured is what each loop keeps.

    python benchmarks/memory_vs_k.py [--ks 8 32 128 512] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
from collections.abc import Sequence

import torch

from gradaccum import Accumulator
from gradaccum.models.gpt import GPT, GPTConfig
from gradaccum.models.loss import causal_lm_loss
from gradaccum.parallel import devices
from gradaccum.utils.atomic import exit_on_disk_full, write_text_atomic

IGNORE = -100
SHAPE = {"n_layer": 2, "n_head": 4, "n_embd": 128}
VOCAB = 256


class LazyWindow(Sequence):
    """k micro-batches, each made from its index when asked for (ragged valid lengths)."""

    def __init__(self, k: int, micro_batch: int, seq_len: int, device: torch.device):
        self.k, self.micro_batch, self.seq_len, self.device = k, micro_batch, seq_len, device

    def __len__(self) -> int:
        return self.k

    def __getitem__(self, i: int) -> dict:
        if not 0 <= i < self.k:
            raise IndexError(i)
        g = torch.Generator().manual_seed(i)
        b, t = self.micro_batch, self.seq_len
        ids = torch.randint(0, VOCAB, (b, t + 1), generator=g)
        lengths = torch.randint(t // 2, t + 1, (b,), generator=g)
        labels = ids[:, 1:].clone()
        labels[torch.arange(t)[None, :] >= lengths[:, None]] = IGNORE
        return {"input_ids": ids[:, :-1].to(self.device), "labels": labels.to(self.device)}


def plain_loop(model, opt, window) -> float:
    """Count the window's tokens, backward loss_sum / N per micro-batch, step once."""
    n = sum(int((window[i]["labels"] != IGNORE).sum()) for i in range(len(window)))
    total = torch.zeros((), dtype=torch.float64, device=window.device)
    for i in range(len(window)):
        loss_sum, _ = causal_lm_loss(model, window[i])
        (loss_sum / n).backward()
        total += loss_sum.detach()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(total) / n


def peak_rss_mb() -> float:
    # ru_maxrss is in kB on Linux, bytes on macOS
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


def measure_one(loop: str, k: int, args) -> dict:
    """One window in this process; its peaks."""
    device = devices.resolve(args.device)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB, seq_len=args.seq_len, **SHAPE)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    window = LazyWindow(k, args.micro_batch, args.seq_len, device)
    before = peak_rss_mb()
    devices.reset_peak_memory(device)
    if loop == "engine":
        loss = Accumulator(model, opt).step(window, causal_lm_loss).loss
    else:
        loss = plain_loop(model, opt, window)
    devices.synchronize(device)
    return {
        "loop": loop,
        "k": k,
        "loss": loss,
        "rss_before_window_mb": before,
        "peak_rss_mb": peak_rss_mb(),
        "peak_device_mb": _mb(devices.peak_memory_bytes(device)),
    }


def _mb(nbytes: int | None) -> float | None:
    return None if nbytes is None else nbytes / 2**20


def run_fresh(loop: str, k: int, args) -> dict:
    cmd = [sys.executable, __file__, "--one", loop, str(k), "--device", args.device]
    cmd += ["--micro-batch", str(args.micro_batch), "--seq-len", str(args.seq_len)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=os.environ.copy())
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ks", type=int, nargs="+", default=[8, 32, 128, 512])
    ap.add_argument("--micro-batch", type=int, default=32, help="sequences per micro-batch")
    ap.add_argument("--seq-len", type=int, default=64, help="tokens per sequence")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--one", nargs=2, metavar=("LOOP", "K"), help=argparse.SUPPRESS)
    ap.add_argument(
        "--out", default=os.path.join(os.path.dirname(__file__), "results", "memory_vs_k.json")
    )
    args = ap.parse_args(argv)
    if args.one:  # the child: one measurement
        print(json.dumps(measure_one(args.one[0], int(args.one[1]), args)))
        return 0
    rows = []
    print(f"{'k':>5}{'engine peak RSS MB':>20}{'plain peak RSS MB':>19}{'engine / plain':>16}")
    for k in args.ks:
        engine, plain = run_fresh("engine", k, args), run_fresh("plain", k, args)
        rows += [engine, plain]
        ratio = engine["peak_rss_mb"] / plain["peak_rss_mb"]
        print(f"{k:>5}{engine['peak_rss_mb']:>20.1f}{plain['peak_rss_mb']:>19.1f}{ratio:>16.3f}")
        if engine["peak_device_mb"] is not None:
            print(
                f"{'':>5} device peak MB: engine {engine['peak_device_mb']:.1f}, plain "
                f"{plain['peak_device_mb']:.1f}"
            )
    result = {
        "device": args.device,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "torch": torch.__version__,
        "model": {"vocab": VOCAB, "seq_len": args.seq_len, **SHAPE},
        "micro_batch": args.micro_batch,
        "rows": rows,
    }
    engine_rss = {r["k"]: r["peak_rss_mb"] for r in rows if r["loop"] == "engine"}
    plain_rss = {r["k"]: r["peak_rss_mb"] for r in rows if r["loop"] == "plain"}
    if 16 in engine_rss and 256 in engine_rss:
        result["engine_k256_over_k16"] = engine_rss[256] / engine_rss[16]
        result["engine_over_plain_k256"] = engine_rss[256] / plain_rss[256]
        print(
            f"engine k=256 / k=16: {result['engine_k256_over_k16']:.3f}; engine / plain at "
            f"k=256: {result['engine_over_plain_k256']:.3f} (goal: both within 1.10)"
        )
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    write_text_atomic(args.out, json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(exit_on_disk_full(main, os.path.basename(__file__)))
