"""The FSDP2 backend (`fully_shard`): the one module that reads FSDP2's internals.

FSDP2 has public calls for what the engine changes (`set_requires_gradient_sync`,
`set_reduce_scatter_unused_params`, `set_custom_reduce_scatter`, `reset_iter_state`) but none
for four things the engine must read or clear: its device mesh, its mixed-precision policy,
the reduce-scatter comm in use, and the gradients it keeps unreduced across backwards run
without sync. Each of those is read by one private method of `FSDP2` below, whose docstring
names the private field and what it falls back to where torch's internals differ.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from gradaccum.parallel import traffic
from gradaccum.parallel.collectives import world_size
from gradaccum.parallel.traffic import GradTraffic


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
        if reset and self.modules and hasattr(self.modules[0], "reset_iter_state"):
            try:
                self.modules[0].reset_iter_state()
            except RuntimeError:  # not the root of its FSDP2 tree: nothing in flight to reset
                pass

    def count_traffic(self, hook=None, state=None) -> GradTraffic | None:
        """Count every sharded module's reduce-scatters: each module's comm is replaced by a
        counting one around the comm it used (`_reduce_scatter_comm`). HSDP's all-reduce
        across replicas is not counted; None when a module has several parameter groups
        (per-parameter meshes: FSDP2 takes no custom comm there). `hook`, `state`: DDP's only,
        ignored."""
        return traffic.shared_counter(self.wrapper, self._install_counter)

    def _install_counter(self, counter: GradTraffic) -> bool:
        sharded = [m for m in self.wrapper.modules() if hasattr(m, "set_custom_reduce_scatter")]
        try:
            for module in sharded:
                inner = self._reduce_scatter_comm(module)
                module.set_custom_reduce_scatter(traffic.CountedReduceScatter(counter, inner))
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
        `_get_fsdp_state()._fsdp_param_groups`, and of each group's `fsdp_params` the
        `unsharded_accumulated_grad` (set to None) and `_unsharded_param` (its `.grad` set to
        None): FSDP2 has no public call for it. Does nothing where its internals differ."""
        try:
            groups = module._get_fsdp_state()._fsdp_param_groups
        except AttributeError:
            return
        for group in groups:
            for fsdp_param in getattr(group, "fsdp_params", ()):
                if getattr(fsdp_param, "unsharded_accumulated_grad", None) is not None:
                    fsdp_param.unsharded_accumulated_grad = None
                unsharded = getattr(fsdp_param, "_unsharded_param", None)
                if unsharded is not None:
                    unsharded.grad = None
