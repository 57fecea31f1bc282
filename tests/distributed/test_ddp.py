"""DDP on 2 gloo processes: one gradient sync per window, tokens summed over ranks, ranks that
run out of data early, and bf16 parameters synced by the engine itself.

All scenarios run in one pair of processes (starting them costs seconds); each test checks
one scenario against a single-process reference computed here, without the engine.
"""

from __future__ import annotations

import copy
from dataclasses import asdict

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from gradaccum import Accumulator
from gradaccum.parallel import backends
from gradaccum.parallel.process_group import aligned_windows
from gradaccum.testing import run_ranks
from tests.reference import GradRecorder, big_batch_grads, make_gpt, max_rel_error, token_loss

from .ranks import (
    TIMEOUT_S,
    K,
    adamw,
    assert_steps_are_adamw,
    global_windows,
    one_thread,
    rank_data,
    record_grads,
    same_weights_reference,
    valid_tokens,
)

pytestmark = pytest.mark.slow  # one spawn of 2 processes for the module

EVEN = (12, 12)  # micro-batches per rank: 3 windows of k = 4 each
EARLY = (12, 7)  # rank 1 runs out in window 2 and has nothing in window 3
FIRST_K = 5
FIRST = (7, 2)  # k = 5: rank 1 runs out in the FIRST window (5 and 2), then has nothing


def _train(info, counts, **acc_kwargs) -> dict:
    model = make_gpt()
    ddp = DistributedDataParallel(model)
    opt = adamw(ddp.parameters())
    grads = record_grads(opt)
    acc = Accumulator(ddp, opt, **acc_kwargs)
    data = rank_data(info.rank, counts[info.rank])
    before, results = [], []
    for window in aligned_windows(data, K):
        before.append([p.detach().clone() for p in model.parameters()])
        results.append(asdict(acc.step(window, token_loss)))
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    return {"params": params, "before": before, "grads": grads, "results": results}


def _buckets(info) -> dict:
    # A 1-byte bucket cap: once DDP has rebuilt its buckets (after the first window) every
    # parameter is a bucket of its own.
    model = make_gpt()
    ddp = DistributedDataParallel(model, bucket_cap_mb=1e-6)
    out = {}
    for every in (False, True):
        acc = Accumulator(ddp, GradRecorder(ddp.parameters()), sync_every_micro_batch=every)
        data = rank_data(info.rank, 3 * K)
        out[every] = [acc.step(w, token_loss).grad_collectives for w in aligned_windows(data, K)]
    return out


def _bf16(info) -> dict:
    out = {}
    for normalize in ("tokens", "micro_batch_mean"):
        model = make_gpt().to(torch.bfloat16)
        ddp = DistributedDataParallel(model)
        opt = GradRecorder(ddp.parameters())
        acc = Accumulator(ddp, opt, master_weights=True, normalize=normalize)
        result = acc.step(rank_data(info.rank, K), token_loss)
        out[normalize] = {"grads": opt.seen[0], "result": asdict(result)}
    return out


def _hooks(info) -> dict:
    # a hook of the user's own (fp16 compression) through count_grad_traffic is counted; one
    # registered behind gradaccum's back cannot be, and the result says so with -1
    out = {}
    for own in (True, False):
        model = make_gpt()
        ddp = DistributedDataParallel(model)
        if own:
            backends.count_grad_traffic(ddp, hook=default_hooks.fp16_compress_hook, state=None)
        else:
            ddp.register_comm_hook(None, default_hooks.allreduce_hook)
        opt = GradRecorder(ddp.parameters())
        result = Accumulator(ddp, opt).step(rank_data(info.rank, K), token_loss)
        out[own] = {"grads": opt.seen[0], "result": asdict(result)}
    return out


def _first_window(info) -> dict:
    # rank 1 runs out at its third micro-step of the first window: it repeats its own last
    # batch of this window with weight 0, then (window 2) that same batch again
    model = make_gpt()
    ddp = DistributedDataParallel(model)
    opt = GradRecorder(ddp.parameters())
    acc = Accumulator(ddp, opt)
    data = rank_data(info.rank, FIRST[info.rank])
    results = [asdict(acc.step(w, token_loss)) for w in aligned_windows(data, FIRST_K)]
    return {"grads": opt.seen, "results": results}


def _stranded(info) -> str:
    # rank 1 has no data at all: both ranks must fail fast with the same message, not hang
    model = make_gpt()
    acc = Accumulator(DistributedDataParallel(model), GradRecorder(model.parameters()))
    data = rank_data(info.rank, K) if info.rank == 0 else []
    try:
        acc.step(data, token_loss)
    except RuntimeError as err:
        return str(err)
    return "no error"


def ddp_scenarios(info) -> dict:
    out = {
        "once": _train(info, EVEN),
        "every": _train(info, EVEN, sync_every_micro_batch=True),
        "early": _train(info, EARLY),
        "buckets": _buckets(info),
        "bf16": _bf16(info),
        "hooks": _hooks(info),
        "first": _first_window(info),
    }
    out["stranded"] = _stranded(info)  # last: the group is not used after it
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(ddp_scenarios, 2, timeout_s=TIMEOUT_S)


@pytest.fixture(scope="module")
def rank0(ranks):
    return ranks[0]


def _num_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("scenario, counts", [("once", EVEN), ("early", EARLY)])
def test_each_window_from_the_same_params_equals_one_process(rank0, scenario, counts):
    windows = global_windows(counts)
    got = rank0[scenario]
    ref = same_weights_reference(counts, got["before"])
    for seen, want in zip(got["grads"], ref["grads"], strict=True):
        assert max_rel_error(seen, want) <= 1e-5
    assert_steps_are_adamw(got)
    results = got["results"]
    assert [r["tokens"] for r in results] == [valid_tokens(w) for w in windows]
    assert [r["loss"] for r in results] == pytest.approx(ref["losses"], rel=1e-6)
    assert [r["micro_steps"] for r in results] == [K, K, K]
    assert [r["step"] for r in results] == [1, 2, 3]


def test_ranks_hold_unequal_token_counts():
    # the premise of the exactness tests: a mean of per-rank means would be wrong here
    counts = [valid_tokens(rank_data(r, EVEN[r])[:K]) for r in range(2)]
    assert counts[0] != counts[1]


def test_rank_that_ran_out_ends_with_the_others(ranks):
    # both ranks took the same 3 optimizer steps (rank 1 had 4, 3 and 0 micro-batches)
    for rank in ranks:
        assert [r["step"] for r in rank["early"]["results"]] == [1, 2, 3]
    same = [
        torch.equal(a, b)
        for a, b in zip(
            ranks[0]["early"]["params"].values(), ranks[1]["early"]["params"].values(), strict=True
        )
    ]
    assert all(same)


def test_one_gradient_all_reduce_per_window_not_k(rank0):
    # ~27k parameters (108 kB of fp32 gradient) fit in DDP's first bucket (1 MiB): one
    # all-reduce of the whole gradient per window; syncing every micro-batch makes it k
    grad_bytes = 4 * _num_params(make_gpt())
    once, every = rank0["once"]["results"], rank0["every"]["results"]
    assert [r["grad_collectives"] for r in once] == [1, 1, 1]
    assert [r["grad_bytes"] for r in once] == [grad_bytes] * 3
    assert [r["grad_collectives"] for r in every] == [K] * 3
    assert [r["grad_bytes"] for r in every] == [K * grad_bytes] * 3


def test_sync_every_micro_batch_gives_the_same_gradient(rank0):
    ref = same_weights_reference(EVEN, rank0["every"]["before"])
    for seen, want in zip(rank0["every"]["grads"], ref["grads"], strict=True):
        assert max_rel_error(seen, want) <= 1e-5


def test_collectives_equal_the_bucket_count(rank0):
    buckets = len(list(make_gpt().parameters()))  # one parameter per bucket
    once, every = rank0["buckets"][False], rank0["buckets"][True]
    # the first window may still run on DDP's initial buckets; later ones are rebuilt
    assert once[1:] == [buckets, buckets]
    assert every == [K * buckets] * 3


def test_bf16_params_sync_once_in_fp32(rank0):
    # reference: the window gradient as exact accumulation gives it, each micro-batch's
    # gradient of loss_sum / N (bf16 backward) summed over both ranks in float64
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
    got = rank0["bf16"]["tokens"]
    assert all(g.dtype == torch.float32 for g in got["grads"])
    assert max_rel_error(got["grads"], want) <= 1e-5
    assert got["result"]["tokens"] == n
    # the engine's own all-reduce of its flat fp32 buffer: one per window
    assert got["result"]["grad_collectives"] == 1
    assert got["result"]["grad_bytes"] == 4 * _num_params(model)


def test_bf16_micro_batch_mean_averages_over_ranks(rank0):
    # normalize="micro_batch_mean": the mean over all 2k micro-batches of each one's mean
    # gradient, whichever way the ranks sync
    batches = global_windows((K, K))[0]
    model = make_gpt().to(torch.bfloat16)
    per_micro = []
    with one_thread():
        for batch in batches:
            twin = copy.deepcopy(model)
            loss_sum, n = token_loss(twin, batch)
            (loss_sum / n).backward()
            per_micro.append([p.grad.double() for p in twin.parameters()])
    want = [sum(gs) / len(gs) for gs in zip(*per_micro, strict=True)]
    assert max_rel_error(rank0["bf16"]["micro_batch_mean"]["grads"], want) <= 1e-5


def test_rank_without_any_data_fails_on_every_rank(ranks):
    for rank in ranks:
        assert "ranks [1] have no micro-batch" in rank["stranded"]


def test_own_comm_hook_is_counted_and_a_foreign_one_reported(rank0):
    batches = global_windows((K, K))[0]
    want = big_batch_grads(make_gpt(), batches)
    own, foreign = rank0["hooks"][True], rank0["hooks"][False]
    # fp16 compression ran (fp16 rounding, about 2**-11, shows in the gradient) and each
    # rank's bucket was handed to it in fp32
    assert 1e-5 < max_rel_error(own["grads"], want) <= 1e-2
    assert own["result"]["grad_collectives"] == 1
    assert own["result"]["grad_bytes"] == 4 * _num_params(make_gpt())
    assert max_rel_error(foreign["grads"], want) <= 1e-5
    assert (foreign["result"]["grad_collectives"], foreign["result"]["grad_bytes"]) == (-1, -1)


def test_rank_that_runs_out_in_the_first_window_matches_one_process(ranks):
    # reference: one process, each global window (rank 0's 5 and rank 1's 2 micro-batches,
    # then rank 0's last 2) as one batch, no engine
    windows = global_windows(FIRST, k=FIRST_K)
    assert [len(w) for w in windows] == [7, 2]
    want = [big_batch_grads(make_gpt(), w) for w in windows]
    for rank in ranks:
        got = rank["first"]
        assert [r["micro_steps"] for r in got["results"]] == [FIRST_K, 2]
        assert [r["tokens"] for r in got["results"]] == [valid_tokens(w) for w in windows]
        assert [r["step"] for r in got["results"]] == [1, 2]
        for seen, ref in zip(got["grads"], want, strict=True):
            assert max_rel_error(seen, ref) <= 1e-5
