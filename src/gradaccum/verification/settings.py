"""What `gradaccum verify` checks beyond one window: settings component (no torch)."""

from __future__ import annotations

from dataclasses import dataclass

from gradaccum.settings.field import setting


@dataclass
class VerifySettings:
    """the check"""

    SECTION = "check"

    k: int = setting(4, least=1, metavar="K")
    """Micro-batches in the window."""
    world_size: int = setting(1, least=1)
    """Also run N gloo ranks (DDP, FSDP2); at most 4 per CPU core, and as many as the
    available memory holds at 0.3 GB plus 48 bytes per model parameter each."""
    shards: int | None = setting(None, least=2, default_text="--world-size / its smallest "
                                 "prime factor: 2 replicas x 2 on 4 ranks")  # fmt: skip
    """Ranks per shard group of --sync hsdp; --world-size must be a multiple of it, with at
    least 2 replicas."""
    precision_study: bool = setting(False, "bool")
    """The error of accumulating in each precision for k = 1 .. --k-max."""
    k_max: int = setting(1024, least=1, metavar="K")
    """Largest k of the precision study: a power of two, at most 1024."""
    plot: str | None = setting(None, "path", default_text="precision_study.png")
    """The precision study's PNG; only with --precision-study."""


def default_shards(world: int) -> int:
    """--shards not given: the largest shard group leaving at least 2 replicas, `world`
    divided by its smallest prime factor (2 on 4 ranks, 3 on 6, 4 on 8; 1 when `world` is
    prime, which HSDP cannot split)."""
    factor = next((p for p in range(2, world + 1) if world % p == 0), 1)
    return world // factor
