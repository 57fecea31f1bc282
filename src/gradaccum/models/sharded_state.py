"""A sharded run's checkpoint read as a plain state_dict: the model's tensors of a folder
that `gradaccum.parallel.sharding.save_sharded` wrote with `torch.distributed.checkpoint`,
whole, on the CPU, by one process (no collective). `--init-from` a sharded checkpoint and
`best/` read it so."""

from __future__ import annotations

import warnings
from contextlib import contextmanager

import torch

SHARDED_MODEL, SHARDED_OPTIMIZER = "model", "optimizer"
"""The two parts of a sharded state (`sharding.sharded_state`): the keys dcp's files are
under."""


def read_sharded_model(folder: str) -> dict:
    """The model's tensors of a folder of `save_sharded`, whole, on the CPU, read by this
    process alone (no collective): a plain state_dict, as model.pt holds one."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(folder)
    prefix = SHARDED_MODEL + "."
    state = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in reader.read_metadata().state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)
    }
    with alone_is_meant():
        dcp.load(state, storage_reader=reader, no_dist=True)
    return {key.removeprefix(prefix): value for key, value in state.items()}


@contextmanager
def alone_is_meant():
    """dcp's warning that it loads in one process left out: here that is what is meant."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield
