"""FSDP2 (`fully_shard`) on 2 gloo processes on CPU: gradients reduce-scattered once per
window (or after every micro-batch, which keeps them sharded), exact against one process."""

from __future__ import annotations

from dataclasses import asdict

import pytest
from reference import make_gpt, max_rel_error, token_loss

from gradaccum import Accumulator
from gradaccum.distributed import aligned_windows
from gradaccum.distributed_check import run_ranks

from .ranks import (
    TIMEOUT_S,
    K,
    adamw,
    comparable,
    full,
    global_windows,
    rank_data,
    record_grads,
    reference_run,
    valid_tokens,
)

fsdp = pytest.importorskip("torch.distributed.fsdp", reason="torch without FSDP2")
if not hasattr(fsdp, "fully_shard"):
    pytest.skip("this torch has no torch.distributed.fsdp.fully_shard", allow_module_level=True)

EVEN = (12, 12)
EARLY = (12, 7)
SCENARIOS = {
    "once": (EVEN, False),
    "every": (EVEN, True),
    "early": (EARLY, False),
}


def _train(info, counts, every: bool) -> dict:
    model = make_gpt()
    for block in model.blocks:
        fsdp.fully_shard(block)
    fsdp.fully_shard(model)
    opt = adamw(model.parameters())
    grads = record_grads(opt)
    acc = Accumulator(model, opt, sync_every_micro_batch=every)
    data = rank_data(info.rank, counts[info.rank])
    results = [asdict(acc.step(w, token_loss)) for w in aligned_windows(data, K)]
    params = {name: full(p).detach().clone() for name, p in model.named_parameters()}
    return {"params": params, "grads": grads, "results": results}


def fsdp2_scenarios(info) -> dict:
    return {name: _train(info, counts, every) for name, (counts, every) in SCENARIOS.items()}


@pytest.fixture(scope="module")
def rank0():
    return run_ranks(fsdp2_scenarios, 2, timeout_s=TIMEOUT_S)[0]


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_params_after_adamw_steps_equal_one_process(rank0, scenario):
    counts, _ = SCENARIOS[scenario]
    windows = global_windows(counts)
    ref = reference_run(counts)
    got = rank0[scenario]
    assert max_rel_error(comparable(got["params"]), comparable(ref["params"])) <= 1e-5
    for seen, want in zip(got["grads"], ref["grads"], strict=True):
        assert max_rel_error(seen, want) <= 1e-5
    results = got["results"]
    assert [r["tokens"] for r in results] == [valid_tokens(w) for w in windows]
    assert [r["loss"] for r in results] == pytest.approx(ref["losses"], rel=1e-6)
    assert [r["step"] for r in results] == [1, 2, 3]


def test_one_reduce_scatter_per_shard_group_per_window(rank0):
    # one reduce-scatter per fully_shard unit (2 blocks and the root) per sync; FSDP2 pads
    # each parameter's first dimension to a multiple of the world size (2)
    model = make_gpt()
    groups = len(model.blocks) + 1
    padded = sum(-(-p.shape[0] // 2) * 2 * p[0].numel() for p in model.parameters())
    once, every = rank0["once"]["results"], rank0["every"]["results"]
    assert [r["grad_collectives"] for r in once] == [groups] * 3
    assert [r["grad_bytes"] for r in once] == [4 * padded] * 3
    assert [r["grad_collectives"] for r in every] == [K * groups] * 3
    assert [r["grad_bytes"] for r in every] == [K * 4 * padded] * 3
