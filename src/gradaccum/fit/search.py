"""Which micro-batch sizes `gradaccum fit` probes, which it times, and which it chooses: the
rule, apart from the measuring (no torch here), so that it can be tested with a speed curve.

Sizes are probed by doubling from 1 and bisecting (`largest_fitting`); the doublings and the
largest that fit are timed (`to_time`). The target's batch in sequences (target tokens /
(seq_len x world)) often has few divisors (125 = 5^3, a prime, twice a prime): then most sizes,
the fastest among them, give k x micro a little off the target. So the sizes that land on it
(within EXACT) nearest to the fastest one timed, below and above, are probed and timed too
(`near_landing`). The choice (`choose`): among the timed sizes whose global batch is within
--batch-tolerance of the target, the fastest; among those within measurement noise of it (at
most MAX_NOISE), one that lands on the target first, then the one with the lowest peak
memory. So the choice runs at >= (1 - MAX_NOISE) x the fastest size measured within the
tolerance, and pays for an exact batch only where that costs less than the noise.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from gradaccum.fit.target import BATCH_TOLERANCE, EXACT, MAX_NOISE, NOISE_FLOOR, Target

if TYPE_CHECKING:
    from gradaccum.fit.result import Candidate

__all__ = ["BATCH_TOLERANCE", "EXACT", "MAX_NOISE", "NOISE_FLOOR", "Target", "choose"]
__all__ += ["largest_fitting", "near_landing", "probe_sizes", "search", "to_time"]

BISECT_RESOLUTION = 16
"""Bisection stops once the gap between fitting and not is at most 1/16 of the size."""


def largest_fitting(fits: Callable[[int], bool], cap: int, start: int = 1, stop=None) -> int:
    """The largest size <= cap that fits: double from `start` until one does not fit (or cap is
    reached), then bisect between the last that fit and the first that did not, to within
    1/BISECT_RESOLUTION of the size. 0 if none of the sizes tried fits. `stop()` true ends the
    search early with the best so far."""
    good, bad, size = 0, None, min(start, cap)
    while bad is None:
        if good and stop is not None and stop():
            return good
        if fits(size):
            good = size
            if size == cap:
                return good
            size = min(2 * size, cap)
        else:
            bad = size
    while bad - good > max(1, good // BISECT_RESOLUTION):
        if good and stop is not None and stop():
            break
        mid = (good + bad) // 2
        if fits(mid):
            good = mid
        else:
            bad = mid
    return good


Probe = Callable[[int, bool], "Candidate"]
"""probe(micro_batch, checkpointing) -> the candidate measured (memory, whether it fits)."""
Timer = Callable[["Candidate"], None]
"""time(candidate): sets its tokens_per_s and noise, or marks it as not fitting."""


def probe_sizes(probe: Probe, cap: int, checkpointing: bool, stop) -> list[Candidate]:
    """Probe without checkpointing from 1 up, then with it from the largest that fit up."""
    tried: list[Candidate] = []

    def fits(on: bool) -> Callable[[int], bool]:
        def one(micro_batch: int) -> bool:
            tried.append(probe(micro_batch, on))
            return tried[-1].fits

        return one

    largest = largest_fitting(fits(False), cap, 1, stop)
    if checkpointing and (largest or not stop()):
        largest_fitting(fits(True), cap, max(1, largest), stop)
    return tried


def to_time(candidates: list[Candidate]) -> list[Candidate]:
    """The candidates worth timing: per checkpointing setting, every size doubling reached
    that fit, and the largest that fit (not the sizes bisection tried on the way). The
    largest first, so that under a time limit the likeliest winners are timed."""
    chosen = []
    for checkpointing in (False, True):
        fit = [c for c in candidates if c.fits and c.checkpointing == checkpointing]
        top = max((c.micro_batch for c in fit), default=0)
        start = min((c.micro_batch for c in fit), default=0)
        doubled = {start << i for i in range(64) if start << i <= top}
        seen = set()
        for c in fit:
            if (c.micro_batch in doubled or c.micro_batch == top) and c.micro_batch not in seen:
                seen.add(c.micro_batch)
                chosen.append(c)
    return sorted(chosen, key=lambda c: (-c.micro_batch, c.checkpointing))


def _timed(candidates: list[Candidate]) -> list[Candidate]:
    return [c for c in candidates if c.fits and c.tokens_per_s]


def near_landing(candidates: list[Candidate], target: Target, agree=None) -> list[tuple]:
    """(micro_batch, checkpointing) to measure next: the sizes landing on the target nearest
    to the fastest size timed, when that one does not land itself. Sizes up to the largest
    that fit with its checkpointing setting. `agree(micro, checkpointing)` makes every rank
    start from the same fastest size (each rank times its own steps)."""
    timed = _timed(candidates)
    if not timed:
        return []
    fastest = max(timed, key=lambda c: c.tokens_per_s)
    micro, checkpointing = fastest.micro_batch, fastest.checkpointing
    if agree is not None:
        micro, checkpointing = agree(micro, checkpointing)
    if target.lands(micro):
        return []
    same = [c for c in candidates if c.checkpointing == checkpointing]
    top = max((c.micro_batch for c in same if c.fits), default=micro)
    done = {c.micro_batch for c in same if not c.fits or c.tokens_per_s}
    return [(m, checkpointing) for m in target.landing_near(micro, top) if m not in done]


def search(
    probe: Probe, time: Timer, target: Target, cap: int, checkpointing: bool, stop, agree=None
) -> list[Candidate]:
    """Every candidate probed, in the order probed, the ones worth timing timed: the doublings
    and the largest that fit, then the sizes landing on the target next to the fastest."""
    candidates = probe_sizes(probe, cap, checkpointing, stop)
    for cand in to_time(candidates):
        if stop():
            return candidates
        time(cand)
    for micro, on in near_landing(candidates, target, agree):
        if stop():
            break
        known = [c for c in candidates if (c.micro_batch, c.checkpointing) == (micro, on)]
        cand = known[0] if known else probe(micro, on)
        if not known:
            candidates.append(cand)
        if cand.fits:
            time(cand)
    return candidates


def choose(
    candidates: list[Candidate], target: Target | None = None, tolerance: float = BATCH_TOLERANCE
) -> Candidate | None:
    """The candidate to train with, or None when none fits.

    Of the timed sizes whose global batch is within `tolerance` of the target (with none
    there: the ones closest to it), the fastest; among the ones within its measurement noise
    (at most MAX_NOISE) of it, one that lands on the target first, then the lowest peak
    memory (the most headroom). With no size timed: the largest that fits."""
    timed = _timed(candidates)
    if not timed:
        fitting = [c for c in candidates if c.fits]
        return max(fitting, key=lambda c: (c.micro_batch, not c.checkpointing), default=None)
    pool = timed
    if target is not None:
        off = {c.micro_batch: abs(target.deviation(c.micro_batch)) for c in timed}
        pool = [c for c in timed if off[c.micro_batch] <= tolerance]
        if not pool:
            pool = [c for c in timed if off[c.micro_batch] == min(off.values())]
    best = max(pool, key=lambda c: c.tokens_per_s)
    slack = min(best.noise, MAX_NOISE)
    close = [c for c in pool if c.tokens_per_s >= best.tokens_per_s * (1 - slack)]
    lands = target.lands if target is not None else (lambda micro: False)
    return min(close, key=lambda c: (not lands(c.micro_batch), _peak(c), -c.tokens_per_s))


def _peak(c: Candidate) -> int:
    return -1 if c.peak_memory_bytes is None else c.peak_memory_bytes
