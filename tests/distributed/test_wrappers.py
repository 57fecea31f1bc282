"""Wrappers, groups and precisions users combine, on 2 gloo processes: torch.compile around
DDP, DDP and FSDP2 over a process subgroup, fp16 without token counts, bf16 parameters under
FSDP2 and DDP, and a model without any wrapper. Each test checks its scenario against one
process computed here without the engine (or against the refusal the engine must give).

All scenarios run in one pair of processes (starting them costs seconds).
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import asdict

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from gradaccum import Accumulator
from gradaccum.parallel.process_group import aligned_windows
from gradaccum.testing import run_ranks
from tests.reference import (
    GradRecorder,
    big_batch,
    big_batch_grads,
    make_gpt,
    max_rel_error,
    token_loss,
)

from .ranks import (
    TIMEOUT_S,
    K,
    full,
    global_windows,
    one_thread,
    rank_data,
    refusal,
    valid_tokens,
)

pytestmark = pytest.mark.slow  # one spawn of 2 processes for the module

fsdp = pytest.importorskip("torch.distributed.fsdp", reason="torch without FSDP2")
FP16_WINDOWS = 6


def _compiled_ddp(info) -> dict:
    # PyTorch's documented order: DDP first, then torch.compile around it
    model = make_gpt()
    compiled = torch.compile(DistributedDataParallel(model), backend="eager")
    opt = GradRecorder(compiled.parameters())
    result = Accumulator(compiled, opt).step(rank_data(info.rank, K), token_loss)
    return {"grads": opt.seen[0], "result": asdict(result)}


def _fp16_late(info) -> dict:
    # count_tokens=None: N is known only at the window's end
    model = make_gpt()
    ddp = DistributedDataParallel(model)
    opt = GradRecorder(ddp.parameters())
    acc = Accumulator(ddp, opt, precision="fp16", count_tokens=None)
    data = rank_data(info.rank, FP16_WINDOWS * K, seed=300)
    results = [asdict(acc.step(w, token_loss)) for w in aligned_windows(data, K)]
    return {"grads": opt.seen, "results": results}


def _subgroup(info) -> dict:
    # a 2-D layout of 2 ranks: 2-way "tensor parallel" x 1-way data parallel, so each rank's
    # data-parallel group holds only itself (every rank creates every group, in order)
    groups = [dist.new_group([0]), dist.new_group([1])]
    mine = groups[info.rank]
    out = {}
    ddp = DistributedDataParallel(make_gpt(), process_group=mine)
    opt = GradRecorder(ddp.parameters())
    out["ddp"] = asdict(Accumulator(ddp, opt).step(rank_data(info.rank, K), token_loss))
    out["ddp"]["grads"] = opt.seen[0]
    # the same group named explicitly (what a 2-D FSDP2 mesh needs)
    ddp = DistributedDataParallel(make_gpt(), process_group=mine)
    opt = GradRecorder(ddp.parameters())
    out["explicit"] = asdict(
        Accumulator(ddp, opt, group=mine).step(rank_data(info.rank, K), token_loss)
    )
    out["explicit"]["grads"] = opt.seen[0]
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("tp", "dp"))
    model = make_gpt()
    fsdp.fully_shard(model, mesh=mesh["dp"])
    seen = []
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    opt.register_step_pre_hook(
        lambda o, a, k: seen.append([full(p.grad).clone() for p in o.param_groups[0]["params"]])
    )
    out["fsdp2"] = asdict(Accumulator(model, opt).step(rank_data(info.rank, K), token_loss))
    out["fsdp2"]["grads"] = seen[0]
    return out


def _fsdp2_bf16(info) -> dict:
    def sharded(dtype=torch.bfloat16, **kwargs):
        model = make_gpt().to(dtype)
        for block in model.blocks:
            fsdp.fully_shard(block, **kwargs)
        fsdp.fully_shard(model, **kwargs)
        return model

    def accumulator(model, **kwargs):
        return Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.0), **kwargs)

    out = {
        "plain": refusal(lambda: accumulator(sharded())),
        "masters": refusal(lambda: accumulator(sharded(), master_weights=True)),
        # fp32 parameters computed in bf16, no reduce dtype: the window is added in bf16 too
        "compute_bf16": refusal(
            lambda: accumulator(
                sharded(torch.float32, mp_policy=fsdp.MixedPrecisionPolicy(torch.bfloat16))
            )
        ),
    }
    policy = fsdp.MixedPrecisionPolicy(reduce_dtype=torch.float32)
    model = sharded(mp_policy=policy)
    out["every"] = refusal(lambda: accumulator(model, sync_every_micro_batch=True))
    seen = []
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    opt.register_step_pre_hook(
        lambda o, a, k: seen.append([full(p.grad).clone() for p in o.param_groups[0]["params"]])
    )
    with one_thread():
        Accumulator(model, opt).step(rank_data(info.rank, K), token_loss)
    out["grads"] = seen[0]
    return out


def _ddp_bf16_every(info) -> str:
    ddp = DistributedDataParallel(make_gpt().to(torch.bfloat16))
    return refusal(
        lambda: Accumulator(ddp, GradRecorder(ddp.parameters()), sync_every_micro_batch=True)
    )


def _unwrapped(info) -> list[str]:
    model = make_gpt()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Accumulator(model, GradRecorder(model.parameters()))
    return [str(w.message) for w in caught]


def wrapper_scenarios(info) -> dict:
    return {
        "compiled_ddp": _compiled_ddp(info),
        "fp16_late": _fp16_late(info),
        "subgroup": _subgroup(info),
        "fsdp2_bf16": _fsdp2_bf16(info),
        "ddp_bf16_every": _ddp_bf16_every(info),
        "unwrapped": _unwrapped(info),
    }


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(wrapper_scenarios, 2, timeout_s=2 * TIMEOUT_S)


def test_compiled_ddp_sums_tokens_over_ranks(ranks):
    window = global_windows((K, K))[0]
    want = big_batch_grads(make_gpt(), window)
    for rank in ranks:
        got = rank["compiled_ddp"]
        assert max_rel_error(got["grads"], want) <= 1e-5
        assert got["result"]["tokens"] == valid_tokens(window)
        assert got["result"]["grad_collectives"] == 1


def _fp16_big_batch_overflows(model, window, scale: float) -> bool:
    """Whether one process taking the window as one batch, in fp16 autocast with the loss
    scaled by `scale` / N, meets a non-finite gradient."""
    model = copy.deepcopy(model)
    with torch.autocast("cpu", dtype=torch.float16):
        loss_sum, n = token_loss(model, big_batch(window))
    (loss_sum * scale / n).backward()
    return not all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_fp16_without_counts_skips_no_window_the_big_batch_can_take(ranks):
    windows = global_windows((FP16_WINDOWS * K,) * 2, seed=300)
    model = make_gpt()
    assert not any(_fp16_big_batch_overflows(model, w, 2.0**16) for w in windows)
    got = ranks[0]["fp16_late"]
    assert [r["skipped"] for r in got["results"]] == [False] * FP16_WINDOWS
    assert [r["loss_scale"] for r in got["results"]] == [2.0**16] * FP16_WINDOWS
    assert [r["tokens"] for r in got["results"]] == [valid_tokens(w) for w in windows]
    # parameters never change (the recorder does not step): each window's reference is the
    # fp32 big-batch gradient, within fp16 autocast's documented 5e-2
    for seen, window in zip(got["grads"], windows, strict=True):
        assert max_rel_error(seen, big_batch_grads(model, window)) <= 5e-2


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp2", "explicit"])
def test_data_parallel_subgroup_gives_each_group_its_own_window(ranks, wrapper):
    for rank, out in enumerate(ranks):
        got = out["subgroup"][wrapper]
        mine = rank_data(rank, K)
        assert max_rel_error(got["grads"], big_batch_grads(make_gpt(), mine)) <= 1e-5
        assert got["tokens"] == valid_tokens(mine)


def test_fsdp2_bf16_parameters_accumulate_in_fp32_or_are_refused(ranks):
    out = ranks[0]["fsdp2_bf16"]
    assert "MixedPrecisionPolicy(reduce_dtype=torch.float32)" in out["plain"]
    assert "MixedPrecisionPolicy" in out["masters"]
    assert "fp32 buffers" not in out["masters"]
    assert "MixedPrecisionPolicy(reduce_dtype=torch.float32)" in out["compute_bf16"]
    assert out["every"] == "accepted"  # micro: each reduced shard added in fp32 by the engine
    # with an fp32 reduce dtype: the window summed in fp32 over both ranks, rounded once to
    # the bf16 parameters' gradient (relative 2**-8 at most); reference: each micro-batch's
    # bf16 gradient of loss_sum / N summed in float64
    batches = global_windows((K, K))[0]
    n = valid_tokens(batches)
    model = make_gpt().to(torch.bfloat16)
    want = None
    with one_thread():
        for batch in batches:
            twin = copy.deepcopy(model)
            loss_sum, _ = token_loss(twin, batch)
            (loss_sum / n).backward()
            grads = [p.grad.double() for p in twin.parameters()]
            want = grads if want is None else [a + b for a, b in zip(want, grads, strict=True)]
    assert max_rel_error(out["grads"], want) <= 2.0**-8


def test_ddp_bf16_sync_every_micro_batch_is_refused(ranks):
    for rank in ranks:
        assert "sync_every_micro_batch=True with DDP" in rank["ddp_bf16_every"]


def test_a_model_without_wrapper_under_a_process_group_is_named_once(ranks):
    for rank in ranks:
        assert len(rank["unwrapped"]) == 1
        assert "GPT is not wrapped" in rank["unwrapped"][0]
