"""The window gradient under each wrapper, group and precision, on 2 gloo ranks on CPU,
against one process taking the whole window (computed here, without the engine).

Cases: DDP, torch.compile(DDP), FSDP2 (fp32); DDP and FSDP2 over a data-parallel subgroup
(each rank its own group); DDP + fp16 autocast without token counts (windows skipped);
bf16 parameters under DDP (the engine's fp32 buffer) and FSDP2 (no reduce dtype, and
`MixedPrecisionPolicy(reduce_dtype=torch.float32)`); DDP + bf16 parameters +
`sync_every_micro_batch`. Error = max over parameters of |g - g_ref| / |g_ref|; a case the
engine refuses prints its message.

    python benchmarks/wrapper_errors.py
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from reference import (  # noqa: E402
    GradRecorder,
    big_batch_grads,
    make_gpt,
    max_rel_error,
    ragged_batches,
    token_loss,
)

from gradaccum import Accumulator  # noqa: E402
from gradaccum.testing import run_ranks  # noqa: E402
from gradaccum.utils.atomic import exit_on_disk_full, write_text_atomic  # noqa: E402

K = 4
FP16_WINDOWS = 6


def rank_data(rank: int, count: int, seed: int = 100) -> list[dict]:
    return ragged_batches("gpt", count, seed=seed + 7 * rank, batch=2 + rank)


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def recorded(opt) -> list:
    seen: list = []
    opt.register_step_pre_hook(
        lambda o, a, k: seen.append(
            [full(p.grad).detach().float().clone() for g in o.param_groups for p in g["params"]]
        )
    )
    return seen


def sharded(dtype=torch.float32, **kwargs):
    from torch.distributed.fsdp import fully_shard

    model = make_gpt().to(dtype)
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def one_window(model, rank, **acc_kwargs) -> dict:
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    seen = recorded(opt)
    try:
        result = Accumulator(model, opt, **acc_kwargs).step(rank_data(rank, K), token_loss)
    except ValueError as err:
        return {"refused": str(err)}
    return {"grads": seen[0], "collectives": result.grad_collectives, "tokens": result.tokens}


def rank_cases(info) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    torch.set_num_threads(1)
    r = info.rank
    out = {
        "ddp_fp32": one_window(DistributedDataParallel(make_gpt()), r),
        "compiled_ddp_fp32": one_window(
            torch.compile(DistributedDataParallel(make_gpt()), backend="eager"), r
        ),
        "fsdp2_fp32": one_window(sharded(), r),
    }
    groups = [dist.new_group([0]), dist.new_group([1])]
    out["ddp_subgroup"] = one_window(
        DistributedDataParallel(make_gpt(), process_group=groups[r]), r
    )
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("tp", "dp"))
    model = make_gpt()
    from torch.distributed.fsdp import fully_shard

    fully_shard(model, mesh=mesh["dp"])
    out["fsdp2_subgroup"] = one_window(model, r)
    bf16 = torch.bfloat16
    out["ddp_bf16_params"] = one_window(DistributedDataParallel(make_gpt().to(bf16)), r)
    out["fsdp2_bf16_params"] = one_window(sharded(bf16), r)
    fp32_reduce = MixedPrecisionPolicy(reduce_dtype=torch.float32)
    out["fsdp2_bf16_params_fp32_reduce"] = one_window(sharded(bf16, mp_policy=fp32_reduce), r)
    out["ddp_bf16_sync_every"] = one_window(
        DistributedDataParallel(make_gpt().to(bf16)), r, sync_every_micro_batch=True
    )
    out["ddp_fp16_no_counts"] = fp16_windows(r)
    return out if info.is_main else {}


def fp16_windows(rank: int) -> dict:
    ddp = DistributedDataParallel(make_gpt())
    opt = GradRecorder(ddp.parameters())
    acc = Accumulator(ddp, opt, precision="fp16", count_tokens=None)
    data = rank_data(rank, FP16_WINDOWS * K, seed=300)
    results = [acc.step(data[i : i + K], token_loss) for i in range(0, len(data), K)]
    return {
        "skipped": sum(r.skipped for r in results),
        "final_scale": acc.scaler.scale,
        "grads": opt.seen[0] if opt.seen else None,
    }


def fp64_sum_bf16(windows_batches: list[dict]) -> list[torch.Tensor]:
    """Each micro-batch's bf16 gradient of loss_sum / N, summed in float64 (exact addition)."""
    model = make_gpt().to(torch.bfloat16)
    n = sum(int((b["labels"] != -100).sum()) for b in windows_batches)
    total = None
    for batch in windows_batches:
        twin = copy.deepcopy(model)
        loss_sum, _ = token_loss(twin, batch)
        (loss_sum / n).backward()
        grads = [p.grad.double() for p in twin.parameters()]
        total = grads if total is None else [a + b for a, b in zip(total, grads, strict=True)]
    return total


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--out", default=os.path.join(os.path.dirname(__file__), "results", "wrapper_errors.json")
    )
    args = ap.parse_args(argv)
    got = run_ranks(rank_cases, 2, timeout_s=900)[0]
    torch.set_num_threads(1)
    window = rank_data(0, K) + rank_data(1, K)
    fp32_ref = big_batch_grads(make_gpt(), window)
    refs = {
        "ddp_fp32": fp32_ref,
        "compiled_ddp_fp32": fp32_ref,
        "fsdp2_fp32": fp32_ref,
        "ddp_subgroup": big_batch_grads(make_gpt(), rank_data(0, K)),
        "fsdp2_subgroup": big_batch_grads(make_gpt(), rank_data(0, K)),
    }
    bf16_ref = fp64_sum_bf16(window)
    for key in ("ddp_bf16_params", "fsdp2_bf16_params", "fsdp2_bf16_params_fp32_reduce"):
        refs[key] = bf16_ref
    refs["ddp_bf16_sync_every"] = bf16_ref
    fp16_first = rank_data(0, K, seed=300) + rank_data(1, K, seed=300)
    refs["ddp_fp16_no_counts"] = big_batch_grads(make_gpt(), fp16_first)
    table = {}
    for case, out in got.items():
        row = {k: v for k, v in out.items() if k != "grads"}
        if out.get("grads") is not None:
            row["rel_error"] = max_rel_error(out["grads"], refs[case])
        table[case] = row
        print(f"{case:32s} {json.dumps(row)}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    write_text_atomic(args.out, json.dumps({"torch": torch.__version__, "cases": table}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(exit_on_disk_full(main, os.path.basename(__file__)))
