"""The FSDP2 backend (`fully_shard`): the one module that reads FSDP2's internals.

FSDP2 has public calls for what the engine changes (`set_requires_gradient_sync`,
`set_requires_all_reduce`, `set_reduce_scatter_unused_params`, `set_custom_reduce_scatter`,
`set_all_reduce_hook`, `reset_iter_state`) but none for what the engine must read or clear:
its device mesh, its mixed-precision policy, the reduce-scatter comm and all-reduce hook in
use, the dtype of a unit's sharded parameters, and the gradients it keeps unreduced across
backwards run without sync (HSDP's partial sums included). Each of those is read by one
private function or method below, whose docstring names the private field and what it falls
back to where torch's internals differ.

The sync policies (`Accumulator(sync=...)`, docs/distributed.md):
- "window": `set_requires_gradient_sync(False)` until the window's last micro-batch; FSDP2
  adds the unsharded gradients in its reduce dtype and reduce-scatters once;
- "micro": reduce-scatter after every micro-batch. Each unit's reduced shard is summed over
  the window in fp32: by FSDP2 itself in the sharded `.grad` where the parameters are fp32,
  else (bf16/fp16 parameters) by `ReducedShardHook` in an fp32 shard of the engine's own,
  handed to FSDP2 on the last micro-batch, so the parameters' gradient is rounded once;
- "hsdp" (a 2-D mesh, replicas x shards): reduce-scatter within the shard group after every
  micro-batch, `set_requires_all_reduce(False)` until the last, on which FSDP2 all-reduces
  the sum across replicas once; FSDP2 keeps that partial sum in its reduce dtype (fp32 where
  the engine accepts bf16 parameters).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from gradaccum.parallel import traffic
from gradaccum.parallel.collectives import world_size
from gradaccum.parallel.traffic import GradTraffic

_LOW = (torch.bfloat16, torch.float16)


def is_fsdp2_module(module: torch.nn.Module) -> bool:
    """Whether `fully_shard` was applied to `module`. FSDPModule (torch >= 2.6) has these
    methods; duck-typed so that older torch still imports."""
    return hasattr(module, "set_requires_gradient_sync") and hasattr(module, "reshard")


class FSDP2:
    """A model sharded with FSDP2: see `backends.Backend` for what each member means."""

    averages_over_ranks = True
    shards_gradients = True
    buffers_synced_by_engine = False

    def __init__(self, wrapper: torch.nn.Module, group=None, find_group: bool = True):
        """group: the data-parallel group; None: the group of FSDP2's mesh when `find_group`
        (else the default group, for callers that need none)."""
        self.wrapper = wrapper
        self.modules = [m for m in wrapper.modules() if hasattr(m, "set_requires_gradient_sync")]
        """Every module of the model that `fully_shard` was applied to, the root first."""
        self.held: list[ReducedShardHook] = []
        """The units' hooks that hold the window's fp32 sum (`set_sync_policy` "micro" with
        bf16/fp16 parameters), found once instead of on every micro-step."""
        if group is None and find_group:
            group = self._default_group()
        self.group = group
        self.world = world_size(group)

    def _default_group(self):
        """The process group FSDP2 reduces over: its mesh's group (1-D), the default group when
        the mesh spans every rank (HSDP), else none can be told apart: ask for `group=`."""
        mesh = self._mesh()
        if mesh is None or mesh.size() == world_size():
            return None
        if mesh.ndim == 1:
            return mesh.get_group()
        raise ValueError(
            f"FSDP2 over a {mesh.ndim}-D mesh of {mesh.size()} of {world_size()} ranks: pass its "
            "data-parallel process group as Accumulator(..., group=)"
        )

    def set_sync_policy(self, policy: str) -> None:
        """Check that this model can run `policy` and prepare it: "hsdp" needs a 2-D mesh;
        "micro" puts `ReducedShardHook` on every unit with bf16/fp16 parameters (and takes it
        off for the other policies). ValueError naming what is needed otherwise."""
        mesh = self._mesh()
        if policy == "hsdp" and (mesh is None or mesh.ndim != 2):
            shape = "no mesh found" if mesh is None else f"a {mesh.ndim}-D mesh of {mesh.size()}"
            raise ValueError(
                f"sync='hsdp' needs fully_shard over a 2-D DeviceMesh (replicate, shard), and "
                f"this model has {shape} ranks: build it with init_device_mesh(device_type, "
                "(replicas, shards), mesh_dim_names=('replicate', 'shard')) and pass "
                "fully_shard(..., mesh=mesh), or use sync='micro'"
            )
        for module in self.modules:
            low = _stored_dtype(module) in _LOW
            hook = reduced_shard_hook(module, install=policy == "micro" and low)
            if hook is not None:
                hook.hold = policy == "micro" and low
                if hook.hold:
                    self.held.append(hook)
            elif policy == "micro" and low:
                raise ValueError(
                    f"sync='micro' with {_stored_dtype(module)} parameters needs FSDP2's "
                    "set_all_reduce_hook on one parameter group per fully_shard unit, which "
                    f"{type(module).__name__} does not take: keep fp32 parameters with "
                    "MixedPrecisionPolicy(param_dtype=torch.bfloat16, "
                    "reduce_dtype=torch.float32), or use sync='window'"
                )

    @contextmanager
    def micro_step_sync(self, policy: str, last: bool):
        """The sync of one micro-step under `policy` (`last`: the window's last micro-step):
        "window" skips the reduce-scatter except on the last, "hsdp" the all-reduce across
        replicas; "micro" reduce-scatters every time and tells each held unit
        (`ReducedShardHook`) whether to hand its fp32 sum over. Everything is turned back on
        when the context ends."""
        hooks = self.held  # only a holding hook reads `last`
        for hook in hooks:
            hook.last = last
        try:
            if policy == "window" and not last:
                with self.no_backward_sync():
                    yield
            elif policy == "hsdp" and not last:
                self.wrapper.set_requires_all_reduce(False)
                try:
                    yield
                finally:
                    self.wrapper.set_requires_all_reduce(True)
            else:
                yield
                if not last:
                    _free_held_grads(hooks)
        finally:
            for hook in hooks:
                hook.last = True

    @contextmanager
    def no_backward_sync(self, enabled: bool = True):
        """Backward adds into FSDP2's unsharded gradients without reduce-scattering:
        `set_requires_gradient_sync(False)`, turned back on when the context ends."""
        if not enabled:
            yield
            return
        self.wrapper.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.wrapper.set_requires_gradient_sync(True)

    def accumulation_dtype(self) -> torch.dtype | None:
        """The dtype FSDP2 adds a window's unsharded gradients in, across micro-batches without
        sync: its reduce dtype when that differs from the compute (param) dtype, else the
        compute dtype. The lowest precision over the sharded modules; None when it cannot be
        read (`_mixed_precision`)."""
        found = []
        for m in self.modules:
            policy = self._mixed_precision(m)
            if policy is None:
                return None
            stored = next((p.dtype for p in m.parameters(recurse=False)), None)
            stored = stored or next((p.dtype for p in m.parameters()), torch.float32)
            compute = policy.param_dtype or stored
            reduce = policy.reduce_dtype
            found.append(reduce if reduce is not None and reduce != compute else compute)
        return min(found, key=lambda d: torch.finfo(d).bits) if found else None

    def reduce_unused_parameters(self) -> bool:
        """Make FSDP2 exact for a parameter unused on some rank (an expert one rank never
        routes to, inside a module every rank runs): every rank reduce-scatters it, zeros
        where unused (`set_reduce_scatter_unused_params`), where otherwise the ranks would
        hand reduce-scatters of different sizes to one collective. A parameter no rank used
        then gets a zero gradient rather than none. Returns False where this torch has no
        such option. (A `fully_shard` unit whose forward runs on some ranks only cannot work
        under FSDP2 at all: its all-gathers differ between ranks in the forward already.)"""
        if not self.modules or not hasattr(self.modules[0], "set_reduce_scatter_unused_params"):
            return False
        self.modules[0].set_reduce_scatter_unused_params(True, recurse=True)
        return True

    def drop_unreduced_grads(self, reset: bool = False) -> None:
        """Drop the gradients FSDP2 keeps in its unsharded parameters across backwards run
        without sync, which it would otherwise add into the next synced backward's reduction
        (an abandoned window's must not reach the next window): `_drop_unreduced` of each
        sharded module. `reset`: the root also resets its iteration state where torch has
        `reset_iter_state` (for a window abandoned after a forward or backward that raised)."""
        for module in self.modules:
            self._drop_unreduced(module)
            hook = reduced_shard_hook(module)
            if hook is not None:
                hook.partial = None
        if reset and self.modules and hasattr(self.modules[0], "reset_iter_state"):
            try:
                self.modules[0].reset_iter_state()
            except RuntimeError:  # not the root of its FSDP2 tree: nothing in flight to reset
                pass

    def count_traffic(self, hook=None, state=None) -> GradTraffic | None:
        """Count every sharded module's reduce-scatters: each module's comm is replaced by a
        counting one around the comm it used (`_reduce_scatter_comm`); on a 2-D mesh (HSDP)
        its all-reduces across replicas too, by the `ReducedShardHook` that FSDP2 calls
        right after each. None when a module has several parameter groups (per-parameter
        meshes: FSDP2 takes no custom comm there). `hook`, `state`: DDP's only, ignored."""
        return traffic.shared_counter(self.wrapper, self._install_counter)

    def _install_counter(self, counter: GradTraffic) -> bool:
        sharded = [m for m in self.wrapper.modules() if hasattr(m, "set_custom_reduce_scatter")]
        try:
            for module in sharded:
                inner = self._reduce_scatter_comm(module)
                module.set_custom_reduce_scatter(traffic.CountedReduceScatter(counter, inner))
                if _is_hsdp(module):
                    hook = reduced_shard_hook(module, install=True)
                    if hook is None:
                        return False
                    hook.counter = counter
        except ValueError:  # several parameter groups in one module: no custom comm
            return False
        return True

    def _mesh(self):
        """The device mesh FSDP2 shards over. Reads the root's
        `_get_fsdp_state()._fsdp_param_groups[0].mesh_info.mesh` (FSDP2 has no public getter);
        falls back to the parameters' DTensor `device_mesh`, else None."""
        try:
            return self.wrapper._get_fsdp_state()._fsdp_param_groups[0].mesh_info.mesh
        except (AttributeError, IndexError, TypeError):
            pass
        for p in self.wrapper.parameters():
            if hasattr(p, "device_mesh"):
                return p.device_mesh
        return None

    @staticmethod
    def _mixed_precision(module: torch.nn.Module):
        """`module`'s MixedPrecisionPolicy. Reads `_get_fsdp_state()._mp_policy` (no public
        getter); None where FSDP2's internals differ."""
        try:
            return module._get_fsdp_state()._mp_policy
        except AttributeError:
            return None

    @staticmethod
    def _reduce_scatter_comm(module: torch.nn.Module):
        """The reduce-scatter comm FSDP2 uses for `module` now (a custom one the user set, or
        symmetric memory), so that counting keeps it. Reads
        `_get_fsdp_state()._fsdp_param_groups[0]._reduce_scatter_comm` (no public getter); None
        (plain reduce-scatter) where FSDP2's internals differ or the module holds no group."""
        try:
            groups = module._get_fsdp_state()._fsdp_param_groups
            return groups[0]._reduce_scatter_comm if groups else None
        except (AttributeError, IndexError, TypeError):
            return None

    @staticmethod
    def _drop_unreduced(module: torch.nn.Module) -> None:
        """Clear the unreduced gradients of `module`'s parameters. Reads
        `_get_fsdp_state()._fsdp_param_groups`: of each group its `_partial_reduce_output`
        (HSDP's shards summed without all-reduce, set to None), and of its `fsdp_params` the
        `unsharded_accumulated_grad` (set to None) and `_unsharded_param` (its `.grad` set to
        None): FSDP2 has no public call for it. Does nothing where its internals differ."""
        try:
            groups = module._get_fsdp_state()._fsdp_param_groups
        except AttributeError:
            return
        for group in groups:
            if getattr(group, "_partial_reduce_output", None) is not None:
                group._partial_reduce_output = None  # HSDP's sum of shards not yet all-reduced
            for fsdp_param in getattr(group, "fsdp_params", ()):
                if getattr(fsdp_param, "unsharded_accumulated_grad", None) is not None:
                    fsdp_param.unsharded_accumulated_grad = None
                unsharded = getattr(fsdp_param, "_unsharded_param", None)
                if unsharded is not None:
                    unsharded.grad = None


class ReducedShardHook:
    """FSDP2's all-reduce hook on one `fully_shard` unit (`set_all_reduce_hook`), called with
    the unit's flat reduced gradient shard in its reduce dtype: after the reduce-scatter (and
    after HSDP's all-reduce across replicas), before FSDP2 divides it, casts it to the
    parameters' dtype and adds it to their sharded `.grad`. It runs the hook it replaced
    (`inner`) first, then:
    - counts HSDP's all-reduce that just ran (`counter`, set on a 2-D mesh only);
    - with `hold` (sync="micro", bf16/fp16 parameters): on every micro-step but the last
      (`last`), adds the shard into `partial`, an fp32 shard of the engine's own, and hands
      FSDP2 zeros; on the last, hands it shard + partial. The window's sum is then made in
      fp32 and rounded to the parameters' dtype once, as under sync="window"; FSDP2's
      division by the world size is linear, so dividing the sum once is the same.
    """

    def __init__(self, inner=None):
        self.inner = inner
        self.counter: GradTraffic | None = None
        self.hold = False
        self.last = True
        self.partial: torch.Tensor | None = None
        self.unit: torch.nn.Module | None = None
        """The `fully_shard` unit it is installed on."""

    def __call__(self, reduce_output: torch.Tensor) -> None:
        if self.inner is not None:
            self.inner(reduce_output)
        if self.counter is not None:
            self.counter.record(reduce_output, across_replicas=True)
        if not self.hold:
            return
        if not self.last:
            if self.partial is None:
                dtype = torch.promote_types(reduce_output.dtype, torch.float32)
                self.partial = reduce_output.to(dtype, copy=True)
            else:
                self.partial.add_(reduce_output)
            reduce_output.zero_()
        elif self.partial is not None:
            reduce_output.add_(self.partial)
            self.partial = None


def _free_held_grads(hooks: list[ReducedShardHook]) -> None:
    """Drop the sharded `.grad` that FSDP2 made from the zeros each holding hook handed it:
    until the window's last micro-step only the hook's fp32 shard is held (4P/w, not
    4P/w + 2P/w with bf16 parameters), as the planner counts it."""
    for hook in hooks:
        if hook.hold:
            for fsdp_param in _param_group(hook.unit).fsdp_params:
                fsdp_param.sharded_param.grad = None


def _param_group(module: torch.nn.Module):
    """The one parameter group of a `fully_shard` unit: `_get_fsdp_state()._fsdp_param_groups[0]`
    (its `fsdp_params`, each with its `sharded_param`)."""
    return module._get_fsdp_state()._fsdp_param_groups[0]


def reduced_shard_hook(module: torch.nn.Module, install: bool = False) -> ReducedShardHook | None:
    """The `ReducedShardHook` on `module` (a `fully_shard` unit), installed around the hook it
    had when `install`; None when it has none, or where it cannot have one (several
    parameter groups, a torch without `set_all_reduce_hook`). Reads the unit's
    `_get_fsdp_state()._fsdp_param_groups[0]._all_reduce_hook` (no public getter)."""
    try:
        groups = module._get_fsdp_state()._fsdp_param_groups
        current = groups[0]._all_reduce_hook if len(groups) == 1 else None
    except (AttributeError, IndexError, TypeError):
        return None
    if isinstance(current, ReducedShardHook) or not install:
        return current if isinstance(current, ReducedShardHook) else None
    if len(groups) != 1 or not hasattr(module, "set_all_reduce_hook"):
        return None
    hook = ReducedShardHook(current)
    hook.unit = module
    module.set_all_reduce_hook(hook)
    return hook


def _is_hsdp(module: torch.nn.Module) -> bool:
    """Whether `module`'s parameter group is sharded over a 2-D mesh (HSDP). Reads
    `_get_fsdp_state()._fsdp_param_groups[0].mesh_info.mesh`; False where that differs."""
    try:
        return module._get_fsdp_state()._fsdp_param_groups[0].mesh_info.mesh.ndim == 2
    except (AttributeError, IndexError, TypeError):
        return False


def _stored_dtype(module: torch.nn.Module) -> torch.dtype | None:
    """The dtype of the sharded parameters `module` (a `fully_shard` unit) holds, which
    FSDP2 casts each reduced shard to. Reads `_get_fsdp_state()._fsdp_param_groups[0]
    .fsdp_params[0].sharded_param`; None where that differs or the unit holds none."""
    try:
        return module._get_fsdp_state()._fsdp_param_groups[0].fsdp_params[0].sharded_param.dtype
    except (AttributeError, IndexError, TypeError):
        return None
