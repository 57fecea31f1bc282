"""Where a command runs: settings component (no torch; `devices.check_device` checks the
device when the command runs)."""

from __future__ import annotations

from dataclasses import dataclass

from gradaccum.settings.field import setting


@dataclass
class ParallelSettings:
    """device and ranks"""

    device: str = setting("auto", "str", metavar="DEVICE")
    """cpu, cuda, cuda:1, npu, npu:1, xpu, mps, or auto (the best one present)."""
    dist_timeout: float = setting(300.0, "float", metavar="SECONDS", above=True)
    """Under torchrun, seconds a rank waits for the others before failing: a rank that died or
    hangs is reported within this time, not after torch's 10-minute default."""
