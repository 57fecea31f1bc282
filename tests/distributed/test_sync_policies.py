"""The sync policies (`Accumulator(sync=...)`) on 4 gloo processes on CPU: "window" and
"micro" under FSDP2 on a 1-D mesh of 4, "hsdp" on a 2 x 2 mesh (replicas x shards). Each is
exact against the float64 big batch; bf16 parameters under "micro" and "hsdp" are summed in
fp32 as under "window"; the collectives each one sends are counted; what cannot run is
refused."""

from __future__ import annotations

from dataclasses import asdict

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from gradaccum import Accumulator
from gradaccum.parallel.process_group import aligned_windows
from gradaccum.testing import run_ranks
from tests.reference import big_batch_grads, make_gpt, max_rel_error, token_loss

from .ranks import (
    TIMEOUT_S,
    K,
    adamw,
    assert_steps_are_adamw,
    full,
    global_windows,
    rank_data,
    record_grads,
    refusal,
    valid_tokens,
)

fsdp = pytest.importorskip("torch.distributed.fsdp", reason="torch without FSDP2")
if not hasattr(fsdp, "fully_shard"):
    pytest.skip("this torch has no torch.distributed.fsdp.fully_shard", allow_module_level=True)

pytestmark = pytest.mark.slow  # one spawn of 4 processes for the module

WORLD = 4
MESHES = {"window": (WORLD,), "micro": (WORLD,), "hsdp": (2, 2)}
COUNTS = (8, 8, 8, 6)  # two windows of K; rank 3 repeats a batch (weight 0) in the second
BF16_COUNTS = (K, K, K, K - 1)


def _mesh(shape: tuple[int, ...]):
    from torch.distributed.device_mesh import init_device_mesh

    names = ("replicate", "shard") if len(shape) == 2 else ("shard",)
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _sharded(mesh, dtype=torch.float32, **kwargs):
    model = make_gpt().to(dtype)
    for block in model.blocks:
        fsdp.fully_shard(block, mesh=mesh, **kwargs)
    fsdp.fully_shard(model, mesh=mesh, **kwargs)
    return model


def _train(info, sync: str) -> dict:
    model = _sharded(_mesh(MESHES[sync]))
    opt = adamw(model.parameters())
    grads = record_grads(opt)
    acc = Accumulator(model, opt, sync=sync)
    before, results = [], []
    for window in aligned_windows(rank_data(info.rank, COUNTS[info.rank]), K):
        before.append([full(p).detach().clone() for p in model.parameters()])
        results.append(asdict(acc.step(window, token_loss)))
    params = {name: full(p).detach().clone() for name, p in model.named_parameters()}
    return {"params": params, "before": before, "grads": grads, "results": results}


def _bf16(info, sync: str) -> list[torch.Tensor]:
    """One window of bf16 parameters reduced in fp32, after a window abandoned half way (its
    partial sums must not reach the next)."""
    policy = fsdp.MixedPrecisionPolicy(reduce_dtype=torch.float32)
    model = _sharded(_mesh(MESHES[sync]), torch.bfloat16, mp_policy=policy)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    grads = record_grads(opt)
    acc = Accumulator(model, opt, sync=sync)
    dropped = acc.begin_window(rank_data(info.rank, K, seed=900))
    for batch in rank_data(info.rank, 2, seed=900):
        with dropped.micro_step():
            dropped.backward(*token_loss(model, batch))
    dropped.abandon()
    acc.step(rank_data(info.rank, BF16_COUNTS[info.rank]), token_loss)
    return grads[0]


def _refusals(info) -> dict:
    def sgd(model):
        return torch.optim.SGD(model.parameters(), lr=0.0)

    flat = _sharded(_mesh((WORLD,)))
    ddp = DistributedDataParallel(make_gpt())
    ddp_bf16 = DistributedDataParallel(make_gpt().to(torch.bfloat16))
    return {
        "hsdp_1d": refusal(lambda: Accumulator(flat, sgd(flat), sync="hsdp")),
        "hsdp_ddp": refusal(lambda: Accumulator(ddp, sgd(ddp), sync="hsdp")),
        "micro_ddp_bf16": refusal(lambda: Accumulator(ddp_bf16, sgd(ddp_bf16), sync="micro")),
    }


def sync_scenarios(info) -> dict:
    out = {sync: _train(info, sync) for sync in MESHES}
    out["bf16"] = {sync: _bf16(info, sync) for sync in MESHES}
    out["refused"] = _refusals(info)
    return out if info.rank == 0 else {"refused": out["refused"]}


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(sync_scenarios, WORLD, timeout_s=2 * TIMEOUT_S)


@pytest.fixture(scope="module")
def rank0(ranks):
    return ranks[0]


def _float64_reference(windows, before) -> list[list[torch.Tensor]]:
    """Each window's big-batch gradient in float64, at the parameters the ranks held before
    it."""
    model = make_gpt()
    out = []
    for window, start in zip(windows, before, strict=True):
        with torch.no_grad():
            for p, value in zip(model.parameters(), start, strict=True):
                p.copy_(value)
        out.append(big_batch_grads(model, window, torch.float64))
    return out


@pytest.mark.parametrize("sync", list(MESHES))
def test_each_policy_equals_the_float64_big_batch(rank0, sync):
    got = rank0[sync]
    windows = global_windows(COUNTS)
    want = _float64_reference(windows, got["before"])
    for seen, ref in zip(got["grads"], want, strict=True):
        assert max_rel_error(seen, ref) <= 1e-5
    assert_steps_are_adamw(got)
    assert [r["tokens"] for r in got["results"]] == [valid_tokens(w) for w in windows]
    assert [r["step"] for r in got["results"]] == [1, 2]


def _bf16_ulps_apart(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """The largest distance between `got` and `want`, element by element, in units of the
    bf16 spacing at `want` (2**(e - 7) for |want| in [2**e, 2**(e + 1)); near zero, at 1e-6 of
    the parameter's largest element)."""
    worst = 0.0
    for g, w in zip(got, want, strict=True):
        g, w = g.double(), w.double()
        scale = w.abs().clamp(min=1e-6 * w.abs().max().item())
        spacing = 2.0 ** (torch.floor(torch.log2(scale)) - 7)
        worst = max(worst, ((g - w).abs() / spacing).max().item())
    return worst


def test_bf16_parameters_are_summed_in_fp32_under_every_policy(rank0):
    # "window" adds the unsharded gradients in FSDP2's fp32 reduce dtype and rounds the sum
    # to bf16 once; "micro" and "hsdp" sum the reduced shards in fp32 and round once too, so
    # every element is within one bf16 spacing of "window"'s (the fp32 sums differ only in
    # order), and the error against the float64 big batch is the same. Adding each
    # micro-batch's bf16 shard to the last instead is thousands of spacings off somewhere.
    window = global_windows(BF16_COUNTS)[0]
    want = big_batch_grads(make_gpt().to(torch.bfloat16), window, torch.float64)
    got = rank0["bf16"]
    error = max_rel_error(got["window"], want)
    assert error <= 2.0**-6  # bf16 forward and backward, against float64
    for sync in ("micro", "hsdp"):
        assert _bf16_ulps_apart(got[sync], got["window"]) <= 1.0
        assert max_rel_error(got[sync], want) <= error + 2.0**-9


def _padded_bytes(shards: int) -> int:
    """fp32 bytes of the whole gradient with each parameter's first dimension padded to a
    multiple of `shards`, as FSDP2 lays out a reduce-scatter's input."""
    return sum(
        4 * -(-p.shape[0] // shards) * shards * p[0].numel() for p in make_gpt().parameters()
    )


def test_collectives_counted_per_policy(rank0):
    units = len(make_gpt().blocks) + 1  # one reduce-scatter per fully_shard unit per sync
    want = {
        # (collectives, bytes, of them across replicas, their bytes) per window
        "window": (units, _padded_bytes(WORLD), 0, 0),
        "micro": (K * units, K * _padded_bytes(WORLD), 0, 0),
        "hsdp": (
            K * units + units,
            K * _padded_bytes(2) + _padded_bytes(2) // 2,
            units,
            _padded_bytes(2) // 2,
        ),
    }
    for sync, counts in want.items():
        for r in rank0[sync]["results"]:
            got = (r["grad_collectives"], r["grad_bytes"])
            got += (r["grad_replica_collectives"], r["grad_replica_bytes"])
            assert got == counts, sync


def test_what_cannot_run_is_refused(ranks):
    for rank in ranks:
        out = rank["refused"]
        assert "2-D DeviceMesh" in out["hsdp_1d"] and "1-D mesh of 4" in out["hsdp_1d"]
        assert "not DistributedDataParallel" in out["hsdp_ddp"]
        assert "sync='micro' with DDP and torch.bfloat16" in out["micro_ddp_bf16"]


@pytest.mark.parametrize("sync", ["micro", "hsdp"])
def test_a_plain_module_refuses_sharded_policies(sync):
    model = make_gpt()
    with pytest.raises(ValueError, match="needs a model sharded with FSDP2"):
        Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), sync=sync)


def test_bad_sync_names_are_refused():
    model = make_gpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="expected one of window, micro, hsdp"):
        Accumulator(model, opt, sync="ring")
    with pytest.raises(ValueError, match="contradicts sync='hsdp'"):
        Accumulator(model, opt, sync="hsdp", sync_every_micro_batch=True)
