"""What `gradaccum verify --world-size N` runs (`EquivalenceSetup`): the ranks, the wrapper and
its sync policy, the windows and the data; every rank and the single process build the same
from it (no torch here). The check itself is `equivalence`; the traffic it compares, `traffic`.
"""

from __future__ import annotations

from dataclasses import dataclass

from gradaccum.plan.sync import POLICIES
from gradaccum.verification.settings import default_shards

WRAPPERS = ("ddp", "fsdp2")


@dataclass(frozen=True)
class EquivalenceSetup:
    """What the check runs; every rank and the single process build the same from it."""

    world_size: int = 2
    """Ranks taking part."""
    accum_steps: int = 4
    """Micro-batches per rank per window (k)."""
    steps: int = 3
    """Optimizer steps (AdamW, lr 1e-2, weight decay 0.1)."""
    wrapper: str = "ddp"
    """ddp (DistributedDataParallel) or fsdp2 (`fully_shard` on each block, then the root)."""
    sync_every_micro_batch: bool = False
    """Reduce gradients after every micro-batch instead of once per window."""
    sync: str = "window"
    """The Accumulator's sync policy: "window"; with wrapper "fsdp2" also "micro" (a
    reduce-scatter after every micro-batch) or "hsdp" (`fully_shard` over a 2-D mesh of
    replicas x `shards`)."""
    shards: int | None = None
    """With sync "hsdp": ranks per shard group; None: `default_shards(world_size)`."""
    short_rank: bool = True
    """The last rank's data runs out a micro-batch into the next-to-last window."""
    seed: int = 0
    """Seeds the model and every rank's data."""
    normalize: str = "tokens"
    """The Accumulator's normalize ("micro_batch_mean" shows what dividing by k costs)."""
    step_every_micro_batch: bool = False
    """The mistake of an optimizer step after every micro-batch (k steps per window), to
    show that the check fails on it."""
    tolerance: float = 1e-5
    """Largest relative error of a window's gradient and loss that passes (fp32: the
    precision study's, `gradaccum.verification.TOLERANCES`)."""
    vocab_size: int = 37
    """Token ids in the data are below this (the model must read at least this many)."""
    seq_len: int = 16
    """Positions per row, in tokens (the model must read at least this many)."""
    moe_balance: str | None = None
    """A mixture of experts' load-balancing mode (`gradaccum.moe.balance.Balance`): every
    window through `Balance.step`, against the big batch of cross-entropy plus the LBL
    (`moe_check.moe_big_batch`: the window's own f, or the window before's for
    "global-previous"). None: a dense model, `Accumulator.step` with `loss_fn`."""
    moe_shift: bool = False
    """With `moe_balance`: labels unshifted, as Hugging Face models take them."""

    def __post_init__(self):
        if self.world_size < 1:
            raise ValueError(f"world_size {self.world_size}: must be at least 1")
        if self.accum_steps < 1 or self.steps < 1:
            raise ValueError(
                f"accum_steps {self.accum_steps}, steps {self.steps}: must be at least 1"
            )
        if self.wrapper not in WRAPPERS:
            raise ValueError(f"wrapper {self.wrapper!r}: expected one of {', '.join(WRAPPERS)}")
        if not self.tolerance > 0:
            raise ValueError(f"tolerance {self.tolerance}: must be positive")
        self._check_sync()
        if self.vocab_size < 1 or self.seq_len < 1:
            raise ValueError(
                f"vocab_size {self.vocab_size}, seq_len {self.seq_len}: must be at least 1"
            )

    def _check_sync(self) -> None:
        if self.sync not in POLICIES:
            raise ValueError(f"sync {self.sync!r}: expected one of {', '.join(POLICIES)}")
        if self.sync != "window" and self.wrapper != "fsdp2":
            raise ValueError(f"sync {self.sync!r}: needs wrapper 'fsdp2'")
        if self.shards is not None and self.sync != "hsdp":
            raise ValueError(f"shards {self.shards}: needs sync 'hsdp'")
        if self.sync == "hsdp":
            replicas, shards = self.mesh_shape
            if shards < 2 or replicas < 2 or replicas * shards != self.world_size:
                raise ValueError(
                    f"sync 'hsdp' on {self.world_size} ranks with {shards} per shard group: "
                    "needs world_size = replicas x shards, both at least 2"
                )

    @property
    def mesh_shape(self) -> tuple[int, int]:
        """(replicas, shards): the ranks each gradient is all-reduced and reduce-scattered
        over. DDP (world, 1), FSDP2 (1, world), HSDP (world / shards, shards)."""
        w = self.world_size
        if self.wrapper == "ddp":
            return w, 1
        if self.sync != "hsdp":
            return 1, w
        shards = self.shards or default_shards(w)
        return w // shards, shards
