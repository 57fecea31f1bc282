"""DDP and FSDP2 with accumulation against one process taking the global batch, on the
devices torchrun gives (GPUs with nccl, Ascend NPUs with hccl, CPU with gloo).

The test suite runs the same check on CPU with gloo; this script is for a machine with
accelerators, where nccl/hccl, device-side collectives and GPU kernels take part:

    torchrun --nproc-per-node 2 benchmarks/gpu_equivalence.py [--steps 3] [--accum-steps 4]

Rank 0 runs the single-process reference on its own device, prints one line per case and
writes benchmarks/results/gpu_equivalence.json. Exit code 1 if a case fails.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch.distributed as dist

from gradaccum.models.gpt import GPT, GPTConfig
from gradaccum.parallel.process_group import init_distributed, teardown
from gradaccum.testing import EquivalenceSetup, compare, run_check_rank, single_process_run
from gradaccum.utils.atomic import exit_on_disk_full, write_text_atomic


def small_gpt(seed: int):
    """A 2-layer GPT, vocab 37, 16 positions, width 32."""
    import torch

    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=37, seq_len=16, n_layer=2, n_head=2, n_embd=32))


CASES = [("ddp", False), ("ddp", True), ("fsdp2", False), ("fsdp2", True)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--accum-steps", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--tolerance", type=float, default=1e-5)
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, npu, ...")
    p.add_argument("--backend", default=None, help="default: from the device")
    p.add_argument(
        "--out", default=os.path.join(os.path.dirname(__file__), "results", "gpu_equivalence.json")
    )
    args = p.parse_args(argv)
    if "WORLD_SIZE" not in os.environ:
        print("run me under torchrun: torchrun --nproc-per-node N " + sys.argv[0], file=sys.stderr)
        return 2
    info = init_distributed(device=args.device, backend=args.backend)
    reports = []
    try:
        for wrapper, every in CASES:
            setup = EquivalenceSetup(
                world_size=info.world_size,
                accum_steps=args.accum_steps,
                steps=args.steps,
                wrapper=wrapper,
                sync_every_micro_batch=every,
                tolerance=args.tolerance,
            )
            got = run_check_rank(info, small_gpt, setup)
            if info.is_main:
                want = single_process_run(small_gpt, setup, info.device, ranks=got)
                report = compare(setup, got, want)
                reports.append(report)
                print(
                    f"{wrapper:<6} sync {'every micro-batch' if every else 'once per window':<17}"
                    f" grad err {report.grad_rel_error:.1e}  step err "
                    f"{report.step_error:.1e}  loss err {report.loss_rel_error:.1e}  "
                    f"collectives/window {report.grad_collectives}  "
                    f"{'ok' if report.passed else 'FAILED'}",
                    flush=True,
                )
            dist.barrier()
    finally:
        teardown(info)
    if not info.is_main:
        return 0
    result = {
        "device": str(info.device),
        "backend": info.backend,
        "world_size": info.world_size,
        "cases": [r.to_dict() for r in reports],
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    write_text_atomic(args.out, json.dumps(result, indent=2))
    return 0 if all(r.passed for r in reports) else 1


if __name__ == "__main__":
    sys.exit(exit_on_disk_full(main, os.path.basename(__file__)))
