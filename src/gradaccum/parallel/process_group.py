"""Running under torchrun: the process group from the environment, and windows that end
together on every rank.

torchrun starts one process per device on every node and sets RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR and MASTER_PORT in each. `init_distributed` reads them, binds the process to its
device and joins the group with the backend that device needs (nccl on CUDA, hccl on Ascend
NPU, xccl on Intel GPUs, gloo on CPU):

    info = init_distributed()                      # under `torchrun --nproc-per-node 8 ...`
    model = DistributedDataParallel(model.to(info.device))
    acc = Accumulator(model, optimizer)
    for window in aligned_windows(my_rank_batches, accum_steps=4):
        acc.step(window, loss_fn)
    teardown(info)
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from itertools import islice

import torch
import torch.distributed as dist

from gradaccum.parallel import collectives, devices
from gradaccum.utils.errors import first_line

# Backends that run only on their own kind of device (gloo runs on any).
_BACKEND_DEVICE = {"nccl": "cuda", "hccl": "npu", "xccl": "xpu"}


@dataclass(frozen=True)
class RankInfo:
    """Where this process stands in the job."""

    rank: int
    """This process's rank over all nodes (0 .. world_size - 1)."""
    world_size: int
    """Processes in the job, over all nodes."""
    local_rank: int
    """This process's index on its node; picks its device."""
    device: torch.device
    """The device this process computes on (bound with `devices.set_current`)."""
    backend: str | None
    """Collective backend of the process group; None when running without one."""
    owns_group: bool
    """Whether `init_distributed` created the group (and `teardown` should destroy it)."""

    @property
    def is_main(self) -> bool:
        """Rank 0: the process that prints and writes files."""
        return self.rank == 0


def _env_int(env: Mapping[str, str], name: str, default: int) -> int:
    value = env.get(name)
    if value is None or value == "":
        return default
    try:
        number = int(value)
    except ValueError:
        number = -1
    if number < 0:
        raise ValueError(f"{name}={value!r}: expected a non-negative integer")
    return number


def env_ranks(env: Mapping[str, str] | None = None) -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from torchrun's variables; (0, 1, 0) without them."""
    env = os.environ if env is None else env
    rank = _env_int(env, "RANK", 0)
    world = _env_int(env, "WORLD_SIZE", 1)
    local_rank = _env_int(env, "LOCAL_RANK", 0)
    if world < 1:
        raise ValueError(f"WORLD_SIZE={world}: expected at least 1")
    if rank >= world:
        raise ValueError(f"RANK={rank}: expected below WORLD_SIZE={world}")
    return rank, world, local_rank


def init_distributed(
    device: str | torch.device | None = None,
    backend: str | None = None,
    timeout_s: float = 600.0,
) -> RankInfo:
    """Join the process group torchrun describes in the environment.

    device: None or "auto" takes the best accelerator, indexed by LOCAL_RANK; "cpu" forces CPU.
    backend: None picks it from the device (`devices.distributed_backend`); "gloo", "nccl",
      ... override it (gloo runs on any device; nccl/hccl/xccl need theirs).
    timeout_s: seconds a collective may wait for the other ranks before failing.
    A process started without torchrun (no WORLD_SIZE) runs alone: no group is created. An
    already initialized group is reused and left for its creator to destroy.
    """
    env = os.environ
    if not timeout_s > 0:
        raise ValueError(f"timeout_s {timeout_s}: must be positive")
    rank, world, local_rank = env_ranks(env)
    dev = devices.resolve(device, local_rank=local_rank)
    devices.set_current(dev)
    if dist.is_available() and dist.is_initialized():
        return RankInfo(
            dist.get_rank(), dist.get_world_size(), local_rank, dev, dist.get_backend(), False
        )
    if "WORLD_SIZE" not in env:
        return RankInfo(0, 1, 0, dev, None, False)
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not env.get(name)]
    if missing:
        raise ValueError(
            f"WORLD_SIZE={world} but {' and '.join(missing)} not set: launch with torchrun"
        )
    backend = backend or devices.distributed_backend(dev)
    needs = _BACKEND_DEVICE.get(backend)
    if needs is not None and dev.type != needs:
        raise ValueError(f"backend {backend!r} needs a {needs} device; this process has {dev}")
    # env:// (not tcp://): under torchrun's c10d rendezvous the agent already serves the store
    # at MASTER_ADDR:MASTER_PORT and env:// joins it as a client.
    store = _agent_store(env, world, timedelta(seconds=timeout_s))
    dist.init_process_group(
        backend=backend,
        init_method=None if store is not None else "env://",
        store=store,
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s),
        device_id=dev if dev.type == "cuda" else None,  # nccl: bind and connect eagerly
    )
    return RankInfo(rank, world, local_rank, dev, backend, True)


def _agent_store(env, world: int, timeout: timedelta):
    """The store of this start of the group, where torchrun's agent serves it
    (TORCHELASTIC_USE_AGENT_STORE=True); None otherwise (env:// then joins as before).

    torchrun keeps one rendezvous store for every start of a group (unless
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1), while env:// takes it as new on each restart: a
    restarted group's gloo would read the addresses its dead ranks left there and fail
    ("connectFullMesh ... Connection refused"). Its keys under a prefix per start,
    TORCHELASTIC_RESTART_COUNT, keep each start's apart."""
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    client = dist.TCPStore(
        env["MASTER_ADDR"], int(env["MASTER_PORT"]), world, is_master=False, timeout=timeout
    )
    start = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"gradaccum_start_{start}/default_pg", client)


LOST_WORDS = ("timed out", "timeout", "connection closed", "connection reset", "pair closure")
"""How a collective reports a peer that died or stopped answering, in the error's first line
(lower-cased), whether it raised in the caller or inside a DDP hook during backward
("Application timeout caused pair closure")."""


def peer_lost(err: BaseException) -> bool:
    """Whether `err` is a collective failing because another rank died or stopped answering
    (a `DistError`, or gloo's RuntimeError with one of LOST_WORDS)."""
    if isinstance(err, dist.DistError):
        return True
    return any(word in first_line(err).lower() for word in LOST_WORDS)


def teardown(info: RankInfo) -> None:
    """Destroy the process group if `init_distributed` created it, after the garbage that
    still holds it is collected. A DDP model left in a reference cycle (a trainer's parts
    point at each other) keeps the group's C++ side alive past `destroy_process_group`; it is
    then freed at interpreter exit, where gloo can abort the process ("terminate called
    without an active exception", exit -6 under torchrun after a run that succeeded)."""
    gc.collect()
    if info.owns_group and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@contextmanager
def process_group(**kwargs) -> Iterator[RankInfo]:
    """`init_distributed(**kwargs)` for the length of a `with` block."""
    info = init_distributed(**kwargs)
    try:
        yield info
    finally:
        teardown(info)


def aligned_windows(iterable: Iterable, accum_steps: int, group=None) -> Iterator[list]:
    """Windows of up to `accum_steps` of this rank's micro-batches, ending on the same
    optimizer step on every rank.

    A rank whose data ran out yields short or empty windows while another rank still has
    data; `Accumulator.step` repeats its last batch with weight 0, so it joins every
    collective and adds nothing. The loop ends on all ranks once no rank has a micro-batch
    left. Cost: one 8-byte all-reduce per window.
    """
    if accum_steps < 1:
        raise ValueError(f"accum_steps {accum_steps}: must be at least 1")
    batches = iter(iterable)
    while True:
        window = list(islice(batches, accum_steps))
        if collectives.max_over_ranks(len(window), group) == 0:
            return
        yield window
