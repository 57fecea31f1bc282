"""Gradient traffic per optimizer step under data parallelism, for the two ways to sync.

With accumulation a data-parallel run can sync gradients once per window (DDP `no_sync` on all
but the last micro-batch, FSDP2 `set_requires_gradient_sync(False)`) or after every
micro-batch. Once per window moves the accumulated gradient once instead of a gradient k
times; under ZeRO 2-3 it holds the whole gradient until the sync, where syncing every
micro-batch keeps it sharded. Pure arithmetic, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from gradaccum.plan.memory import MemorySetup, unsharded_grad_bytes


@dataclass
class Communication:
    """Gradient traffic per optimizer step, bytes sent per device (ring collectives)."""

    collective: str
    """all-reduce (DDP, ZeRO 0-1) or reduce-scatter (ZeRO 2-3, FSDP)."""
    sync_per_window_bytes: int
    """The accumulated fp32 gradient synced once, after the last micro-batch."""
    sync_every_micro_batch_bytes: int | None
    """Each micro-batch's gradient synced as it is produced: k syncs in its own precision."""
    sync_per_window_grads_gb: float
    """Gradient memory per device when syncing once per window (unsharded until the sync)."""
    sync_every_micro_batch_grads_gb: float
    """Gradient memory per device when syncing every micro-batch (sharded under ZeRO 2-3)."""
    param_all_gather_bytes: int | None
    """ZeRO-3: parameters gathered in forward and again in backward, every micro-batch."""


def traffic(params: int | None, setup: MemorySetup, k: int | None) -> Communication | None:
    """Ring collectives: all-reduce sends 2 (w-1)/w x B per device, reduce-scatter (w-1)/w x B.

    One sync per window moves the accumulated fp32 gradient (4P) once. Syncing every micro-batch
    moves each micro-batch's gradient in the parameter precision, k times. Under ZeRO 2-3 the
    every-micro-batch sync is what keeps gradients sharded; one sync per window keeps them whole.
    """
    w = setup.world_size
    if params is None or w == 1:
        return None
    sharded = setup.zero >= 2
    factor = (w - 1) / w if sharded else 2 * (w - 1) / w
    per_micro = round(factor * setup.bytes_per_param * params)
    whole = unsharded_grad_bytes(params)
    gather = round(2 * (w - 1) / w * setup.bytes_per_param * params) if setup.zero == 3 else 0
    return Communication(
        collective="reduce-scatter" if sharded else "all-reduce",
        sync_per_window_bytes=round(factor * whole),
        sync_every_micro_batch_bytes=None if k is None else k * per_micro,
        sync_per_window_grads_gb=whole / 1e9,
        sync_every_micro_batch_grads_gb=(-(-whole // w) if sharded else whole) / 1e9,
        param_all_gather_bytes=None if k is None else k * gather,
    )
