"""QLoRA step time with and without activation checkpointing, side by side.

Checkpointing keeps each block's input only and runs the block's forward again in backward:
less activation memory for one more forward per step. The seeds put the price at about +30%;
with a frozen 4-bit base the backward computes no weight gradient for the base (only the
input's and the adapters'), so the recomputed forward is a larger share of the step. This
measures it: one model (a Llama from config, random weights, its blocks' linear layers in NF4,
LoRA rank 8 on every projection: `qlora_model.build_qlora`, as `gradaccum train --base-bits 4
--lora-rank 8` builds it), a copy with checkpointing on (`--activation-checkpointing`: the
non-reentrant kind, input gradients enabled as for k-bit training), the same windows of k
micro-batches through `Accumulator` for both, AdamW.

- First, one window's gradient from both (SGD at lr 0, `verification.reference.engine_grads`):
  recomputation must not change it (|g_on - g_off| / |g_off|, printed).
- Then `--rounds` rounds, the order alternating (off, on / on, off), each arm timing `--steps`
  optimizer steps after the warm-up step: seconds per step, the ratio on / off per round and
  the median of those ratios; the forward alone (no backward) timed beside them on the
  checkpointing-off copy, so the extra time can be read as a share of a forward.
- Peak memory per arm where the device reports it (not on the CPU).

    python benchmarks/qlora_checkpointing.py                 # CPU, about a minute
    python benchmarks/qlora_checkpointing.py --device cuda --hidden 2048 --intermediate 5504 \
        --layers 8 --heads 16 --seq-len 2048 --micro-batch 1 --accum-steps 8 --vocab 32000
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from qlora_model import build_qlora, llama_config, random_windows  # noqa: E402

from gradaccum import Accumulator, hf  # noqa: E402
from gradaccum.models.checkpointing import checkpointing_enabled, set_checkpointing  # noqa: E402
from gradaccum.models.optimizer import adamw  # noqa: E402
from gradaccum.parallel import devices  # noqa: E402
from gradaccum.utils.atomic import write_text_atomic  # noqa: E402
from gradaccum.verification.reference import engine_grads, whole_rel_error  # noqa: E402

SHAPE_FLAGS = ("hidden", "intermediate", "layers", "heads", "vocab")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--intermediate", type=int, default=688)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    ap.add_argument("--micro-batch", type=int, default=2, help="sequences per micro-batch")
    ap.add_argument("--accum-steps", type=int, default=4, help="micro-batches per step (k)")
    ap.add_argument("--lora-rank", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=1, help="timed optimizer steps per arm and round")
    ap.add_argument("--json", metavar="PATH", help="also write the figures here")
    args = ap.parse_args(argv)
    for name in ("hidden", "intermediate", "layers", "heads", "vocab", "seq_len", "micro_batch",
                 "accum_steps", "lora_rank", "rounds", "steps"):  # fmt: skip
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must be at least 1")
    return args


class Arm:
    """One copy of the model with its own optimizer and engine, checkpointing on or off."""

    def __init__(self, name: str, model, device: torch.device, precision: str):
        self.name, self.model, self.device = name, model, device
        params = [p for p in model.parameters() if p.requires_grad]
        self.acc = Accumulator(
            model, adamw(params, lr=1e-4), precision=precision, count_tokens=hf.count_tokens
        )
        self.seconds: list[float] = []
        self.peak: int | None = None

    def time_steps(self, windows) -> float:
        """Seconds per optimizer step over `windows`; the device's peak memory kept."""
        devices.synchronize(self.device)
        devices.reset_peak_memory(self.device)
        start = time.perf_counter()
        for window in windows:
            self.acc.step(window, hf.loss_fn)
        devices.synchronize(self.device)
        seconds = (time.perf_counter() - start) / len(windows)
        peak = devices.peak_memory_bytes(self.device)
        if peak is not None:
            self.peak = max(self.peak or 0, peak)
        self.seconds.append(seconds)
        return seconds


def forward_seconds(model, window, device: torch.device, precision: str) -> float:
    """Seconds of the window's forwards alone (graph kept, as in training; no backward)."""
    dtype = {"fp32": None, "bf16": torch.bfloat16}[precision]
    devices.synchronize(device)
    start = time.perf_counter()
    for batch in window:
        with devices.autocast(device, dtype):
            loss_sum, _ = hf.loss_fn(model, batch)
        del loss_sum
    devices.synchronize(device)
    return time.perf_counter() - start


def gradient_agreement(off, on, window) -> float:
    """|g_on - g_off| / |g_off| for one window through the engine (SGD at lr 0)."""
    g_off, _ = engine_grads(off, [window], hf.loss_fn, count_tokens=hf.count_tokens)
    g_on, _ = engine_grads(on, [window], hf.loss_fn, count_tokens=hf.count_tokens)
    return whole_rel_error(g_on, g_off)


def main(argv=None) -> int:
    args = parse_args(argv)
    devices.check_device(args.device)
    device = devices.resolve(args.device)
    precision = "fp32" if device.type == "cpu" else "bf16"
    threads = torch.get_num_threads()
    config = llama_config(args.hidden, args.intermediate, args.layers, args.heads, args.vocab,
                          args.seq_len)  # fmt: skip
    built = time.perf_counter()
    model, info = build_qlora(config, device, args.lora_rank, checkpointing=False)
    ckpt = copy.deepcopy(model)
    ckpt.enable_input_require_grads()  # what k-bit preparation does with checkpointing
    set_checkpointing(ckpt, True)
    assert checkpointing_enabled(ckpt) and not checkpointing_enabled(model)
    tokens = args.micro_batch * args.seq_len * args.accum_steps
    print(
        f"QLoRA checkpointing A/B: Llama hidden {args.hidden}, MLP {args.intermediate}, "
        f"{args.layers} layers, {args.heads} heads, vocab {args.vocab}; NF4 base, "
        f"{info.describe()}; micro-batch {args.micro_batch} x {args.seq_len} tokens x k "
        f"{args.accum_steps} = {tokens:,} tokens per step; {device}, {precision}, "
        f"{threads} thread(s); built in {time.perf_counter() - built:.1f} s",
        flush=True,
    )
    windows = random_windows(
        args.steps + 1, args.accum_steps, args.micro_batch, args.seq_len, args.vocab, device
    )
    agreement = gradient_agreement(model, ckpt, windows[0])
    print(f"gradient with checkpointing against without: {agreement:.1e} (relative)", flush=True)

    arms = {"off": Arm("off", model, device, precision), "on": Arm("on", ckpt, device, precision)}
    for arm in arms.values():  # warm-up: allocator, kernels, the optimizer's state
        arm.time_steps(windows[:1])
        arm.seconds.clear()
    ratios, forwards = [], []
    for r in range(args.rounds):
        order = ("off", "on") if r % 2 == 0 else ("on", "off")
        got = {name: arms[name].time_steps(windows[1:]) for name in order}
        forwards.append(forward_seconds(model, windows[1], device, precision))
        ratios.append(got["on"] / got["off"])
        print(
            f"round {r + 1}/{args.rounds} ({', '.join(order)}): off {got['off']:.3f} s, "
            f"on {got['on']:.3f} s per step, ratio {ratios[-1]:.3f}",
            flush=True,
        )
    result = summary(args, arms, ratios, forwards, agreement, device, precision, threads, info)
    print(render(result))
    if args.json:
        write_text_atomic(args.json, json.dumps(result, indent=2) + "\n")
    return 0


def summary(args, arms, ratios, forwards, agreement, device, precision, threads, info) -> dict:
    import bitsandbytes
    import peft
    import transformers

    off = statistics.median(arms["off"].seconds)
    on = statistics.median(arms["on"].seconds)
    forward = statistics.median(forwards)
    return {
        "shape": {k: getattr(args, k) for k in SHAPE_FLAGS},
        "micro_batch": args.micro_batch,
        "seq_len": args.seq_len,
        "accum_steps": args.accum_steps,
        "lora": info.to_dict() | {"targets": list(info.targets)},
        "rounds": args.rounds,
        "steps_per_round": args.steps,
        "step_s_off": off,
        "step_s_on": on,
        "forward_s": forward,
        "ratio_per_round": ratios,
        "ratio_median": statistics.median(ratios),
        "extra_over_forward": (on - off) / forward,
        "peak_bytes_off": arms["off"].peak,
        "peak_bytes_on": arms["on"].peak,
        "gradient_rel_error": agreement,
        "device": str(device),
        "precision": precision,
        "threads": threads,
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "bitsandbytes": bitsandbytes.__version__,
    }


def render(s: dict) -> str:
    def gb(b):
        return "-" if b is None else f"{b / 1e9:.2f} GB"

    k = s["accum_steps"]
    rows = [
        "",
        "| activation checkpointing | s per optimizer step (median) | s per micro-step | peak memory |",
        "| --- | --- | --- | --- |",
        f"| off | {s['step_s_off']:.3f} | {s['step_s_off'] / k:.3f} | {gb(s['peak_bytes_off'])} |",
        f"| on | {s['step_s_on']:.3f} | {s['step_s_on'] / k:.3f} | {gb(s['peak_bytes_on'])} |",
        "",
        f"step time on / off: median of the rounds' ratios {s['ratio_median']:.3f} "
        f"(+{s['ratio_median'] - 1:.0%}; the seeds' figure: +30%); per round "
        + ", ".join(f"{r:.3f}" for r in s["ratio_per_round"]),
        f"the extra time is {s['extra_over_forward']:.2f} x the window's forward alone "
        f"({s['forward_s']:.3f} s): the recomputed forward",
        f"gradients with and without: {s['gradient_rel_error']:.1e} apart (relative)",
    ]
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
