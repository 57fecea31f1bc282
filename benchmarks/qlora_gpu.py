"""The seeds' first example on one GPU: QLoRA on a 7B Llama, micro-batch 1 x 2048, k = 128.

NOT RUN ON A GPU YET: it has run on the CPU only, with --tiny (a two-layer Llama, a few
micro-steps), which exercises every line but measures nothing about a GPU. Its figures belong
in benchmarks/RESULTS.md once a GPU has run it (benchmarks/gpu_suite.sh, part qlora_7b).

The seeds: a 7B base stored in 4 bits, LoRA adapters, 2048-token micro-steps at about 80 ms on
an RTX 4090, k = 128 (262k tokens per optimizer step). Here: Llama 2 7B's shape (hidden 4096,
MLP 11008, 32 layers, 32 heads, vocab 32000) with random weights drawn on the device in bf16,
its blocks' linear layers in NF4 with double-quantised constants computed in bf16, LoRA rank
16 on every projection, AdamW, bf16 autocast (`qlora_model.build_qlora`: what `gradaccum train
--base-bits 4 --lora-rank 16 --precision bf16` builds). For each --checkpointing arm (off:
every activation kept; on: the blocks recomputed in backward), one untimed warm-up window of
2 micro-batches, then --steps optimizer steps of k micro-batches timed:

- time per micro-step (the step's wall time / k) and tokens per second;
- peak memory allocated on the device over the timed steps, against the plan's total for the
  same run (`gradaccum plan --model llama2-7b --lora-rank 16 --base-bits 4 --seq-len 2048
  --micro-batch 1 --flash-attention [--checkpointing full] --json`, computed here with the
  same `make_plan`), and the quantised model's stored bytes against the plan's weights.

    python benchmarks/qlora_gpu.py --device cuda --json qlora_7b.json          # about 4 minutes
    python benchmarks/qlora_gpu.py --device cpu --tiny                          # seconds
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from qlora_model import LLAMA_7B, build_qlora, llama_config, random_windows  # noqa: E402

from gradaccum import Accumulator, hf  # noqa: E402
from gradaccum.models import quantized  # noqa: E402
from gradaccum.models.checkpointing import set_checkpointing  # noqa: E402
from gradaccum.models.optimizer import adamw  # noqa: E402
from gradaccum.parallel import devices  # noqa: E402
from gradaccum.plan.inputs import PlanInputs  # noqa: E402
from gradaccum.plan.make import make_plan  # noqa: E402
from gradaccum.utils.atomic import write_text_atomic  # noqa: E402

TINY = {"hidden": 64, "intermediate": 172, "layers": 2, "heads": 4, "vocab": 256}
"""--tiny's shape: seconds on a CPU, every code path of the 7B run."""
TINY_SIZES = {"seq_len": 64, "accum_steps": 4}
SEED_MICRO_STEP_S = 0.080
"""The seeds' anchor: about 80 ms per 2048-token micro-step on an RTX 4090."""
WARM_UP_MICRO_BATCHES = 2


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true",
                    help=f"a tiny Llama ({TINY}), --seq-len 64 and k 4 unless given: a CPU "
                    "check of the script, no GPU figure")  # fmt: skip
    ap.add_argument("--seq-len", type=int, help="tokens per sequence (default 2048)")
    ap.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch")
    ap.add_argument("--accum-steps", type=int, help="micro-batches per step, k (default 128)")
    ap.add_argument("--steps", type=int, default=2, help="timed optimizer steps per arm")
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--checkpointing", choices=("off", "on", "both"), default="both",
                    help="activation checkpointing in the timed arms")  # fmt: skip
    ap.add_argument("--json", metavar="PATH", help="also write the figures here")
    args = ap.parse_args(argv)
    sizes = TINY_SIZES if args.tiny else {"seq_len": 2048, "accum_steps": 128}
    for name, value in sizes.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    for name in ("seq_len", "micro_batch", "accum_steps", "steps", "lora_rank"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must be at least 1")
    return args


def planned(args, shape: dict, device: torch.device, checkpointing: bool) -> dict:
    """The plan's memory for this run (GB): the 7B by its preset; --tiny by its layers,
    hidden, heads and vocab (the plan's generic block, close to but not the tiny Llama's)."""
    model = {"model": "llama2-7b"} if not args.tiny else {
        k: shape[k] for k in ("layers", "hidden", "heads", "vocab")
    }  # fmt: skip
    inputs = PlanInputs(
        **model,
        lora_rank=args.lora_rank,
        base_bits=4,
        seq_len=args.seq_len,
        micro_batch=args.micro_batch,
        precision="fp32" if device.type == "cpu" else "bf16",
        checkpointing="full" if checkpointing else "none",
        flash_attention=device.type == "cuda",  # sdpa's flash kernel for bf16 on CUDA
    )
    return make_plan(inputs).to_dict()["memory"]


def peak_bytes(device: torch.device) -> tuple[int | None, str]:
    """The device's peak allocated bytes since the last reset, or on the CPU the process's
    peak resident memory (since it started: a bound, not the steps' own)."""
    peak = devices.peak_memory_bytes(device)
    if peak is not None:
        return peak, "allocated on the device"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux
    return rss, "process peak resident (CPU)"


def run_arm(model, args, device: torch.device, checkpointing: bool, windows, warm) -> dict:
    """Warm-up, then the timed steps with checkpointing on or off; the figures."""
    set_checkpointing(model, checkpointing)
    precision = "fp32" if device.type == "cpu" else "bf16"
    params = [p for p in model.parameters() if p.requires_grad]
    acc = Accumulator(
        model, adamw(params, lr=1e-4), precision=precision, count_tokens=hf.count_tokens
    )
    acc.step(warm, hf.loss_fn)
    devices.synchronize(device)
    devices.empty_cache(device)
    devices.reset_peak_memory(device)
    seconds = []
    for window in windows:
        start = time.perf_counter()
        result = acc.step(window, hf.loss_fn)
        devices.synchronize(device)
        seconds.append(time.perf_counter() - start)
        print(f"  step: {seconds[-1]:.2f} s, loss {result.loss:.4f}", flush=True)
    peak, what = peak_bytes(device)
    plan = planned(args, args.shape, device, checkpointing)
    step = sorted(seconds)[len(seconds) // 2]  # the median (the upper one of two)
    tokens = args.micro_batch * args.seq_len * args.accum_steps
    return {
        "checkpointing": checkpointing,
        "step_s": seconds,
        "micro_step_s": step / args.accum_steps,
        "tokens_per_s": tokens / step,
        "peak_bytes": peak,
        "peak_is": what,
        "plan_total_gb": plan["total_gb"],
        "plan_activations_gb": plan["activations_gb"],
        "peak_over_plan": None if device.type == "cpu" else peak / 1e9 / plan["total_gb"],
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    devices.check_device(args.device)
    device = devices.resolve(args.device)
    args.shape = TINY if args.tiny else LLAMA_7B
    config = llama_config(**args.shape, seq_len=args.seq_len)
    start = time.perf_counter()
    model, info = build_qlora(config, device, args.lora_rank, checkpointing=True)
    stored = quantized.stored_bytes(model)
    plan0 = planned(args, args.shape, device, False)
    print(
        f"QLoRA {'tiny Llama' if args.tiny else 'Llama 7B shape'} on {device}: {info.describe()}"
        f"; NF4 base; built in {time.perf_counter() - start:.1f} s; model holds "
        f"{size(stored)} (the plan's weights and frozen base: {size(plan0['params_gb'] * 1e9)}"
        f"); micro-batch {args.micro_batch} x {args.seq_len} tokens, k {args.accum_steps}, "
        f"{args.steps} timed step(s) per arm",
        flush=True,
    )
    windows = random_windows(args.steps, args.accum_steps, args.micro_batch, args.seq_len,
                             args.shape["vocab"], device, seed=1)  # fmt: skip
    warm = random_windows(1, WARM_UP_MICRO_BATCHES, args.micro_batch, args.seq_len,
                          args.shape["vocab"], device, seed=2)[0]  # fmt: skip
    arms = {"off": [False], "on": [True], "both": [False, True]}[args.checkpointing]
    results = []
    for checkpointing in arms:
        print(f"activation checkpointing {'on' if checkpointing else 'off'}:", flush=True)
        results.append(run_arm(model, args, device, checkpointing, windows, warm))
    out = summary(args, device, info, stored, plan0, results)
    print(render(out))
    if args.json:
        write_text_atomic(args.json, json.dumps(out, indent=2) + "\n")
    return 0


def summary(args, device, info, stored: int, plan0: dict, results: list[dict]) -> dict:
    import bitsandbytes

    name = devices_name(device)
    return {
        "model": "tiny Llama" if args.tiny else "Llama 7B shape, random weights",
        "shape": args.shape,
        "lora": info.to_dict() | {"targets": list(info.targets)},
        "micro_batch": args.micro_batch,
        "seq_len": args.seq_len,
        "accum_steps": args.accum_steps,
        "steps": args.steps,
        "stored_bytes": stored,
        "plan_params_gb": plan0["params_gb"],
        "arms": results,
        "seed_micro_step_s": SEED_MICRO_STEP_S,
        "device": name,
        "torch": torch.__version__,
        "bitsandbytes": bitsandbytes.__version__,
    }


def devices_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return str(device)


def size(n_bytes: float) -> str:
    return f"{n_bytes / 1e9:.2f} GB" if n_bytes >= 1e8 else f"{n_bytes / 1e6:.2f} MB"


def render(s: dict) -> str:
    rows = [
        "",
        f"{s['model']} on {s['device']}, micro-batch {s['micro_batch']} x {s['seq_len']}, "
        f"k {s['accum_steps']}, LoRA rank {s['lora']['rank']}",
        "| checkpointing | s per micro-step | tokens/s | peak memory | plan's total | peak / plan |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for a in s["arms"]:
        rows.append(
            f"| {'on' if a['checkpointing'] else 'off'} | {a['micro_step_s']:.4f} | "
            f"{a['tokens_per_s']:,.0f} | {size(a['peak_bytes'])} ({a['peak_is']}) | "
            f"{size(a['plan_total_gb'] * 1e9)} | "
            + ("-" if a["peak_over_plan"] is None else f"{a['peak_over_plan']:.2f}")
            + " |"
        )
    rows.append(
        f"model held: {size(s['stored_bytes'])} (plan's weights {size(s['plan_params_gb'] * 1e9)}"
        f"); the seeds' anchor: {s['seed_micro_step_s'] * 1e3:.0f} ms per 2048-token "
        "micro-step on an RTX 4090"
    )
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
