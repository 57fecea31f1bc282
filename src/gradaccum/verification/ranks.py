"""N rank processes on one machine, joined by gloo on CPU the way torchrun starts them on one
node, none of which outlives the process that started them.

`run_ranks` is the harness the tests, `gradaccum verify --world-size` and the benchmarks share
(public through `gradaccum.testing`). How its ranks end, whatever ends their parent:
- the parent returns or raises (a rank failed, the timeout passed, Ctrl-C): every rank still
  running is killed before `run_ranks` returns or raises (try/finally);
- the parent is killed (SIGTERM, SIGKILL, a crash), which runs no finally: each rank has asked
  the kernel for SIGKILL when its parent dies (prctl PR_SET_PDEATHSIG, Linux), and a thread in
  each rank waits on the pipe its parent holds open (multiprocessing's parent sentinel, every
  platform) and ends the rank when that pipe closes;
- one rank fails: the others are given FAILED_GRACE_S to end on their own (a peer's closed
  sockets usually end them at once, with their own traceback), then killed, instead of
  waiting in a collective until the timeout.

How many ranks a machine holds (`rank_capacity`): at most RANKS_PER_CORE per CPU core this
process may run on, and as many as the available memory holds at RANK_BASE_BYTES plus the
caller's estimate of its own state per rank.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable

import torch

from gradaccum.parallel.process_group import init_distributed, teardown
from gradaccum.utils.atomic import write_atomic

RANKS_PER_CORE = 4
"""Ranks per CPU core at most: gloo ranks on CPU take turns on a core; past a few each, a run
is mostly waiting, and every rank holds its own interpreter and torch."""
RANK_BASE_BYTES = 300 * 2**20
"""Memory of one rank before its own work, in bytes: 230 MB resident measured for a spawned
process that imported torch and gradaccum and joined a gloo group, rounded up."""
FAILED_GRACE_S = 5.0
"""Seconds the other ranks get to end on their own once one rank has failed."""
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- how many ranks this machine holds --------------------------------------------------------


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def available_memory_bytes() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (memory a new process can take without
    swapping); None where there is no /proc/meminfo."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def rank_capacity(rank_bytes: int = 0) -> tuple[int, str]:
    """The most ranks this machine holds, and the rule in words.

    rank_bytes: the caller's estimate of each rank's own memory beyond RANK_BASE_BYTES (its
    model, gradients, optimizer state), in bytes.
    """
    cores = usable_cores()
    by_cores = RANKS_PER_CORE * cores
    per_rank = RANK_BASE_BYTES + max(0, int(rank_bytes))
    available = available_memory_bytes()
    rule = f"{RANKS_PER_CORE} per CPU core ({cores} cores: {by_cores})"
    limit = by_cores
    if available is not None:
        by_memory = available // per_rank
        limit = min(limit, by_memory)
        rule += (
            f" and as many as the available memory holds at {_gb(per_rank)} GB each"
            f" ({_gb(available)} GB available: {by_memory})"
        )
    return max(1, limit), rule


def _gb(n: int) -> str:
    return f"{n / 1e9:.2g}" if n < 1e10 else f"{n / 1e9:.0f}"


def check_world_size(world_size: int, rank_bytes: int = 0) -> None:
    """Raise ValueError, with the rule, when `world_size` ranks would not fit this machine."""
    if world_size < 1:
        raise ValueError(f"world_size {world_size}: must be at least 1")
    limit, rule = rank_capacity(rank_bytes)
    if world_size > limit:
        raise ValueError(
            f"world_size {world_size}: more ranks than this machine holds; at most {limit}: {rule}"
        )


# ---- running them -----------------------------------------------------------------------------


def run_ranks(
    fn: Callable,
    world_size: int,
    args: tuple = (),
    timeout_s: float = 120.0,
    threads_per_rank: int = 1,
    rank_bytes: int = 0,
) -> list:
    """Run `fn(info: RankInfo, *args)` in `world_size` fresh processes joined by gloo on CPU
    (the way torchrun would start them on one node) and return each rank's return value.

    `fn` and `args` must be picklable (a module-level function); return values travel back
    through `torch.save`, so keep them to tensors, numbers, strings, lists and dicts.
    rank_bytes: each rank's own memory beyond RANK_BASE_BYTES, for `check_world_size`.
    Raises ValueError when the machine cannot hold `world_size` ranks (nothing started),
    TimeoutError when a rank is still running after `timeout_s` seconds, RuntimeError with
    the ranks' tracebacks when one failed. No rank is running when it returns or raises.
    """
    check_world_size(world_size, rank_bytes)
    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="gradaccum-ranks-") as tmp:
        procs: list = []
        try:
            for rank in range(world_size):
                p = ctx.Process(
                    target=_rank_main,
                    args=(fn, args, rank, world_size, port, tmp, threads_per_rank, timeout_s),
                    daemon=True,
                )
                p.start()
                procs.append(p)
            stuck = _wait(procs, tmp, timeout_s)
        finally:
            _kill(procs)
        outcomes = [_read_outcome(tmp, rank) for rank in range(world_size)]
    return _results(outcomes, procs, stuck, world_size, timeout_s)


def _wait(procs: list, tmp: str, timeout_s: float) -> list[int]:
    """Wait for every rank to end, at most `timeout_s`; once one has failed, the others for at
    most FAILED_GRACE_S more. Returns the ranks still running when the waiting stopped."""
    deadline = time.monotonic() + timeout_s
    running = dict(enumerate(procs))
    while running:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        ended = multiprocessing.connection.wait([p.sentinel for p in running.values()], left)
        for rank, p in list(running.items()):
            if p.sentinel not in ended:
                continue
            p.join()
            del running[rank]
            if p.exitcode != 0 or "value" not in _read_outcome(tmp, rank):
                deadline = min(deadline, time.monotonic() + FAILED_GRACE_S)
    return sorted(running)


def _kill(procs: list) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join()


def _results(outcomes: list[dict], procs: list, stuck: list[int], world: int, timeout_s) -> list:
    failed = {rank: out["error"] for rank, out in enumerate(outcomes) if "error" in out}
    details = "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in failed.items())
    lost = [
        f"rank {r} ended with exit code {p.exitcode} and no result"
        for r, p in enumerate(procs)
        if not outcomes[r] and r not in stuck
    ]
    details += "".join(f"\n--- {line} ---" for line in lost)
    if stuck and not failed and not lost:
        raise TimeoutError(f"ranks {stuck} of {world} still running after {timeout_s} s")
    if failed or lost or stuck:
        bad = sorted(set(failed) | {r for r, out in enumerate(outcomes) if not out})
        ended = f" (ranks {stuck} stopped: another had failed)" if stuck else ""
        raise RuntimeError(f"ranks {bad} of {world} failed{ended}{details}")
    return [out["value"] for out in outcomes]


def _rank_main(fn, args, rank, world_size, port, tmp, threads, timeout_s) -> None:
    _end_with_parent()
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(threads)
    info = None
    try:
        info = init_distributed(device="cpu", backend="gloo", timeout_s=timeout_s)
        outcome = {"value": fn(info, *args)}
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises
        outcome = {"error": traceback.format_exc()}
    path = os.path.join(tmp, f"rank{rank}.pt")
    write_atomic(path, lambda f: torch.save(outcome, f))
    # After a failure the other ranks may sit in a collective: leave without the group's
    # goodbye, closing the sockets is what tells them.
    if info is not None and "value" in outcome:
        teardown(info)


def _end_with_parent() -> None:
    """Make this rank end when the process that started it ends, however it ends."""
    parent = multiprocessing.parent_process()
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):  # no prctl here: the watching thread remains
            pass
    if parent is None:
        return
    # The parent may have died before the prctl above: then nobody will signal this rank.
    if os.getppid() != parent.pid or not parent.is_alive():
        os._exit(1)
    threading.Thread(target=_exit_when_closed, args=(parent.sentinel,), daemon=True).start()


def _exit_when_closed(sentinel) -> None:
    multiprocessing.connection.wait([sentinel])
    os._exit(1)


def _read_outcome(tmp: str, rank: int) -> dict:
    path = os.path.join(tmp, f"rank{rank}.pt")
    if not os.path.exists(path):
        return {}
    return torch.load(path, weights_only=True)
