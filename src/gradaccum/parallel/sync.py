"""Where gradient synchronisation plugs into the engine, for every kind of model wrapper.

`data_parallel` finds the wrapper once, in one place: DDP, FSDP2, either inside
`torch.compile`'s wrapper, and its data-parallel process group (DDP's `process_group`,
FSDP2's mesh, or the one the user passes). One tiny interface per backend: DDP skips its all-reduce inside `no_sync()`; FSDP2 modules
take `set_requires_gradient_sync(False)`; a plain module needs nothing. The token count of a
window and its loss are summed over ranks with one small collective each. `GradTraffic`
counts the gradient collectives a wrapper launches (a DDP communication hook, an FSDP2
reduce-scatter), so each window can report how many it cost.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def is_distributed(group=None) -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size(group=None) -> int:
    return dist.get_world_size(group) if is_distributed(group) else 1


def unwrap_compiled(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside `torch.compile`'s wrapper (`OptimizedModule._orig_mod`), or `model`.
    `torch.compile(DDP(model))` is PyTorch's documented pattern: the DDP sits inside."""
    while isinstance(getattr(model, "_orig_mod", None), torch.nn.Module):
        model = model._orig_mod
    return model


def is_ddp(model: torch.nn.Module) -> bool:
    return isinstance(unwrap_compiled(model), DistributedDataParallel)


def is_fsdp2(model: torch.nn.Module) -> bool:
    # FSDPModule (torch >= 2.6) exposes this method; duck-typed so older torch still imports.
    inner = unwrap_compiled(model)
    return hasattr(inner, "set_requires_gradient_sync") and hasattr(inner, "reshard")


def averages_over_ranks(model: torch.nn.Module) -> bool:
    """Whether the wrapper divides the summed gradient by the world size (DDP and FSDP2 do)."""
    return is_ddp(model) or is_fsdp2(model)


@dataclass(frozen=True)
class DataParallel:
    """How a model's gradients meet across ranks, found once from its wrapper."""

    kind: str
    """"ddp", "fsdp2" or "none" (one device, or a model the engine sees no wrapper around)."""
    wrapper: torch.nn.Module
    """The DDP or FSDP2 module (inside torch.compile's wrapper); the model itself for "none"."""
    group: object | None
    """The data-parallel process group (None: the default group)."""
    world: int
    """Ranks in that group: the ranks whose tokens make up one window's N."""

    @property
    def averages(self) -> bool:
        """Whether the wrapper's sync divides the summed gradient by `world`."""
        return self.kind != "none"


def data_parallel(model: torch.nn.Module, group=None) -> DataParallel:
    """Find the wrapper of `model` (DDP, FSDP2, either inside torch.compile) and its
    data-parallel group: `group` when given, else DDP's `process_group` or FSDP2's mesh.

    Under an initialised process group of several ranks, a model with no wrapper the engine
    can see is named in a warning (once per call site) rather than silently run as one device.
    """
    inner = unwrap_compiled(model)
    if is_ddp(inner):
        group = inner.process_group if group is None else group
        return DataParallel("ddp", inner, group, world_size(group))
    if is_fsdp2(inner):
        group = _fsdp2_group(inner) if group is None else group
        return DataParallel("fsdp2", inner, group, world_size(group))
    if world_size() > 1:
        warnings.warn(
            f"{type(inner).__name__} is not wrapped in DistributedDataParallel or FSDP2 (nor "
            f"either inside torch.compile) although {world_size()} ranks are running: its "
            "gradients are not synced and each rank steps on its own data",
            stacklevel=3,
        )
    return DataParallel("none", inner, None, 1)


def _fsdp2_group(module: torch.nn.Module):
    """The process group FSDP2 reduces over: its mesh's group (1-D), the default group when
    the mesh spans every rank (HSDP), else none can be told apart: ask for `group=`."""
    mesh = _fsdp2_mesh(module)
    if mesh is None or mesh.size() == world_size():
        return None
    if mesh.ndim == 1:
        return mesh.get_group()
    raise ValueError(
        f"FSDP2 over a {mesh.ndim}-D mesh of {mesh.size()} of {world_size()} ranks: pass its "
        "data-parallel process group as Accumulator(..., group=)"
    )


def _fsdp2_mesh(module: torch.nn.Module):
    """The device mesh FSDP2 shards `module` over (it has no public getter; the parameters'
    DTensor mesh when its internals differ)."""
    try:
        return module._get_fsdp_state()._fsdp_param_groups[0].mesh_info.mesh
    except (AttributeError, IndexError, TypeError):
        pass
    for p in module.parameters():
        if hasattr(p, "device_mesh"):
            return p.device_mesh
    return None


def fsdp2_accumulation_dtype(module: torch.nn.Module) -> torch.dtype | None:
    """The dtype FSDP2 adds a window's unsharded gradients in, across micro-batches without
    sync: its reduce dtype when that differs from the compute (param) dtype, else the compute
    dtype. The lowest precision over the sharded modules; None when it cannot be read."""
    found = []
    for m in unwrap_compiled(module).modules():
        if not hasattr(m, "set_requires_gradient_sync"):
            continue
        try:
            policy = m._get_fsdp_state()._mp_policy
        except AttributeError:
            return None
        stored = next((p.dtype for p in m.parameters(recurse=False)), None)
        stored = stored or next((p.dtype for p in m.parameters()), torch.float32)
        compute = policy.param_dtype or stored
        reduce = policy.reduce_dtype
        found.append(reduce if reduce is not None and reduce != compute else compute)
    return min(found, key=lambda d: torch.finfo(d).bits) if found else None


@contextmanager
def _fsdp2_no_sync(model):
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def fsdp2_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Every module of `model` that `fully_shard` was applied to, the root first."""
    return [m for m in unwrap_compiled(model).modules() if hasattr(m, "set_requires_gradient_sync")]


def fsdp2_reduce_unused(model: torch.nn.Module) -> bool:
    """Make FSDP2 exact for a parameter unused on some rank (an expert one rank never routes
    to, inside a module every rank runs): every rank reduce-scatters it, zeros where unused
    (FSDP2's `set_reduce_scatter_unused_params`), where otherwise the ranks would hand
    reduce-scatters of different sizes to one collective. A parameter no rank used then gets
    a zero gradient rather than none. Returns False where this torch has no such option.
    (A `fully_shard` unit whose forward runs on some ranks only cannot work under FSDP2 at
    all: its all-gathers differ between ranks in the forward already.)"""
    modules = fsdp2_modules(model)
    if not modules or not hasattr(modules[0], "set_reduce_scatter_unused_params"):
        return False
    modules[0].set_reduce_scatter_unused_params(True, recurse=True)
    return True


def drop_unreduced_grads(modules: list[torch.nn.Module], reset: bool = False) -> None:
    """Drop the gradients FSDP2 keeps in its unsharded parameters across backwards run
    without sync, which it would otherwise add into the next synced backward's reduction
    (an abandoned window's must not reach the next window). FSDP2 has no public call for it:
    this reads its parameter groups, and does nothing where its internals differ. `reset`:
    the root also resets its iteration state where torch has `reset_iter_state` (for a
    window abandoned after a forward or backward that raised)."""
    for module in modules:
        try:
            groups = module._get_fsdp_state()._fsdp_param_groups
        except AttributeError:
            continue
        for group in groups:
            for fsdp_param in getattr(group, "fsdp_params", ()):
                if getattr(fsdp_param, "unsharded_accumulated_grad", None) is not None:
                    fsdp_param.unsharded_accumulated_grad = None
                unsharded = getattr(fsdp_param, "_unsharded_param", None)
                if unsharded is not None:
                    unsharded.grad = None
    if reset and modules and hasattr(modules[0], "reset_iter_state"):
        try:
            modules[0].reset_iter_state()
        except RuntimeError:  # not the root of its FSDP2 tree: nothing in flight to reset
            pass


def broadcast_from_first(tensors: list[torch.Tensor], group=None) -> None:
    """Copy the first rank's values of `tensors` into every rank's, in place (as DDP does for
    the model's parameters when it wraps them)."""
    if not is_distributed(group) or world_size(group) == 1:
        return
    src = dist.get_global_rank(group, 0) if group is not None else 0
    device = _collective_device(group)
    with torch.no_grad():
        for t in tensors:
            out = t.detach().to(device).clone()
            dist.broadcast(out, src=src, group=group)
            t.copy_(out.to(t.device))


def no_backward_sync(model: torch.nn.Module, enabled: bool = True):
    """A context in which backward adds into local gradients without communicating.

    DDP: `no_sync()`; FSDP2: `set_requires_gradient_sync(False)`; anything else: nothing.
    """
    if not enabled:
        return nullcontext()
    model = unwrap_compiled(model)
    if is_ddp(model):
        return model.no_sync()
    if is_fsdp2(model):
        return _fsdp2_no_sync(model)
    return nullcontext()


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


def agree_on_window_size(
    local_tokens: int,
    local_micro_steps: int,
    group=None,
    has_batch: bool = True,
    capacity: int | None = None,
) -> WindowSize:
    """Sum token counts and label capacities and take the largest micro-step count over
    ranks, in one collective.

    A rank whose data ran out reports 0 micro-steps and still learns how many backward
    passes to join. `has_batch` says whether this rank has any batch to run those passes on
    (its own, or one it repeats with weight 0); when some rank has none, every rank raises
    the same error instead of the others waiting for it in a collective.
    """
    if not is_distributed(group):
        return WindowSize(local_tokens, local_micro_steps, capacity)
    cap = -1 if capacity is None else capacity
    mine = torch.tensor([local_tokens, local_micro_steps, int(has_batch), cap], dtype=torch.int64)
    device = _collective_device(group)
    mine = mine.to(device)
    gathered = torch.empty(world_size(group) * 4, dtype=mine.dtype, device=device)
    _all_gather(gathered, mine, group)
    gathered = gathered.view(-1, 4).cpu()
    tokens, steps = int(gathered[:, 0].sum()), int(gathered[:, 1].max())
    stranded = [r for r in range(gathered.shape[0]) if not gathered[r, 2]]
    if steps > 0 and stranded:
        raise RuntimeError(
            f"ranks {stranded} have no micro-batch for a window of {steps} micro-steps: "
            "their data was empty from the first window on"
        )
    caps = gathered[:, 3]
    return WindowSize(tokens, steps, int(caps.sum()) if bool((caps >= 0).all()) else None)


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
    out = torch.tensor([value], dtype=torch.int64, device=_collective_device(group))
    dist.all_reduce(out, op=dist.ReduceOp.MAX, group=group)
    return int(out.item())


def _all_gather(output: torch.Tensor, tensor: torch.Tensor, group=None) -> None:
    # all_gather_single replaces all_gather_into_tensor (deprecated in newer torch).
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, tensor, group=group)


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


# ---- counting gradient collectives --------------------------------------------------------


@dataclass
class GradTraffic:
    """Gradient collectives a DDP or FSDP2 model launched, counted as they are launched."""

    collectives: int = 0
    """DDP bucket all-reduces or FSDP2 reduce-scatters so far."""
    bytes: int = 0
    """Bytes of gradient this rank handed to them (the input of each collective; a ring
    all-reduce puts about twice that on the wire)."""

    def record(self, tensor: torch.Tensor) -> None:
        self.collectives += 1
        self.bytes += tensor.numel() * tensor.element_size()


def count_grad_traffic(model: torch.nn.Module, hook=None, state=None) -> GradTraffic | None:
    """Count the gradient collectives of a DDP or FSDP2 model; returns the counter, or None
    when they cannot be counted. The Accumulator calls it; the counter stays with the model,
    so calling it again returns the same one.

    DDP: registers a communication hook that counts each bucket, then reduces it with
    `hook(state, bucket)`: by default DDP's own averaging all-reduce over the model's process
    group. DDP takes one hook per model: to use another (PowerSGD, fp16 compression), pass it
    and its state here instead of calling `register_comm_hook`, before building the
    Accumulator; bytes are then those handed to your hook. A model that already has a hook
    returns None. FSDP2: every sharded module's reduce-scatter is wrapped to count, then
    reduce-scatter as before (HSDP's all-reduce across replicas is not counted); None when
    a module has several parameter groups (per-parameter meshes).
    """
    model = unwrap_compiled(model)
    existing = getattr(model, _TRAFFIC_ATTR, None)
    if existing is not None:
        return existing
    traffic = GradTraffic()
    if is_ddp(model):
        if hook is None:
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            hook, state = allreduce_hook, model.process_group
        try:
            model.register_comm_hook(traffic, _counted(hook, state))
        except RuntimeError:  # a hook is already registered: DDP allows one
            return None
    elif is_fsdp2(model):
        sharded = [m for m in model.modules() if hasattr(m, "set_custom_reduce_scatter")]
        try:
            for module in sharded:
                module.set_custom_reduce_scatter(
                    _CountedReduceScatter(traffic, _current_reduce_scatter(module))
                )
        except ValueError:  # several parameter groups in one module: no custom comm
            return None
    else:
        return None
    setattr(model, _TRAFFIC_ATTR, traffic)
    return traffic


_TRAFFIC_ATTR = "_gradaccum_grad_traffic"


def _counted(hook, state):
    # No annotation on `bucket`: DDP compares it with dist.GradBucket, and under postponed
    # evaluation it would be a string.
    def counted_hook(traffic: GradTraffic, bucket):
        traffic.record(bucket.buffer())
        return hook(state, bucket)

    return counted_hook


def _current_reduce_scatter(module):
    """The reduce-scatter comm FSDP2 uses for `module` now (a custom one the user set, or
    symmetric memory), so counting keeps it; None (plain reduce-scatter) where FSDP2's
    internals differ: it has no public getter."""
    try:
        groups = module._get_fsdp_state()._fsdp_param_groups
        return groups[0]._reduce_scatter_comm if groups else None
    except (AttributeError, IndexError, TypeError):
        return None


class _CountedReduceScatter:
    """FSDP2's reduce-scatter comm (the `ReduceScatter` interface of `fully_shard`), counted;
    it delegates to `inner` when given."""

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
