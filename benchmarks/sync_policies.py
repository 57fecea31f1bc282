"""The engine's gradient-sync policies under FSDP2, side by side: `Accumulator(sync="window")`
(no sync until the window's last micro-batch, the whole gradient held), "micro" (a
reduce-scatter after every micro-batch into an fp32 shard) and, on 4 ranks or more, "hsdp"
(replicas x shards: reduce-scatter within the shard group every micro-batch, one all-reduce
across replicas per window).

The policies run the same model, data and k on the same ranks, each on its own copy; they
alternate (window micro hsdp, then reversed, ...) for several rounds and the script prints per
policy the median wall time per optimizer step and its ratio to "window", the gradient
collectives and bytes each launched per step (`StepResult`), and on an accelerator the peak
memory of a step. On one device the mesh has one rank: the collectives are trivial and the
figures are the memory and the engine's own cost; the multi-rank times are the planner's
(`gradaccum plan --sync`).

    python benchmarks/sync_policies.py [--world-size 2]     # gloo processes on CPU
    torchrun --nproc-per-node 1 benchmarks/sync_policies.py --preset gpt2-124m --bf16-params
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys

import torch
from ddp_sync import make_windows, run_and_write, timed  # as the DDP benchmark does

from gradaccum import Accumulator
from gradaccum.models.gpt import GPT, GPTConfig
from gradaccum.models.loss import causal_lm_loss
from gradaccum.parallel import devices
from gradaccum.utils.atomic import exit_on_disk_full
from gradaccum.utils.choices import BUILTIN_MODELS as PRESETS


def policies(world: int) -> list[str]:
    """window and micro everywhere; hsdp where the ranks make 2 replicas of 2 or more."""
    return ["window", "micro"] + (["hsdp"] if world >= 4 and world % 2 == 0 else [])


def sharded(base: GPT, policy: str, world: int, device: torch.device, bf16: bool):
    """A copy of `base` under FSDP2 for `policy`: each block, then the root, over a 1-D mesh
    of every rank, or for hsdp a (2, world / 2) mesh; fp32 reduction whatever the dtype."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = copy.deepcopy(base).to(torch.bfloat16 if bf16 else torch.float32)
    shape = (2, world // 2) if policy == "hsdp" else (world,)
    names = ("replicate", "shard") if policy == "hsdp" else ("shard",)
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)
    mp = MixedPrecisionPolicy(reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def bench_rank(info, args) -> dict | None:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=args.vocab, seq_len=args.seq_len, **PRESETS[args.preset])
    base = GPT(cfg).to(info.device)
    names = policies(info.world_size)
    accs, last = {}, {}
    for name in names:
        model = sharded(base, name, info.world_size, info.device, args.bf16_params)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        accs[name] = Accumulator(model, opt, sync=name)
    windows = make_windows(args, info.rank, info.device)

    def run(name: str):
        return lambda: last.__setitem__(name, [accs[name].step(w, causal_lm_loss) for w in windows])

    for name in names:  # warm-up: FSDP2's lazy init, the allocator
        run(name)()
    times: dict[str, list[float]] = {name: [] for name in names}
    peaks: dict[str, list[int]] = {name: [] for name in names}
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            devices.reset_peak_memory(info.device)
            times[name].append(timed(run(name), info.device) / args.windows)
            peak = devices.peak_memory_bytes(info.device)
            if peak is not None:
                peaks[name].append(peak)
    if not info.is_main:
        return None
    window = statistics.median(times["window"])
    return {
        "world_size": info.world_size,
        "backend": info.backend,
        "device": str(info.device),
        "preset": args.preset,
        "params": sum(p.numel() for p in base.parameters()),
        "parameter_dtype": "bf16" if args.bf16_params else "fp32",
        "accum_steps": args.accum_steps,
        "micro_batch": args.micro_batch,
        "seq_len": args.seq_len,
        "rounds": args.rounds,
        "policies": {
            name: {
                "ms_per_step": [1e3 * t for t in times[name]],
                "median_ms_per_step": 1e3 * statistics.median(times[name]),
                "median_ratio_to_window": statistics.median(times[name]) / window,
                "grad_collectives_per_step": last[name][-1].grad_collectives,
                "grad_bytes_per_step": last[name][-1].grad_bytes,
                "peak_memory_bytes": max(peaks[name]) if peaks[name] else None,
            }
            for name in names
        },
    }


def print_table(result: dict) -> None:
    print(
        f"FSDP2, {result['world_size']} rank(s) ({result['backend']}, {result['device']}), GPT "
        f"{result['preset']} ({result['params'] / 1e6:.2f}M {result['parameter_dtype']} "
        f"params), k = {result['accum_steps']}, micro-batch {result['micro_batch']} x "
        f"{result['seq_len']}, {result['rounds']} rounds"
    )
    print(f"{'policy':<8}{'ms/step':>10}{'/ window':>10}{'collectives':>13}{'grad MB':>10}"
          f"{'peak GB':>10}")  # fmt: skip
    for name, p in result["policies"].items():
        peak = "n/a" if p["peak_memory_bytes"] is None else f"{p['peak_memory_bytes'] / 1e9:.2f}"
        print(
            f"{name:<8}{p['median_ms_per_step']:>10.1f}{p['median_ratio_to_window']:>10.3f}"
            f"{p['grad_collectives_per_step']:>13}{p['grad_bytes_per_step'] / 1e6:>10.2f}"
            f"{peak:>10}"
        )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=2, help="ranks to spawn on CPU (no torchrun)")
    p.add_argument("--accum-steps", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per micro-batch")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence")
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--bf16-params", action="store_true", help="bf16 parameters, fp32 reduction")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--windows", type=int, default=2, help="optimizer steps per timed run")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds before giving up")
    p.add_argument(
        "--out", default=os.path.join(os.path.dirname(__file__), "results", "sync_policies.json")
    )
    return run_and_write(bench_rank, print_table, p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(exit_on_disk_full(main, os.path.basename(__file__)))
