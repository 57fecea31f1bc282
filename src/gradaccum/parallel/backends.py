"""How a model's gradients meet across ranks: one small backend object per wrapper, chosen once.

`data_parallel(model, group)` looks through `torch.compile`'s wrapper and returns the backend
for what it finds: `DDP` (DistributedDataParallel), `FSDP2` (`fully_shard`, in
`parallel.fsdp2`) or `SingleDevice` (a plain module). Every backend answers the same small
interface (`Backend`); the engine asks it and never checks which one it has. The no-sync
context is one method each (`Backend.no_backward_sync`): DDP's `no_sync()`, FSDP2's
`set_requires_gradient_sync(False)`, a null context on one device.
"""

from __future__ import annotations

import warnings
from contextlib import AbstractContextManager, nullcontext
from typing import Protocol, runtime_checkable

import torch
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from gradaccum.parallel import traffic
from gradaccum.parallel.collectives import world_size
from gradaccum.parallel.fsdp2 import FSDP2, is_fsdp2_module
from gradaccum.parallel.traffic import GradTraffic


@runtime_checkable
class Backend(Protocol):
    """What the engine asks of a model's data parallelism."""

    wrapper: torch.nn.Module
    """The DDP or FSDP2 module (inside torch.compile's wrapper); the model itself on one
    device."""
    group: object | None
    """The data-parallel process group (None: the default group)."""
    world: int
    """Ranks in that group: the ranks whose tokens make up one window's N."""
    averages_over_ranks: bool
    """Whether the wrapper's sync divides the summed gradient by `world` (DDP and FSDP2 do),
    and so whether the ranks take part in the window's collectives."""
    shards_gradients: bool
    """Whether the wrapper keeps the model's gradients itself, reduce-scattered into shards
    in its own reduce dtype (FSDP2): the engine then buffers only parameters outside the
    model, keeps no master weights and sees no per-micro-batch gradient."""
    buffers_synced_by_engine: bool
    """Whether gradients the engine moves out of `.grad` into its fp32 buffers must be
    all-reduced by the engine, as the wrapper would never see them (DDP over several ranks)."""

    def no_backward_sync(self, enabled: bool = True) -> AbstractContextManager:
        """A context in which backward adds into local gradients without communicating
        (`enabled=False`: a null context)."""

    def set_sync_policy(self, policy: str) -> None:
        """Check that the wrapper can run the sync policy `policy` ("window", "micro",
        "hsdp": `Accumulator(sync=)`) and prepare it; ValueError saying what is needed."""

    def micro_step_sync(self, policy: str, last: bool) -> AbstractContextManager:
        """A context for one micro-step's backward under `policy`; `last`: the window's last
        micro-step."""

    def accumulation_dtype(self) -> torch.dtype | None:
        """The dtype the wrapper adds a window's micro-batch gradients in where it does so
        itself (FSDP2's reduce dtype); None where autograd or the engine does."""

    def count_traffic(self, hook=None, state=None) -> GradTraffic | None:
        """The counter of the wrapper's gradient collectives (the same one for every call on
        one wrapper); None where they cannot be counted."""

    def reduce_unused_parameters(self) -> bool:
        """Make the wrapper exact for a parameter unused on some rank; False where it has
        nothing to set."""

    def drop_unreduced_grads(self, reset: bool = False) -> None:
        """Drop gradients the wrapper keeps unreduced from backwards run without sync (an
        abandoned window's); `reset` its iteration state too."""


class SingleDevice:
    """A module with no data-parallel wrapper: nothing to sync, average or count."""

    averages_over_ranks = False
    shards_gradients = False
    buffers_synced_by_engine = False

    def __init__(self, module: torch.nn.Module):
        self.wrapper = module
        self.group = None
        self.world = 1

    def no_backward_sync(self, enabled: bool = True) -> AbstractContextManager:
        return nullcontext()

    def set_sync_policy(self, policy: str) -> None:
        if policy != "window":
            mesh = " over a 2-D DeviceMesh (replicate, shard)" if policy == "hsdp" else ""
            raise ValueError(
                f"sync={policy!r} needs a model sharded with FSDP2 (fully_shard{mesh}); "
                f"this {type(self.wrapper).__name__} has no data-parallel wrapper, so there "
                "is nothing to sync: use sync='window'"
            )

    def micro_step_sync(self, policy: str, last: bool) -> AbstractContextManager:
        return nullcontext()

    def accumulation_dtype(self) -> torch.dtype | None:
        return None

    def count_traffic(self, hook=None, state=None) -> GradTraffic | None:
        return None

    def reduce_unused_parameters(self) -> bool:
        return False

    def drop_unreduced_grads(self, reset: bool = False) -> None:
        pass


class DDP:
    """A DistributedDataParallel model: it all-reduces `.grad` bucket by bucket from autograd
    hooks on the backward it is not told to skip, averaging over its process group."""

    averages_over_ranks = True
    shards_gradients = False

    def __init__(self, wrapper: DistributedDataParallel, group=None):
        self.wrapper = wrapper
        self.group = wrapper.process_group if group is None else group
        self.world = world_size(self.group)

    @property
    def buffers_synced_by_engine(self) -> bool:
        """Over several ranks: DDP reduces `.grad` only, so it never syncs buffered gradients."""
        return self.world > 1

    def no_backward_sync(self, enabled: bool = True) -> AbstractContextManager:
        """DDP's `no_sync()`."""
        return self.wrapper.no_sync() if enabled else nullcontext()

    def set_sync_policy(self, policy: str) -> None:
        """DDP runs "window" (one all-reduce per window) and "micro" (an all-reduce of the
        whole gradient after every micro-batch, in the parameters' dtype: no memory saved);
        "hsdp" needs FSDP2."""
        if policy == "hsdp":
            raise ValueError(
                "sync='hsdp' needs a model sharded with FSDP2's fully_shard over a 2-D "
                "DeviceMesh (replicate, shard), not DistributedDataParallel: shard it, or use "
                "sync='window' under DDP"
            )

    def micro_step_sync(self, policy: str, last: bool) -> AbstractContextManager:
        """`no_sync()` on every micro-step but the last under "window"; none under "micro"."""
        return self.no_backward_sync(enabled=policy == "window" and not last)

    def accumulation_dtype(self) -> torch.dtype | None:
        return None

    def count_traffic(self, hook=None, state=None) -> GradTraffic | None:
        """Count each bucket with a communication hook that then reduces it with
        `hook(state, bucket)`: by default DDP's own averaging all-reduce over the model's
        process group. DDP takes one hook per model, so the counting hook is registered once
        per model and every later call (another Accumulator on the same model) gets the same
        counter (`traffic.shared_counter`). A model that already has a hook of its own is not
        counted: None."""
        if hook is None:
            hook, state = allreduce_hook, self.wrapper.process_group

        def install(counter: GradTraffic) -> bool:
            try:
                self.wrapper.register_comm_hook(counter, traffic.counting_hook(hook, state))
            except RuntimeError:  # a hook is already registered: DDP allows one
                return False
            return True

        return traffic.shared_counter(self.wrapper, install)

    def reduce_unused_parameters(self) -> bool:
        # DDP all-reduces whole buckets: a parameter unused on one rank adds zeros there
        # (given find_unused_parameters=True, which lets its backward finish).
        return False

    def drop_unreduced_grads(self, reset: bool = False) -> None:
        # Under no_sync DDP's gradients are the parameters' `.grad`, cleared by the engine.
        pass


def unwrap_compiled(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside `torch.compile`'s wrapper (`OptimizedModule._orig_mod`), or `model`.
    `torch.compile(DDP(model))` is PyTorch's documented pattern: the DDP sits inside."""
    while isinstance(getattr(model, "_orig_mod", None), torch.nn.Module):
        model = model._orig_mod
    return model


def is_ddp(model: torch.nn.Module) -> bool:
    """Whether `model` is DistributedDataParallel (possibly inside torch.compile)."""
    return isinstance(unwrap_compiled(model), DistributedDataParallel)


def is_fsdp2(model: torch.nn.Module) -> bool:
    """Whether `fully_shard` was applied to `model` (possibly inside torch.compile)."""
    return is_fsdp2_module(unwrap_compiled(model))


def _backend(inner: torch.nn.Module, group=None, find_group: bool = True) -> Backend:
    # find_group=False: the caller needs no group (counting), so FSDP2's mesh is not read
    if isinstance(inner, DistributedDataParallel):
        return DDP(inner, group)
    if is_fsdp2_module(inner):
        return FSDP2(inner, group, find_group)
    return SingleDevice(inner)


def data_parallel(model: torch.nn.Module, group=None) -> Backend:
    """The backend of `model`'s wrapper (DDP, FSDP2, either inside torch.compile, or none)
    and its data-parallel group: `group` when given, else DDP's `process_group` or FSDP2's
    mesh.

    Under an initialised process group of several ranks, a model with no wrapper the engine
    can see is named in a warning (once per call site) rather than silently run as one device.
    """
    backend = _backend(unwrap_compiled(model), group)
    if isinstance(backend, SingleDevice) and world_size() > 1:
        warnings.warn(
            f"{type(backend.wrapper).__name__} is not wrapped in DistributedDataParallel or "
            f"FSDP2 (nor either inside torch.compile) although {world_size()} ranks are "
            "running: its gradients are not synced and each rank steps on its own data",
            stacklevel=3,
        )
    return backend


def count_grad_traffic(model: torch.nn.Module, hook=None, state=None) -> GradTraffic | None:
    """Count the gradient collectives of a DDP or FSDP2 model; returns the counter, or None
    when they cannot be counted. The Accumulator calls it; there is one counter per wrapper,
    so calling it again (or building a second Accumulator) returns the same one.

    DDP: registers a communication hook that counts each bucket, then reduces it with
    `hook(state, bucket)`: by default DDP's own averaging all-reduce over the model's process
    group. DDP takes one hook per model: to use another (PowerSGD, fp16 compression), pass it
    and its state here instead of calling `register_comm_hook`, before building the
    Accumulator; bytes are then those handed to your hook. A model that already has a hook
    returns None. FSDP2: every sharded module's reduce-scatter is wrapped to count, then
    reduce-scatter as before, and on a 2-D mesh (HSDP) each all-reduce across replicas is
    counted too (`GradTraffic.replica_bytes`); None when a module has several parameter
    groups (per-parameter meshes).
    """
    return _backend(unwrap_compiled(model), find_group=False).count_traffic(hook, state)
