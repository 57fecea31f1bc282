"""A model sharded with FSDP2 for a run: the units, the mesh a sync policy needs, and its
whole state gathered and given back.

`shard` applies `fully_shard` to each block of the model's lists of blocks, then to the root
(the units the engine and `verify` count by). `mesh_of` is the DeviceMesh of a policy: every
rank in one shard group for "micro"; for "hsdp" a 2-D mesh of replicas x shards whose replica
dimension is the nodes (torchrun's LOCAL_WORLD_SIZE ranks per node shard the model, each node
holds one replica). `full_state` and `full_optimizer_state` are collectives that give one
process the state a plain model and its optimizer would hold (whole tensors, the optimizer
keyed by parameter index), so that a sharded run's checkpoint is the same file as an
unsharded one's; `load_optimizer_state` puts such a state back, each tensor sharded as its
parameter is.

A checkpoint of a sharded run does not gather: `sharded_state` is the model's and the
optimizer's state keyed by parameter name, each rank holding its own shards
(`torch.distributed.checkpoint.state_dict.get_state_dict`), which `save_sharded` writes with
`dcp.save`, every rank its own files. `load_sharded` reads such a folder into any run's model
and optimizer, laid out as they are now (another number of ranks, another sync policy, a
plain model on one process: dcp reads each rank's part of every tensor from the shards that
hold it), and `read_sharded_model` (`gradaccum.models.sharded_state`'s) reads the model's tensors
whole into one process.
"""

from __future__ import annotations

import os

import torch

from gradaccum.models.checkpointing import outer_lists
from gradaccum.models.sharded_state import (
    SHARDED_MODEL,
    SHARDED_OPTIMIZER,
    alone_is_meant,
)

MESH_NAMES = ("replicate", "shard")
"""The dimensions of an HSDP mesh, the replica one first."""


def shard(model: torch.nn.Module, mesh=None) -> torch.nn.Module:
    """`fully_shard` on each block of every outermost ModuleList (a block's own lists, a
    mixture of experts' experts, go with it), then on the root, over `mesh` (None: FSDP2's
    default, every rank in one shard group); the model, sharded in place."""
    from torch.distributed.fsdp import fully_shard

    for blocks in outer_lists(model):
        for block in blocks:
            fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def per_node(world: int) -> int:
    """Ranks per node of a job of `world` ranks: torchrun's LOCAL_WORLD_SIZE (all of them
    without it, or where it does not divide `world`)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return local if local > 0 and world % local == 0 else world


def hsdp_shape(world: int, per_node: int) -> tuple[int, int] | None:
    """(replicas, shards) of an HSDP mesh whose replicas are the nodes: `per_node` ranks shard
    the model, world / per_node nodes replicate it; None when the ranks are not at least two
    nodes of at least two ranks each."""
    if per_node < 2 or world % per_node or world // per_node < 2:
        return None
    return world // per_node, per_node


def mesh_of(sync: str, world: int, device: torch.device):
    """The DeviceMesh `sync` shards over: None (every rank, FSDP2's default) for "micro", the
    2-D (replicas, shards) mesh of `hsdp_shape` for "hsdp", the nodes its replicas."""
    if sync != "hsdp":
        return None
    from torch.distributed.device_mesh import init_device_mesh

    shape = hsdp_shape(world, per_node(world))
    return init_device_mesh(device.type, shape, mesh_dim_names=MESH_NAMES)


def _whole(value, keep: bool):
    """A DTensor all-gathered into one plain tensor on the CPU where `keep`, else dropped
    (None); any other value as it is."""
    from torch.distributed.tensor import DTensor

    if not isinstance(value, DTensor):
        return value
    whole = value.full_tensor()  # a collective: every rank calls it, in the same order
    return whole.cpu() if keep else None


def full_state(model: torch.nn.Module, keep: bool) -> dict:
    """The sharded `model`'s state_dict with every tensor whole, on the CPU; every rank must
    call it (one all-gather per tensor, in order). Ranks that do not `keep` get None values."""
    return {name: _whole(value, keep) for name, value in model.state_dict().items()}


def full_optimizer_state(optimizer: torch.optim.Optimizer, keep: bool) -> dict:
    """`optimizer.state_dict()` with each sharded state tensor whole (exp_avg, exp_avg_sq):
    what the optimizer of the unsharded model holds, keyed by parameter index as torch keys
    it. A collective like `full_state`."""
    state = optimizer.state_dict()  # its per-parameter dicts are the optimizer's own
    whole = {
        index: {name: _whole(value, keep) for name, value in per_param.items()}
        for index, per_param in state["state"].items()
    }
    return {**state, "state": whole}


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """A state of `full_optimizer_state` (or an unsharded run's) into the optimizer of the
    sharded model, each tensor shaped as its parameter laid out as the parameter is
    (`distribute_tensor` over its mesh), one at a time, so that no more than one whole tensor
    is on the device at once. Every rank calls it with the same state."""
    saved = [i for group in state["param_groups"] for i in group["params"]]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    by_index = dict(zip(saved, params, strict=True))
    laid_out = {
        index: {name: _laid_out(value, by_index[index]) for name, value in per_param.items()}
        for index, per_param in state["state"].items()
    }
    optimizer.load_state_dict({**state, "state": laid_out})


def _laid_out(value, param: torch.Tensor):
    """`value`, a whole tensor of `param`'s shape, as a DTensor laid out as the sharded
    `param` is; any other value as it is."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not (isinstance(param, DTensor) and torch.is_tensor(value) and value.shape == param.shape):
        return value
    return distribute_tensor(value.to(param.device), param.device_mesh, param.placements)


def _options(model: torch.nn.Module):
    """get_state_dict's options for `model`: a frozen base (LoRA) is left out, rebuilt by the
    run that loads it, as an unsharded checkpoint leaves it out."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    frozen = any(not p.requires_grad for p in model.parameters())
    return StateDictOptions(ignore_frozen_params=frozen)


def sharded_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """{"model": ..., "optimizer": ...}: the state of `model` (sharded with FSDP2, under DDP
    or plain) and its `optimizer` keyed by parameter name, each rank holding only its own
    shards (DTensors; nothing is gathered). An optimizer that has not stepped yet is given
    its zero state first (torch's get_state_dict, with lr 0), so there is a layout to read
    into."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer, options=_options(model))
    return {SHARDED_MODEL: model_state, SHARDED_OPTIMIZER: optimizer_state}


def save_sharded(state: dict, folder: str) -> None:
    """`state` of `sharded_state` into `folder` with `dcp.save`: every rank writes its own
    shards (one file each, __<rank>_0.distcp), rank 0 the metadata; a collective: every rank
    calls it, and it returns once every rank's files are written."""
    import torch.distributed.checkpoint as dcp

    dcp.save(state, checkpoint_id=folder)


def load_sharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: str) -> None:
    """A folder of `save_sharded` into `model` and `optimizer` as they are laid out now,
    resharded by dcp: each rank reads the parts of each tensor that its own shards (or whole
    tensors, for a model that is not sharded) need. A collective where a process group is
    up; one process reads alone."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = sharded_state(model, optimizer)  # the layout to read into
    with alone_is_meant():
        dcp.load(state, checkpoint_id=folder)
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state[SHARDED_MODEL],
        optim_state_dict=state[SHARDED_OPTIMIZER],
        options=_options(model),
    )
