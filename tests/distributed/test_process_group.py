"""The process group from torchrun's environment, without starting processes."""

from __future__ import annotations

import pytest
import torch

from gradaccum.parallel import backends, collectives
from gradaccum.parallel import process_group as distributed
from gradaccum.parallel.process_group import aligned_windows, env_ranks, init_distributed
from gradaccum.testing import run_ranks


def test_env_ranks_read_torchrun_variables():
    env = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1"}
    assert env_ranks(env) == (3, 8, 1)
    assert env_ranks({}) == (0, 1, 0)


@pytest.mark.parametrize(
    "env, message",
    [
        ({"RANK": "two"}, "RANK='two'"),
        ({"WORLD_SIZE": "-1"}, "WORLD_SIZE='-1'"),
        ({"WORLD_SIZE": "0"}, "WORLD_SIZE=0"),
        ({"RANK": "4", "WORLD_SIZE": "4"}, "RANK=4: expected below WORLD_SIZE=4"),
    ],
)
def test_bad_environment_is_named(env, message):
    with pytest.raises(ValueError, match=message):
        env_ranks(env)


def test_without_torchrun_runs_alone(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    info = init_distributed(device="cpu")
    assert (info.rank, info.world_size, info.backend, info.owns_group) == (0, 1, None, False)
    assert not torch.distributed.is_initialized()
    distributed.teardown(info)  # nothing to destroy


def test_missing_master_and_mismatched_backend_fail_before_joining(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(ValueError, match="MASTER_ADDR and MASTER_PORT not set"):
        init_distributed(device="cpu")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    with pytest.raises(ValueError, match="backend 'nccl' needs a cuda device"):
        init_distributed(device="cpu", backend="nccl")
    assert not torch.distributed.is_initialized()


def test_single_process_windows_and_counting():
    assert [len(w) for w in aligned_windows(range(10), 4)] == [4, 4, 2]
    assert collectives.agree_on_window(17, 3) == (17, 3)
    assert backends.count_grad_traffic(torch.nn.Linear(2, 2)) is None


def _rank_fails(info):
    if info.rank == 1:
        raise KeyError("rank one broke")
    torch.distributed.barrier()  # rank 0 waits for a rank that is gone
    return "unreachable"


@pytest.mark.slow
def test_a_failing_rank_is_reported_not_waited_for():
    with pytest.raises(RuntimeError, match="rank one broke"):
        run_ranks(_rank_fails, 2, timeout_s=60)
