"""`fit` on GPT-2 124M in bf16 against a hand-picked sweep of micro-batches, on one device.

    python benchmarks/gpu_fit.py [--seq-len 1024] [--tokens-per-step 512k] [--device cuda]

1. `gradaccum.fit.find_micro_batch` searches (real out-of-memory errors included) and times.
2. A hand-written loop (autocast, summed loss / tokens, backward, AdamW step, zero_grad; no
   engine, no fit code) times every micro-batch of the sweep, activation checkpointing off
   and on, and then fit's choice the same way.
3. Prints the sweep, fit's choice and the ratio: tokens/s of fit's choice over the best of the
   sweep, both measured by the hand loop in this run. Writes benchmarks/results/gpu_fit.json.

Meant for one accelerator (under 8 minutes on one GPU). `--smoke` runs the built-in tiny GPT
on CPU in a minute, to check the script itself.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch

from gradaccum import fit
from gradaccum.engine.precision import autocast_dtype
from gradaccum.models.build import build_model
from gradaccum.models.loss import causal_lm_loss
from gradaccum.parallel import devices
from gradaccum.utils.atomic import exit_on_disk_full, write_text_atomic
from gradaccum.utils.sizes import parse_count

VOCAB = 50257


def gpt2_124m(seq_len: int):
    """GPT-2 124M: the Hugging Face model from its default config (no download), else the
    built-in GPT of the same shape."""
    try:
        from transformers import GPT2Config, GPT2LMHeadModel

        return GPT2LMHeadModel(GPT2Config(n_positions=max(1024, seq_len))), "HF GPT-2 124M"
    except ImportError:
        model, _ = build_model("gpt2-124m", vocab_size=VOCAB, seq_len=seq_len)
        return model, "built-in GPT gpt2-124m"


def batches(vocab: int, seq_len: int, device: torch.device):
    def make_batch(micro_batch: int) -> dict:
        g = torch.Generator().manual_seed(0)
        rows = torch.randint(0, vocab, (micro_batch, seq_len + 1), generator=g).to(device)
        return {"input_ids": rows[:, :-1].contiguous(), "labels": rows[:, 1:].contiguous()}

    return make_batch


def hand_loop_tokens_per_s(model, make_batch, micro_batch, checkpointing, precision, steps):
    """Tokens/s of a plain training loop at one micro-batch: the median of `steps` timed
    steps after two warm-up steps; None when it runs out of memory."""
    device = next(model.parameters()).device
    fit.set_checkpointing(model, checkpointing)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    batch, times, failed = make_batch(micro_batch), [], False
    try:
        for i in range(steps + 2):
            devices.synchronize(device)
            start = time.perf_counter()
            with devices.autocast(device, autocast_dtype(precision)):
                loss_sum, n = causal_lm_loss(model, batch)
            (loss_sum / n).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            devices.synchronize(device)
            if i >= 2:
                times.append(time.perf_counter() - start)
    except devices.out_of_memory_errors():
        failed = True
    del opt, batch
    model.zero_grad(set_to_none=True)
    devices.empty_cache(device)
    if failed:
        return None
    times.sort()
    return micro_batch * batch_tokens(make_batch) / times[len(times) // 2]


def batch_tokens(make_batch) -> int:
    return make_batch(1)["input_ids"].shape[1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--tokens-per-step", default="512k")
    p.add_argument("--precision", default="bf16")
    p.add_argument("--device", default="auto")
    p.add_argument("--sweep", default="1,2,4,8,16,32,64")
    p.add_argument("--steps", type=int, default=5, help="timed steps per sweep point")
    p.add_argument("--smoke", action="store_true", help="tiny GPT on CPU, to check the script")
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = p.parse_args(argv)
    device = devices.resolve("cpu" if args.smoke else args.device)
    if args.smoke:
        args.seq_len, args.sweep, args.precision, args.steps = 64, "1,4,16", "fp32", 2
        model, _ = build_model("tiny", vocab_size=512, seq_len=args.seq_len)
        name, vocab = "built-in tiny GPT (smoke)", 512
    else:
        model, name = gpt2_124m(args.seq_len)
        vocab = VOCAB
    model.to(device)
    make_batch = batches(vocab, args.seq_len, device)
    target = parse_count(args.tokens_per_step, "--tokens-per-step")

    started = time.perf_counter()
    result = fit.find_micro_batch(
        model, make_batch, causal_lm_loss, seq_len=args.seq_len, tokens_per_step=target,
        precision=args.precision,
    )  # fmt: skip
    fit_seconds = time.perf_counter() - started
    print(fit.render_table(result))

    sweep = []
    for micro in (int(x) for x in args.sweep.split(",")):
        for checkpointing in (False, True):
            tps = hand_loop_tokens_per_s(
                model, make_batch, micro, checkpointing, args.precision, args.steps
            )
            sweep.append(
                {"micro_batch": micro, "checkpointing": checkpointing, "tokens_per_s": tps}
            )
    chosen = hand_loop_tokens_per_s(
        model, make_batch, result.micro_batch, result.checkpointing, args.precision, args.steps
    )
    best = max((s for s in sweep if s["tokens_per_s"]), key=lambda s: s["tokens_per_s"])
    ratio = chosen / best["tokens_per_s"] if chosen else None
    for s in sweep:
        tps = "out of memory" if s["tokens_per_s"] is None else f"{s['tokens_per_s']:,.0f}"
        print(
            f"sweep micro-batch {s['micro_batch']:>4} checkpointing {s['checkpointing']!s:>5}: {tps}"
        )
    print(
        f"fit chose micro-batch {result.micro_batch} (checkpointing {result.checkpointing}) in "
        f"{fit_seconds:.0f} s: {chosen or 0:,.0f} tokens/s by the hand loop, "
        f"{ratio or 0:.3f} x the sweep's best ({best['micro_batch']}, "
        f"checkpointing {best['checkpointing']}: {best['tokens_per_s']:,.0f} tokens/s)"
    )
    machine = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    report = {
        "model": name,
        "machine": machine or device.type,
        "device": str(device),
        "precision": args.precision,
        "seq_len": args.seq_len,
        "fit": result.to_dict(),
        "fit_seconds": fit_seconds,
        "fit_choice_tokens_per_s": chosen,
        "sweep": sweep,
        "ratio_to_best_of_sweep": ratio,
    }
    name = "gpu_fit_smoke.json" if args.smoke else "gpu_fit.json"
    os.makedirs(args.out, exist_ok=True)
    write_text_atomic(os.path.join(args.out, name), json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(exit_on_disk_full(main, os.path.basename(__file__)))
