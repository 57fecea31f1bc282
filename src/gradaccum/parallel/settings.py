"""Where a command runs: settings component (no torch; `devices.check_device` checks the
device when the command runs)."""

from __future__ import annotations

from dataclasses import dataclass

from gradaccum.settings.field import setting
from gradaccum.utils.choices import SYNC_CHOICES


@dataclass
class ParallelSettings:
    """device and ranks"""

    device: str = setting("auto", "str", metavar="DEVICE")
    """cpu, cuda, cuda:1, npu, npu:1, xpu, mps, or auto (the best one present)."""
    dist_timeout: float = setting(300.0, "float", metavar="SECONDS", above=True)
    """Under torchrun, seconds a rank waits for the others before failing: a rank that died or
    hangs is reported within this time, not after torch's 10-minute default."""
    sync: str | None = setting(None, "choice", choices=SYNC_CHOICES, default_text="window")
    """How data-parallel ranks sync the window's gradient: window (once, after the window's
    last micro-batch; the whole fp32 gradient held until then; train: DDP), micro (a
    reduce-scatter into an fp32 shard after every micro-batch; train: the model sharded by
    FSDP2), hsdp (a 2-D mesh of replicas x shards: a reduce-scatter within the shard group
    after every micro-batch, one all-reduce across replicas per window; train: each node one
    replica), auto (the fastest whose memory fits: plan's --device-memory, train's device,
    where its memory is known; train says which and why)."""

    @property
    def shards_model(self) -> bool:
        """Whether the model is sharded with FSDP2: --sync micro or hsdp (window: DDP)."""
        return self.sync in ("micro", "hsdp")
