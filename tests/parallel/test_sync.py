"""`parallel` in one process: the backend found for each wrapper, its no-sync context,
collectives that run alone, and the traffic counter. The same under 2 ranks:
tests/distributed/."""

from __future__ import annotations

import gc
import warnings
import weakref

import pytest
import torch

from gradaccum.parallel import backends, collectives, traffic


def test_a_plain_module_is_one_device():
    model = torch.nn.Linear(3, 2)
    dp = backends.data_parallel(model)
    assert type(dp) is backends.SingleDevice and isinstance(dp, backends.Backend)
    assert (dp.wrapper, dp.group, dp.world, dp.averages_over_ranks) == (model, None, 1, False)
    assert not backends.is_ddp(model) and not backends.is_fsdp2(model)
    assert dp.accumulation_dtype() is None


def test_no_warning_without_a_process_group():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        backends.data_parallel(torch.nn.Linear(3, 2))


def test_compiled_module_is_seen_through():
    model = torch.nn.Linear(3, 2)
    compiled = torch.compile(model, backend="eager")
    assert compiled is not model
    assert backends.unwrap_compiled(compiled) is model
    assert backends.unwrap_compiled(model) is model
    assert backends.data_parallel(compiled).wrapper is model


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
    dp = backends.data_parallel(compiled)
    assert backends.is_fsdp2(compiled) and dp.averages_over_ranks and dp.wrapper is model
    with dp.no_backward_sync():
        assert model.requests == [False]
    assert model.requests == [False, True]
    with dp.no_backward_sync(enabled=False):
        pass
    assert model.requests == [False, True]


def test_no_backward_sync_restores_fsdp2_sync_after_an_error():
    model = FakeFSDP2()
    with pytest.raises(KeyError), backends.data_parallel(model).no_backward_sync():
        raise KeyError("backward failed")
    assert model.requests == [False, True]


def test_collectives_return_their_input_when_alone():
    assert collectives.agree_on_window(17, 3) == (17, 3)
    assert collectives.agree_on_window(0, 0, has_batch=False) == (0, 0)
    assert collectives.max_over_ranks(5) == 5
    values = torch.tensor([1.5, 2.0])
    assert torch.equal(collectives.all_reduce_sum(values), torch.tensor([1.5, 2.0]))
    assert collectives.world_size() == 1 and not collectives.is_distributed()


def test_window_size_alone_is_this_rank_s_own():
    expected = collectives.WindowSize(17, 3, 40)
    assert collectives.agree_on_window_size(17, 3, capacity=40) == expected
    assert collectives.agree_on_window_size(0, 2).capacity is None


def test_unused_parameters_need_fsdp2_to_do_anything():
    dp = backends.data_parallel(torch.nn.Linear(2, 2))
    assert dp.reduce_unused_parameters() is False
    dp.drop_unreduced_grads(reset=True)  # nothing sharded: nothing to drop


def test_grad_traffic_counts_collectives_and_bytes():
    counter = traffic.GradTraffic()
    counter.record(torch.zeros(10, dtype=torch.float32))
    counter.record(torch.zeros(3, 4, dtype=torch.bfloat16))
    assert (counter.collectives, counter.bytes) == (2, 10 * 4 + 12 * 2)


def test_nothing_to_count_on_a_plain_module():
    assert backends.count_grad_traffic(torch.nn.Linear(2, 2)) is None


class FakeShardedRoot(FakeFSDP2):
    """Takes FSDP2's custom reduce-scatter as `fully_shard` modules do, and keeps it."""

    def __init__(self):
        super().__init__()
        self.comms: list = []

    def set_custom_reduce_scatter(self, comm) -> None:
        self.comms.append(comm)


def test_one_counter_per_wrapper_kept_off_the_model():
    # DDP takes one comm hook per model, so a second Accumulator on the same wrapper must read
    # the counter the first one installed; it is not stored on the user's module.
    model = FakeShardedRoot()
    first = backends.count_grad_traffic(model)
    again = backends.data_parallel(model).count_traffic()
    assert first is not None and again is first
    assert len(model.comms) == 1 and model.comms[0].traffic is first
    assert not any("traffic" in name for name in vars(model))
    gone = weakref.ref(first)
    del model, first, again
    gc.collect()
    assert gone() is None  # the counter lives as long as its wrapper, no longer


def test_fsdp2_internals_that_cannot_be_read_fall_back():
    dp = backends.data_parallel(FakeFSDP2())  # no _get_fsdp_state: FSDP2's internals differ
    assert isinstance(dp, backends.Backend) and dp.shards_gradients
    assert (dp.group, dp.world, dp.accumulation_dtype()) == (None, 1, None)
    dp.drop_unreduced_grads(reset=True)  # nothing it can read: nothing dropped, no error
