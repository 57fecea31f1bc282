"""Where gradient synchronisation plugs into the engine, for every kind of model wrapper.

One tiny interface per backend: DDP skips its all-reduce inside `no_sync()`; FSDP2 modules
take `set_requires_gradient_sync(False)`; a plain module needs nothing. The token count of a
window and its loss are summed over ranks with one small collective each.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def is_distributed(group=None) -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size(group=None) -> int:
    return dist.get_world_size(group) if is_distributed(group) else 1


def is_ddp(model: torch.nn.Module) -> bool:
    return isinstance(model, DistributedDataParallel)


def is_fsdp2(model: torch.nn.Module) -> bool:
    # FSDPModule (torch >= 2.6) exposes this method; duck-typed so older torch still imports.
    return hasattr(model, "set_requires_gradient_sync") and hasattr(model, "reshard")


def averages_over_ranks(model: torch.nn.Module) -> bool:
    """Whether the wrapper divides the summed gradient by the world size (DDP and FSDP2 do)."""
    return is_ddp(model) or is_fsdp2(model)


@contextmanager
def _fsdp2_no_sync(model):
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def no_backward_sync(model: torch.nn.Module, enabled: bool = True):
    """A context in which backward adds into local gradients without communicating.

    DDP: `no_sync()`; FSDP2: `set_requires_gradient_sync(False)`; anything else: nothing.
    """
    if not enabled:
        return nullcontext()
    if is_ddp(model):
        return model.no_sync()
    if is_fsdp2(model):
        return _fsdp2_no_sync(model)
    return nullcontext()


def agree_on_window(local_tokens: int, local_micro_steps: int, group=None) -> tuple[int, int]:
    """Sum token counts and take the largest micro-step count over ranks, in one collective.

    Returns (tokens over all ranks, micro-steps every rank must run). A rank whose data ran
    out reports 0 micro-steps and still learns how many backward passes to join.
    """
    if not is_distributed(group):
        return local_tokens, local_micro_steps
    mine = torch.tensor([local_tokens, local_micro_steps], dtype=torch.int64)
    device = _collective_device(group)
    mine = mine.to(device)
    gathered = torch.empty(world_size(group) * 2, dtype=mine.dtype, device=device)
    dist.all_gather_into_tensor(gathered, mine, group=group)
    gathered = gathered.view(-1, 2).cpu()
    return int(gathered[:, 0].sum()), int(gathered[:, 1].max())


def all_reduce_sum(values: torch.Tensor, group=None) -> torch.Tensor:
    """Sum a small tensor over ranks (returned on its original device)."""
    if not is_distributed(group):
        return values
    out = values.to(_collective_device(group))
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out.to(values.device)


def _collective_device(group=None) -> torch.device:
    """gloo reduces CPU tensors; nccl/hccl/xccl reduce tensors on this rank's accelerator."""
    if dist.get_backend(group) == "gloo":
        return torch.device("cpu")
    from . import devices

    kind = devices.default_kind()
    mod = getattr(torch, kind, None)
    index = mod.current_device() if mod is not None and hasattr(mod, "current_device") else 0
    return torch.device(kind, index)
