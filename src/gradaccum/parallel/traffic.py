"""Counting the gradient collectives a wrapper launches, so each window can report its cost.

A DDP model reports through a communication hook that counts each bucket before reducing it;
FSDP2 through a reduce-scatter comm that counts each reduce-scatter before running it. Both
feed a `GradTraffic`. The backends (`parallel.backends`, `parallel.fsdp2`) install them.

DDP takes one communication hook per model and keeps it as long as the model lives, so the
counter that hook feeds belongs to the wrapper, not to one Accumulator: a second Accumulator
built on the same model (or a script that counted before building one) must read the same
counter, since it could not register a second hook. `shared_counter` keeps that one counter
per wrapper in a table keyed weakly by the wrapper: nothing is stored on the user's model,
and the counter goes when the wrapper does.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class GradTraffic:
    """Gradient collectives a DDP or FSDP2 model launched, counted as they are launched.

    Bytes are those this rank hands to each collective (its input tensor): a DDP bucket, the
    whole padded gradient of a `fully_shard` unit for a reduce-scatter (in FSDP2's reduce
    dtype), that unit's reduced shard for HSDP's all-reduce across replicas. A ring puts about
    (n - 1) / n of a reduce-scatter's input and 2 (n - 1) / n of an all-reduce's on the wire."""

    collectives: int = 0
    """DDP bucket all-reduces, FSDP2 reduce-scatters and HSDP all-reduces across replicas so
    far."""
    bytes: int = 0
    """Bytes of gradient this rank handed to them (the input of each collective)."""
    replica_collectives: int = 0
    """Of `collectives`, HSDP's all-reduces across replicas (inter-node when the replica
    dimension spans nodes)."""
    replica_bytes: int = 0
    """Of `bytes`, those handed to HSDP's all-reduces across replicas."""

    def record(self, tensor: torch.Tensor, across_replicas: bool = False) -> None:
        """Count one collective whose input is `tensor`; `across_replicas`: HSDP's all-reduce."""
        nbytes = tensor.numel() * tensor.element_size()
        self.collectives += 1
        self.bytes += nbytes
        if across_replicas:
            self.replica_collectives += 1
            self.replica_bytes += nbytes


# The wrapper's counter, for as long as the wrapper lives (see the module's docstring).
_COUNTERS: weakref.WeakKeyDictionary[torch.nn.Module, GradTraffic] = weakref.WeakKeyDictionary()


def shared_counter(
    wrapper: torch.nn.Module, install: Callable[[GradTraffic], bool]
) -> GradTraffic | None:
    """The counter of `wrapper`'s gradient collectives: the one installed before, else a new
    one that `install(counter)` hooks into the wrapper (it returns False where it cannot,
    and then None is returned and nothing is kept)."""
    existing = _COUNTERS.get(wrapper)
    if existing is not None:
        return existing
    counter = GradTraffic()
    if not install(counter):
        return None
    _COUNTERS[wrapper] = counter
    return counter


def counting_hook(hook, state):
    """A DDP communication hook, to register with the counter as its state: it counts each
    bucket, then reduces it with `hook(state, bucket)`."""

    # No annotation on `bucket`: DDP compares it with dist.GradBucket, and under postponed
    # evaluation it would be a string.
    def counted_hook(traffic: GradTraffic, bucket):
        traffic.record(bucket.buffer())
        return hook(state, bucket)

    return counted_hook


class CountedReduceScatter:
    """FSDP2's reduce-scatter comm (the `ReduceScatter` interface of `fully_shard`), counted;
    it delegates to `inner` when given (a custom comm the user set, or symmetric memory)."""

    def __init__(self, traffic: GradTraffic, inner=None):
        self.traffic = traffic
        self.inner = inner

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if self.inner is not None:
            return self.inner.allocate(size, dtype=dtype, device=device)
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        self.traffic.record(input_tensor)
        if self.inner is not None:
            return self.inner(
                output_tensor=output_tensor,
                input_tensor=input_tensor,
                group=group,
                op=op,
                async_op=async_op,
            )
        # reduce_scatter_single replaces reduce_scatter_tensor in newer torch.
        if hasattr(dist, "reduce_scatter_single"):
            return dist.reduce_scatter_single(
                output_tensor, input_tensor, op=op, group=group, async_op=async_op
            )
        return dist.reduce_scatter_tensor(
            output_tensor, input_tensor, op=op, group=group, async_op=async_op
        )
