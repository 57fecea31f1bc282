"""One rank of the sync-memory test: the gradient memory each sync policy holds between
micro-batches, counted over every tensor the process can reach.

Method: at the start of a window (the window before's gradients dropped) and after each
micro-step (its backward and its sync done), `live_tensor_bytes` walks every tensor object the
garbage collector tracks, with each one's `.grad` and, for a DTensor, its local shard, and adds
up the bytes of their distinct storages (by data pointer; a storage FSDP2 has freed by
resizing it to 0 counts 0). The bytes after a micro-step less those at the window's start are
what the window has left alive: activations and unsharded parameters are freed by then, so it
is the gradient the policy holds, wherever it is kept (FSDP2's unsharded `.grad`, the sharded
`.grad`, HSDP's partial sum not yet all-reduced, a buffer of the engine's), without naming
any of those places. The largest value over the window is compared with the planner.

(The CPU allocator's own count, `torch.profiler` with `profile_memory=True`, was tried first:
it loses the frees that run on gloo's worker threads, which are not profiled, so its running
total drifts up by whole reduce-scatter buffers.)
"""

from __future__ import annotations

import gc
import time

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from gradaccum import Accumulator

WIDTH = 512
LAYERS = 4
K = 3  # micro-batches per window
ROWS = 2  # rows per micro-batch: activations are a few KB, the gradient MBs
MESHES = {"window": (4,), "micro": (4,), "hsdp": (2, 2)}
BF16_CASE = "micro_bf16"
"""sync="micro" with bf16 parameters (reduced in fp32): the engine's fp32 shard only."""


def make_model() -> torch.nn.Sequential:
    """LAYERS Linear(WIDTH, WIDTH) with ReLU between: every dimension divides by 4, so no
    FSDP2 shard is padded."""
    torch.manual_seed(0)
    layers = []
    for i in range(LAYERS):
        layers.append(torch.nn.Linear(WIDTH, WIDTH))
        if i < LAYERS - 1:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


def param_count() -> int:
    """Parameters of `make_model()`: 4 x (512 x 512 + 512)."""
    return sum(p.numel() for p in make_model().parameters())


def _loss(model, batch):
    logits = model(batch["x"])
    return F.cross_entropy(logits, batch["labels"], reduction="sum"), batch["labels"].numel()


def _batches(rank: int, count: int, seed: int, dtype=torch.float32) -> list[dict]:
    gen = torch.Generator().manual_seed(seed + 31 * rank)
    return [
        {
            "x": torch.randn(ROWS, WIDTH, generator=gen).to(dtype),
            "labels": torch.randint(0, WIDTH, (ROWS,), generator=gen),
        }
        for _ in range(count)
    ]


def _sharded(shape: tuple[int, ...], dtype=torch.float32):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    names = ("replicate", "shard") if len(shape) == 2 else ("shard",)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    model = make_model().to(dtype)
    policy = MixedPrecisionPolicy(reduce_dtype=torch.float32)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def live_tensor_bytes() -> int:
    """Bytes of the distinct storages of every tensor the garbage collector tracks, of their
    `.grad`, and of a DTensor's local shard."""
    seen: dict[int, int] = {}

    def add(t) -> None:
        if isinstance(t, DTensor):
            t = t.to_local()
        if t.layout != torch.strided or t.device.type == "meta":
            return  # no storage of its own to count (sparse, meta)
        storage = t.untyped_storage()
        if storage.nbytes():  # FSDP2 frees an unsharded parameter by resizing it to 0
            seen[storage.data_ptr()] = storage.nbytes()

    gc.collect()
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor):
            add(obj)
            if obj.is_leaf and obj.grad is not None:
                add(obj.grad)
    return sum(seen.values())


COUNTS = 5
"""Counts of the live tensors per sample, PAUSE_S apart: the smallest is kept."""
PAUSE_S = 0.05


def settled_bytes() -> int:
    """`live_tensor_bytes` once gloo's worker threads have let go: a collective's work can
    hold its input a moment after `wait()` returned (the thread that ran it drops it after
    marking it done), which on a busy machine a count may still see. What a policy holds
    stays between micro-steps, so the smallest of COUNTS counts is it."""
    counts = []
    for _ in range(COUNTS):
        counts.append(live_tensor_bytes())
        time.sleep(PAUSE_S)
    return min(counts)


def policy_bytes(rank: int, sync: str, dtype=torch.float32) -> list[int]:
    """Under `sync`, the bytes left alive after each micro-step of one window, over those at
    its start. A first window warms FSDP2 up (its lazy init)."""
    model = _sharded(MESHES[sync], dtype)
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.0), sync=sync)
    acc.step(_batches(rank, K, seed=1, dtype=dtype), _loss)
    batches = _batches(rank, K, seed=2, dtype=dtype)
    model.zero_grad(set_to_none=True)
    start = settled_bytes()
    window = acc.begin_window(batches)
    held = []
    for batch in batches:
        with window.micro_step():
            window.backward(*_loss(model, batch))
        held.append(settled_bytes() - start)
    window.finish()
    return held


def measure(info) -> dict[str, list[int]]:
    """Each policy's bytes held after each micro-step of one window (`policy_bytes`).

    The objects alive before the first model (torch's own, a few hundred thousand) are frozen
    out of the collector's reach, which makes each count fast; no tensor of the windows is
    among them."""
    gc.collect()
    gc.freeze()
    try:
        held = {sync: policy_bytes(info.rank, sync) for sync in MESHES}
        held[BF16_CASE] = policy_bytes(info.rank, "micro", torch.bfloat16)
        return held
    finally:
        gc.unfreeze()
