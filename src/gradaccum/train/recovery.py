"""Out of memory mid-window: the window abandoned, rewound and redone with a smaller
micro-batch, on every rank at once; and a rank lost under torchrun, said in one line.

Under torchrun the ranks agree (`Recovery.agree`, a MAX all-reduce of one flag per micro-step
on a gloo group, `collectives.host_group`) on GO, STOP (a stop request: the window is
abandoned) or OUT_OF_MEMORY (a rank ran out of memory on the micro-batch before): ranks must
abandon the same micro-step, or one waits in the last one's gradient all-reduce. The flag of
micro-step i is launched before its forward and read before micro-step i+1's, so the host
never waits for it while the device has work queued; only the window's last micro-step, whose
backward carries the gradients' all-reduce, launches and reads its flag before its forward.
A rank that ran out of memory on micro-step i reads micro-step i's flag and joins micro-step
i+1's with OUT_OF_MEMORY; the others read it before micro-step i+2's forward, or before the
last's (on one rank, no flags). So the others may run one micro-step the failed rank does
not, always one of micro-steps 1 .. k-2: under DDP's no_sync those run no collective (DDP's
forward broadcasts buffers only after a synced backward, i.e. in micro-step 0), so nothing
waits on the failed rank there. A model sharded by FSDP2 (--sync micro, hsdp) has collectives in every
forward and backward, in which the other ranks wait for a rank that ran out of memory: that
rank stops the run in one line naming the smaller --micro-batch to resume with, and the others
end when its process does.

An abandoned window is rewound (nothing stepped, nothing counted, the data and the RNG back at
its start, as the last checkpoint would be); after out of memory it is redone from its first
micro-batch with the largest micro-batch of at most half the sequences that divides the old
one, and k up by the same factor: the same tokens per step, the same data
(`BatchState.shrink`).
"""

from __future__ import annotations

import gc
from collections.abc import Callable

from gradaccum.engine.accumulator import Accumulator, StepResult
from gradaccum.parallel import collectives, devices
from gradaccum.parallel.process_group import RankInfo, peer_lost
from gradaccum.train.batch_state import BatchState, smaller_micro_batch
from gradaccum.train.rundir import checkpoint
from gradaccum.utils.errors import RanksLost, RunFailed, first_line

GO, STOP, OUT_OF_MEMORY = 0, 1, 2
"""What the ranks agree on, one flag per micro-step (the largest wins)."""
PEER_OUT_OF_MEMORY = "peer out of memory"
"""A window's answer when another rank ran out of memory in it."""


class Recovery:
    """Runs a window until it finishes (`run`), redoing it smaller after out of memory.

    `report(line, event)`: called after each shrink with the line to print and the
    metrics.jsonl event (step, "out_of_memory", the new micro-batch and k). `on_abandon`:
    called with each abandoned window, after the accumulator's (an MoE balance's window)."""

    def __init__(
        self,
        acc: Accumulator,
        batches,
        batch: BatchState,
        rank_info: RankInfo,
        report: Callable[[str, dict], None],
        timeout_s: float | None = None,
        on_abandon: Callable[[], None] | None = None,
        sharded: str | None = None,
    ):
        self.acc, self.batches, self.batch = acc, batches, batch
        self.sharded = sharded
        """--sync micro or hsdp: a model sharded by FSDP2, whose windows are not redone."""
        self.on_abandon = on_abandon
        self.rank_info, self.report = rank_info, report
        self.micro_index = -1
        """The micro-batch of the window in progress (-1 before its first)."""
        alone = rank_info.world_size == 1
        self.group = None if alone else collectives.host_group(timeout_s)
        """Where the flags are agreed on (None: the default group)."""
        self._pending: collectives.LaunchedMax | None = None
        """The flag launched before the last micro-step's forward, not read yet."""

    def begin_window(self) -> None:
        """Before a window's micro-batches are fetched."""
        self.micro_index = -1
        self._pending = None

    def agree(self, stop_requested: bool, micro_index: int, micro_steps: int) -> int:
        """Before micro-batch `micro_index` of a window of `micro_steps`: GO, STOP or
        OUT_OF_MEMORY, the same on every rank: the flags raised before the previous
        micro-batch, and on the last micro-batch its own too (see the module docstring)."""
        self.micro_index = micro_index
        here = STOP if stop_requested else GO
        if self.rank_info.world_size == 1:
            return here
        before = self._read_pending()
        if before != GO:
            return before
        if micro_index == micro_steps - 1:
            return collectives.max_over_ranks(here, self.group)
        self._pending = collectives.LaunchedMax(here, self.group)
        return GO

    def agree_between_windows(self, stop: bool) -> bool:
        """After a window: whether any rank asks to stop (one flag; on one rank, `stop`)."""
        if self.rank_info.world_size == 1:
            return stop
        return bool(collectives.max_over_ranks(int(stop), self.group))

    def _read_pending(self) -> int:
        pending, self._pending = self._pending, None
        return GO if pending is None else pending.value()

    def run(self, window: Callable[[], StepResult | str | None]) -> StepResult | None:
        """`window()` until it returns its StepResult; None when it answered None (a stop
        request mid-window), after rewinding. Out of memory here, or PEER_OUT_OF_MEMORY
        answered: rewound, shrunk, and done again."""
        position, rng = self.batches.position, checkpoint.rng_state()
        while True:
            try:
                result = window()
                failed = None
            except devices.out_of_memory_errors() as err:
                failed = first_line(err)
            # Rewound outside the handler: its traceback holds the window's tensors.
            if failed is None and isinstance(result, StepResult):
                return result
            if failed is not None and not self._tell_ranks(failed):
                failed, result = None, None  # another rank's stop came first: stop too
            self.acc.abandon_window()
            if self.on_abandon is not None:
                self.on_abandon()
            self.batches.position = position
            checkpoint.set_rng_state(rng)
            if failed is None and result is None:
                return None
            self._shrink(failed or "on another rank")
            position = self.batches.position

    def _tell_ranks(self, error: str) -> bool:
        """Under torchrun, after this rank ran out of memory on micro-batch i: it reads
        micro-step i's flag, which the others read before micro-batch i+1, and joins
        micro-step i+1's with OUT_OF_MEMORY, so all redo the window (True). When micro-step
        i's flag was a stop, the others stop there without another flag, and so does this
        rank (False); when it was OUT_OF_MEMORY, another rank failed a micro-batch earlier and
        told them already (True). On the window's last micro-batch the others may already be
        in the gradients' all-reduce: nothing to join, the run stops."""
        info = self.rank_info
        if info.world_size == 1:
            return True
        if self.sharded:  # the others wait in this micro-step's all-gathers or reduce-scatter
            raise RunFailed(
                f"rank {info.rank}: out of memory in step {self.acc.steps + 1} ({error}); a "
                f"model sharded by --sync {self.sharded} cannot redo the window smaller (the "
                f"other ranks are inside its collectives); continue with {self._advice()} (the "
                "tokens per step stay)"
            )
        if not 0 <= self.micro_index < self.batch.k - 1:
            raise RunFailed(
                f"rank {info.rank}: out of memory in step {self.acc.steps + 1} "
                f"outside the window's first k-1 micro-batches ({error}), where the ranks "
                f"cannot redo it together; continue with {self._advice()} (the tokens per step "
                "stay)"
            )
        seen = self._read_pending()
        if seen == GO:
            collectives.max_over_ranks(OUT_OF_MEMORY, self.group)
        return seen != STOP  # OUT_OF_MEMORY: another rank failed first and told them already

    def _advice(self) -> str:
        """How to continue after an out of memory the ranks cannot redo together: resume
        with the next smaller micro-batch, or recompute the activations at micro-batch 1."""
        smaller = smaller_micro_batch(self.batch.micro_batch)
        return f"--resume --micro-batch {smaller}" if smaller else "--activation-checkpointing"

    def _shrink(self, error: str) -> None:
        """The batch shrunk (`BatchState.shrink`), the device's cache emptied, the event
        reported. Every rank does the same (they agreed in `agree`)."""
        old, step = self.batch.micro_batch, self.acc.steps + 1
        smaller = self.batch.shrink(self.acc.steps)
        if smaller is None:
            raise RunFailed(
                f"rank {self.rank_info.rank}: out of memory in step {step} at micro-batch "
                f"{old} ({error}); try --activation-checkpointing or a shorter --seq-len"
            )
        gc.collect()
        devices.empty_cache(self.rank_info.device)
        self.batches.set_micro_batch(smaller)
        k = self.batch.k
        line = (
            f"step {step}: out of memory at micro-batch {old} ({error}); redoing the window "
            f"with micro-batch {smaller} x k {k}, the same tokens per step"
        )
        event = {"step": step, "event": "out_of_memory", "micro_batch": smaller, "accum_steps": k}
        self.report(line, event)


def lost_rank(err: BaseException, rank_info: RankInfo, timeout_s: float, step: int):
    """`err` as one line (RanksLost) when it is a collective that failed because another rank
    died or stopped answering (`timeout_s`: --dist-timeout) after `step` optimizer steps;
    None for any other error."""
    if not isinstance(err, RuntimeError) or rank_info.world_size == 1 or not peer_lost(err):
        return None
    return RanksLost(
        f"rank {rank_info.rank} of {rank_info.world_size}: another rank stopped answering (it "
        f"died or hangs; --dist-timeout {timeout_s:g} s) at step {step}: {first_line(err)}"
    )
