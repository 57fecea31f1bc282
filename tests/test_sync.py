"""`sync` in one process: wrapper detection, the no-sync context, collectives that run alone,
and the traffic counter. The same functions under 2 ranks: tests/distributed/."""

from __future__ import annotations

import warnings

import pytest
import torch

from gradaccum.parallel import sync


def test_a_plain_module_is_one_device():
    model = torch.nn.Linear(3, 2)
    dp = sync.data_parallel(model)
    assert (dp.kind, dp.wrapper, dp.group, dp.world, dp.averages) == ("none", model, None, 1, False)
    assert not sync.is_ddp(model) and not sync.is_fsdp2(model)
    assert not sync.averages_over_ranks(model)
    assert sync.fsdp2_accumulation_dtype(model) is None


def test_no_warning_without_a_process_group():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sync.data_parallel(torch.nn.Linear(3, 2))


def test_compiled_module_is_seen_through():
    model = torch.nn.Linear(3, 2)
    compiled = torch.compile(model, backend="eager")
    assert compiled is not model
    assert sync.unwrap_compiled(compiled) is model
    assert sync.unwrap_compiled(model) is model
    assert sync.data_parallel(compiled).wrapper is model


class FakeFSDP2(torch.nn.Linear):
    """Answers to FSDP2's two methods the engine duck-types on, and records sync requests."""

    def __init__(self):
        super().__init__(3, 2)
        self.requests: list[bool] = []

    def set_requires_gradient_sync(self, value: bool) -> None:
        self.requests.append(value)

    def reshard(self) -> None:
        pass


def test_no_backward_sync_turns_fsdp2_sync_off_and_back_on_inside_compile():
    model = FakeFSDP2()
    compiled = torch.compile(model, backend="eager")
    assert sync.is_fsdp2(compiled) and sync.averages_over_ranks(compiled)
    with sync.no_backward_sync(compiled):
        assert model.requests == [False]
    assert model.requests == [False, True]
    with sync.no_backward_sync(compiled, enabled=False):
        pass
    assert model.requests == [False, True]


def test_no_backward_sync_restores_fsdp2_sync_after_an_error():
    model = FakeFSDP2()
    with pytest.raises(KeyError), sync.no_backward_sync(model):
        raise KeyError("backward failed")
    assert model.requests == [False, True]


def test_collectives_return_their_input_when_alone():
    assert sync.agree_on_window(17, 3) == (17, 3)
    assert sync.agree_on_window(0, 0, has_batch=False) == (0, 0)
    assert sync.max_over_ranks(5) == 5
    values = torch.tensor([1.5, 2.0])
    assert torch.equal(sync.all_reduce_sum(values), torch.tensor([1.5, 2.0]))
    assert sync.world_size() == 1 and not sync.is_distributed()


def test_window_size_alone_is_this_rank_s_own():
    assert sync.agree_on_window_size(17, 3, capacity=40) == sync.WindowSize(17, 3, 40)
    assert sync.agree_on_window_size(0, 2).capacity is None


def test_unused_parameters_need_fsdp2_to_do_anything():
    assert sync.fsdp2_reduce_unused(torch.nn.Linear(2, 2)) is False
    sync.drop_unreduced_grads([], reset=True)  # nothing sharded: nothing to drop


def test_grad_traffic_counts_collectives_and_bytes():
    traffic = sync.GradTraffic()
    traffic.record(torch.zeros(10, dtype=torch.float32))
    traffic.record(torch.zeros(3, 4, dtype=torch.bfloat16))
    assert (traffic.collectives, traffic.bytes) == (2, 10 * 4 + 12 * 2)


def test_nothing_to_count_on_a_plain_module():
    assert sync.count_grad_traffic(torch.nn.Linear(2, 2)) is None
