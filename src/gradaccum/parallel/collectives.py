"""The engine's small collectives: the ranks agree on a window's size, sum its loss and token
count, take the largest of an integer, broadcast a few tensors. Each is one collective (none
when alone) on the device the process group's backend reduces on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from gradaccum.parallel import devices


def is_distributed(group=None) -> bool:
    """Whether a process group is initialised (`group` is accepted for symmetry)."""
    return dist.is_available() and dist.is_initialized()


def world_size(group=None) -> int:
    """Ranks in `group` (the default group when None); 1 without a process group."""
    return dist.get_world_size(group) if is_distributed(group) else 1


def collective_device(group=None) -> torch.device:
    """Where `group`'s backend reduces: gloo reduces CPU tensors; nccl/hccl/xccl reduce
    tensors on this rank's accelerator."""
    if dist.get_backend(group) == "gloo":
        return torch.device("cpu")
    kind = devices.default_kind()
    mod = getattr(torch, kind, None)
    index = mod.current_device() if mod is not None and hasattr(mod, "current_device") else 0
    return torch.device(kind, index)


@dataclass(frozen=True)
class WindowSize:
    """What the ranks agree on before a window's first backward."""

    tokens: int
    """Valid tokens over all ranks (the local counts summed; 0 where not counted)."""
    micro_steps: int
    """Micro-steps every rank must run: the largest local count."""
    capacity: int | None
    """Label elements over all ranks (an upper bound of N, padding included); None unless
    every rank could read its own."""
    extra_sums: torch.Tensor | None = field(default=None, compare=False)
    """The callers' own int64 counts (`agree_on_window_size(extra_sums=...)`), summed over
    ranks elementwise, on the CPU; None when none were given."""


def agree_on_window_size(
    local_tokens: int,
    local_micro_steps: int,
    group=None,
    has_batch: bool = True,
    capacity: int | None = None,
    extra_sums: torch.Tensor | None = None,
) -> WindowSize:
    """Sum token counts and label capacities and take the largest micro-step count over
    ranks, in one collective.

    A rank whose data ran out reports 0 micro-steps and still learns how many backward
    passes to join. `has_batch` says whether this rank has any batch to run those passes on
    (its own, or one it repeats with weight 0); when some rank has none, every rank raises
    the same error instead of the others waiting for it in a collective.
    extra_sums: a 1-d int64 tensor of counts of the caller's own (the MoE balance's routed
    tokens and expert counts, `gradaccum.moe.balance`), appended to each rank's vector of
    the same all-gather and summed over ranks; every rank must pass the same length.
    """
    extra = extra_vector(extra_sums)
    if not is_distributed(group):
        return WindowSize(local_tokens, local_micro_steps, capacity, extra)
    cap = -1 if capacity is None else capacity
    head = torch.tensor([local_tokens, local_micro_steps, int(has_batch), cap], dtype=torch.int64)
    mine = head if extra is None else torch.cat([head, extra])
    width = mine.numel()
    device = collective_device(group)
    mine = mine.to(device)
    gathered = torch.empty(world_size(group) * width, dtype=mine.dtype, device=device)
    _all_gather(gathered, mine, group)
    gathered = gathered.view(-1, width).cpu()
    tokens, steps = int(gathered[:, 0].sum()), int(gathered[:, 1].max())
    stranded = [r for r in range(gathered.shape[0]) if not gathered[r, 2]]
    if steps > 0 and stranded:
        raise RuntimeError(
            f"ranks {stranded} have no micro-batch for a window of {steps} micro-steps: "
            "their data was empty from the first window on"
        )
    caps = gathered[:, 3]
    summed = None if extra is None else gathered[:, 4:].sum(dim=0)
    capacity_sum = int(caps.sum()) if bool((caps >= 0).all()) else None
    return WindowSize(tokens, steps, capacity_sum, summed)


def extra_vector(extra_sums) -> torch.Tensor | None:
    """`extra_sums` checked: None, or a 1-d int64 tensor (moved to the CPU)."""
    if extra_sums is None:
        return None
    if (
        not isinstance(extra_sums, torch.Tensor)
        or extra_sums.dim() != 1
        or extra_sums.dtype != torch.int64
    ):
        what = (
            f"{extra_sums.dtype} of shape {tuple(extra_sums.shape)}"
            if isinstance(extra_sums, torch.Tensor)
            else type(extra_sums).__name__
        )
        raise ValueError(f"extra_sums must be a 1-d int64 tensor, got {what}")
    return extra_sums.detach().cpu()


def agree_on_window(
    local_tokens: int, local_micro_steps: int, group=None, has_batch: bool = True
) -> tuple[int, int]:
    """(tokens over all ranks, micro-steps every rank must run): `agree_on_window_size`."""
    size = agree_on_window_size(local_tokens, local_micro_steps, group, has_batch)
    return size.tokens, size.micro_steps


def max_over_ranks(value: int, group=None) -> int:
    """The largest of one integer over ranks: one 8-byte all-reduce (none when alone)."""
    if not is_distributed(group):
        return value
    out = torch.tensor([value], dtype=torch.int64, device=collective_device(group))
    dist.all_reduce(out, op=dist.ReduceOp.MAX, group=group)
    return int(out.item())


class LaunchedMax:
    """The largest of one integer over ranks, launched without waiting; `value()`
    waits for it. On a gloo group the host only waits for the other ranks' hosts to reach
    the same call, never for a device."""

    def __init__(self, value: int, group=None):
        self._out = torch.tensor([value], dtype=torch.int64, device=collective_device(group))
        self._work = dist.all_reduce(self._out, op=dist.ReduceOp.MAX, group=group, async_op=True)

    def value(self) -> int:
        self._work.wait()
        return int(self._out.item())


def host_group(timeout_s: float | None = None):
    """A group for flags only the hosts hold (a stop request, an out-of-memory error): gloo,
    so that agreeing on them never waits on the device's queue of work. The default group
    when it is gloo already or gloo is not built in (None); a new gloo group over the same
    ranks otherwise (a collective call: every rank must make it, in the same order).
    timeout_s: how long its collectives wait for the other ranks (--dist-timeout)."""
    if not is_distributed() or dist.get_backend() == "gloo" or not dist.is_gloo_available():
        return None
    timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
    return dist.new_group(backend="gloo", timeout=timeout)


def all_reduce_sum(values: torch.Tensor, group=None) -> torch.Tensor:
    """Sum a small tensor over ranks (returned on its original device)."""
    if not is_distributed(group):
        return values
    out = values.to(collective_device(group))
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out.to(values.device)


def broadcast_from_first(tensors: list[torch.Tensor], group=None) -> None:
    """Copy the first rank's values of `tensors` into every rank's, in place (as DDP does for
    the model's parameters when it wraps them)."""
    if not is_distributed(group) or world_size(group) == 1:
        return
    src = dist.get_global_rank(group, 0) if group is not None else 0
    device = collective_device(group)
    with torch.no_grad():
        for t in tensors:
            out = t.detach().to(device).clone()
            dist.broadcast(out, src=src, group=group)
            t.copy_(out.to(t.device))


def _all_gather(output: torch.Tensor, tensor: torch.Tensor, group=None) -> None:
    # all_gather_single replaces all_gather_into_tensor (deprecated in newer torch).
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, tensor, group=group)
