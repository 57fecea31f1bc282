"""FSDP2 (`fully_shard`) on 2 gloo processes on CPU: gradients reduce-scattered once per
window (or after every micro-batch, which keeps them sharded), exact against one process."""

from __future__ import annotations

from dataclasses import asdict

import pytest
import torch

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
    same_weights_reference,
    valid_tokens,
)

fsdp = pytest.importorskip("torch.distributed.fsdp", reason="torch without FSDP2")
if not hasattr(fsdp, "fully_shard"):
    pytest.skip("this torch has no torch.distributed.fsdp.fully_shard", allow_module_level=True)

pytestmark = pytest.mark.slow  # one spawn of 2 processes for the module

EVEN = (12, 12)
EARLY = (12, 7)
FIRST_K = 5
FIRST = (7, 2)  # k = 5: rank 1 runs out in the FIRST window (5 and 2), then has nothing
SCENARIOS = {
    "once": (EVEN, False),
    "every": (EVEN, True),
    "early": (EARLY, False),
}


def _sharded(**kwargs):
    model = make_gpt()
    for block in model.blocks:
        fsdp.fully_shard(block, **kwargs)
    fsdp.fully_shard(model, **kwargs)
    return model


def _train(info, counts, every: bool) -> dict:
    model = _sharded()
    opt = adamw(model.parameters())
    grads = record_grads(opt)
    acc = Accumulator(model, opt, sync_every_micro_batch=every)
    data = rank_data(info.rank, counts[info.rank])
    before, results = [], []
    for window in aligned_windows(data, K):
        # every rank: gathering the shards is a collective
        before.append([full(p).detach().clone() for p in model.parameters()])
        results.append(asdict(acc.step(window, token_loss)))
    params = {name: full(p).detach().clone() for name, p in model.named_parameters()}
    return {"params": params, "before": before, "grads": grads, "results": results}


def _first_window(info) -> dict:
    # lr 0: the parameters stay put, so every window's reference starts from the same model
    model = _sharded()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    grads = record_grads(opt)
    acc = Accumulator(model, opt)
    data = rank_data(info.rank, FIRST[info.rank])
    results = [asdict(acc.step(w, token_loss)) for w in aligned_windows(data, FIRST_K)]
    return {"grads": grads, "results": results}


def _stranded(info) -> str:
    # rank 1 has no data at all: both ranks must fail fast with the same message, not hang
    model = _sharded()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.0))
    try:
        acc.step(rank_data(info.rank, K) if info.rank == 0 else [], token_loss)
    except RuntimeError as err:
        return str(err)
    return "no error"


def fsdp2_scenarios(info) -> dict:
    out = {name: _train(info, counts, every) for name, (counts, every) in SCENARIOS.items()}
    out["first"] = _first_window(info)
    out["stranded"] = _stranded(info)  # last: the group is not used after it
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(fsdp2_scenarios, 2, timeout_s=TIMEOUT_S)


@pytest.fixture(scope="module")
def rank0(ranks):
    return ranks[0]


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_each_window_from_the_same_params_equals_one_process(rank0, scenario):
    counts, _ = SCENARIOS[scenario]
    windows = global_windows(counts)
    got = rank0[scenario]
    ref = same_weights_reference(counts, got["before"])
    for seen, want in zip(got["grads"], ref["grads"], strict=True):
        assert max_rel_error(seen, want) <= 1e-5
    assert_steps_are_adamw(got)
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


def test_rank_that_runs_out_in_the_first_window_matches_one_process(ranks):
    windows = global_windows(FIRST, k=FIRST_K)
    assert [len(w) for w in windows] == [7, 2]
    want = [big_batch_grads(make_gpt(), w) for w in windows]
    for rank in ranks:
        got = rank["first"]
        assert [r["micro_steps"] for r in got["results"]] == [FIRST_K, 2]
        assert [r["tokens"] for r in got["results"]] == [valid_tokens(w) for w in windows]
        for seen, ref in zip(got["grads"], want, strict=True):
            assert max_rel_error(seen, ref) <= 1e-5


def test_rank_without_any_data_fails_on_every_rank(ranks):
    for rank in ranks:
        assert "ranks [1] have no micro-batch" in rank["stranded"]
