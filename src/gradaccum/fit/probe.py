"""The micro-batch that fits and runs fastest, measured; k keeps the tokens per step.

`find_micro_batch` runs real training steps (forward, backward and the optimizer step, through
the engine) at growing micro-batch sizes: it doubles the size until one does not fit, then
bisects between the last that fit and the first that did not. A size does not fit when the
device raises an out-of-memory error (caught by type, `devices.out_of_memory_errors`) or when
the memory it measured is over the budget. After an out-of-memory error the step's outputs
are dropped, the gradients set to None, the loss scaler reset, garbage collected and the device
cache emptied, and the search goes on.

Memory is measured, not estimated:
- on accelerators, the allocator's peak over one steady step (optimizer state already held);
- on CPU, the exact bytes of parameters, gradients, buffers and optimizer state (unique
  storages), plus the activations: the bytes of the unique storages autograd saves for
  backward, counted with saved-tensor hooks. Under activation checkpointing the first
  checkpointed block is counted whole, because backward recomputes one block at a time and
  one block's activations are what checkpointing cannot drop.

The sizes doubling reached that fit, and the largest that fit, are then timed, with
activation checkpointing off and on (on: from the largest size that fit without it upward,
where checkpointing buys a larger micro-batch); then the sizes whose global batch lands on
the target (within 1%) nearest to the fastest one. The choice (`fit_search.choose`): the
fastest of the sizes whose global batch is within --batch-tolerance (default 5%) of the
target; among those within measurement noise of it (at most 5%), one that lands on the
target, then the lowest peak memory (the most headroom). Then k = round(target / (micro x
seq_len x world)), at least 1, the rule `gradaccum plan` uses. The table says when the
choice is off the target, and how much faster than the fastest size landing on it.

Under torchrun every rank probes the same sizes: each probe's out-of-memory flag is agreed
with a MAX all-reduce, and the chosen size with a MIN (checkpointing with a MAX), so no rank
ever waits alone in a collective.
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from collections.abc import Callable
from contextlib import contextmanager

import torch

from gradaccum.engine.accumulator import Accumulator
from gradaccum.engine.precision import LossScaler
from gradaccum.fit.memory import (
    MemoryUse,
    SavedTensorCounter,
    optimizer_tensors,
    quantization_constants,
    storage_bytes,
    storage_key,
)
from gradaccum.fit.report import choice_notes, render_table
from gradaccum.fit.result import Candidate, FitResult, NothingFits
from gradaccum.fit.search import choose, largest_fitting, search, to_time
from gradaccum.fit.target import BATCH_TOLERANCE, NOISE_FLOOR, Target
from gradaccum.models.checkpointing import checkpointing_enabled, first_block, set_checkpointing
from gradaccum.models.optimizer import adamw
from gradaccum.parallel import collectives, devices
from gradaccum.utils.errors import BadInput
from gradaccum.utils.sizes import fmt_bytes, fmt_int

__all__ = ["BATCH_TOLERANCE", "FitResult", "choose", "find_micro_batch", "largest_fitting"]
__all__ += ["choice_notes", "measure_step", "render_table", "to_time"]

TIMED_SECONDS = 0.6
"""Seconds of timed steps per candidate (at least MIN_TIMED_STEPS steps, at most
MAX_TIMED_STEPS)."""
MIN_TIMED_STEPS = 2
MAX_TIMED_STEPS = 8


def _snapshot(model: torch.nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(tensor, a CPU copy) of what probe steps change: the parameters that train and the
    buffers. A frozen base never changes and is not copied (a quantised one could not be
    loaded back through `load_state_dict`, and a 7B base would take its size again)."""
    changed = [p for p in model.parameters() if p.requires_grad] + list(model.buffers())
    return [(t, t.detach().to("cpu", copy=True)) for t in changed]


def _put_back(saved: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    with torch.no_grad():
        for tensor, copy in saved:
            tensor.copy_(copy)


def _default_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return adamw(model, lr=1e-5)


# ---- one probe -------------------------------------------------------------------------


class _Prober:
    """Runs measured and timed training steps of one window of one micro-batch."""

    def __init__(self, model, make_batch, loss_fn, precision, make_optimizer, budget, seq_len):
        self.model, self.make_batch, self.loss_fn = model, make_batch, loss_fn
        self.precision, self.budget, self.seq_len = precision, budget, seq_len
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("find_micro_batch: the model has no parameters that require grad")
        device = self.device = self.params[0].device
        self.counted = device.type in ("cpu", "mps")  # no allocator peak to read there
        self.constants = quantization_constants(model)  # a 4- or 8-bit base's
        held = (*model.parameters(), *model.buffers(), *self.constants)
        self.exclude = {storage_key(t) for t in held}
        self.block = first_block(model)
        self._grads: dict[tuple[str, int], int] = {}
        # Before the Accumulator's own hooks, which free 16-bit gradients into fp32 buffers.
        self._handles = [p.register_post_accumulate_grad_hook(self._record) for p in self.params]
        self.optimizer = make_optimizer(model)
        self.acc = Accumulator(model, self.optimizer, precision=precision)

    def _record(self, p: torch.Tensor) -> None:
        if p.grad is not None:
            self._grads[storage_key(p.grad)] = p.grad.untyped_storage().nbytes()

    def close(self) -> None:
        """Remove the hooks and free the probe's gradients and optimizer state."""
        for h in self._handles:
            h.remove()
        self.acc.close()
        self.optimizer.zero_grad(set_to_none=True)
        self.optimizer.state.clear()

    def step(self, micro_batch: int, counter: SavedTensorCounter | None = None) -> float:
        """One training step (one window of one micro-batch); its seconds."""
        batch = self.make_batch(micro_batch)
        loss_fn = self.loss_fn
        if counter is not None:

            def loss_fn(model, batch, inner=self.loss_fn):
                try:
                    with counter.hooks():
                        return inner(model, batch)
                finally:
                    counter.close()

        devices.synchronize(self.device)
        start = time.perf_counter()
        self.acc.step([batch], loss_fn)
        devices.synchronize(self.device)
        return time.perf_counter() - start

    def _state(self) -> dict:
        low = sum(4 * p.numel() for p in self.params if p.dtype in (torch.bfloat16, torch.float16))
        return {
            "params": storage_bytes([*self.model.parameters(), *self.constants]),
            "grads": sum(self._grads.values()) + low,  # + the engine's fp32 buffers
            "buffers": storage_bytes(self.model.buffers()),
            "optimizer": storage_bytes(optimizer_tensors(self.optimizer)),
        }

    def measure(self, micro_batch: int) -> MemoryUse:
        """Run one step at `micro_batch` and measure its memory (see the module docstring)."""
        self._grads.clear()
        if not self.counted:
            if not self.optimizer.state:  # the optimizer state of a steady step, held before
                self.step(micro_batch)
            devices.reset_peak_memory(self.device)
            self.step(micro_batch)
            state = self._state()
            peak = devices.peak_memory_bytes(self.device)
            rest = max(0, peak - sum(state.values()))
            return MemoryUse(**state, activations=rest, peak=peak, source="allocator peak")
        counter = SavedTensorCounter(self.exclude)
        watch = self.block is not None and checkpointing_enabled(self.model)
        handles = counter.watch(self.block) if watch else []
        try:
            self.step(micro_batch, counter)
        finally:
            for h in handles:
                h.remove()
        state = self._state()
        total = sum(state.values()) + counter.total
        return MemoryUse(**state, activations=counter.total, peak=total, source="saved tensors")

    def recover(self) -> None:
        """After an out-of-memory error: nothing of the failed step may stay allocated."""
        self.acc.abandon_window()  # the engine's seam: partial gradients dropped, nothing counted
        self.optimizer.zero_grad(set_to_none=True)
        self.acc.scaler = LossScaler(enabled=self.precision == "fp16")
        gc.collect()
        devices.empty_cache(self.device)

    def probe(self, micro_batch: int, checkpointing: bool) -> Candidate:
        """Measure one size; every rank agrees whether it fits (one MAX all-reduce)."""
        set_checkpointing(self.model, checkpointing)
        use, failed = None, False
        try:
            use = self.measure(micro_batch)
        except devices.out_of_memory_errors():
            failed = True  # recover outside the handler: its traceback holds the step's tensors
        if failed:
            use = None
            self.recover()
        over = use is not None and self.budget is not None and use.peak > self.budget
        verdict = collectives.max_over_ranks(2 if failed else int(over))
        why = {0: "", 1: "over budget", 2: "out of memory"}[verdict]
        return Candidate(micro_batch, checkpointing, verdict == 0, why, use)

    def time(self, cand: Candidate) -> None:
        """Time a candidate that fit: one warm-up step, then about TIMED_SECONDS of steps."""
        set_checkpointing(self.model, cand.checkpointing)
        times, failed = [], False
        try:
            first = self.step(cand.micro_batch)
            n = min(MAX_TIMED_STEPS, max(MIN_TIMED_STEPS, math.ceil(TIMED_SECONDS / first)))
            n = collectives.max_over_ranks(n)  # ranks step together under DDP
            times = [self.step(cand.micro_batch) for _ in range(n)]
        except devices.out_of_memory_errors():
            failed = True
        if failed:
            self.recover()
        if collectives.max_over_ranks(int(failed)):
            cand.fits, cand.why = False, "out of memory"
            return
        # Other work on the machine only ever adds time: the fastest step is the measure.
        fastest, median = min(times), statistics.median(times)
        cand.tokens_per_s = cand.micro_batch * self.seq_len / fastest
        cand.noise = max(NOISE_FLOOR, (median - fastest) / median)


# ---- the search ----------------------------------------------------------------------------


def _nothing_fits(candidates: list[Candidate], budget: int | None, seq_len: int, device):
    ones = [c for c in candidates if c.micro_batch == 1 and c.memory is not None]
    one = min(ones, key=lambda c: c.memory.peak, default=None)
    what = f"micro-batch 1 ({fmt_int(seq_len)} tokens)"
    if one is None:
        flag, value = "--device", str(device)
        why = f"{what} runs out of device memory"
        needs = None
    else:
        flag, value = ("--memory-budget", fmt_bytes(budget)) if budget else ("--device", device)
        needs = one.memory.peak
        why = (
            f"nothing fits: {what} needs {fmt_bytes(needs)}, of which parameters, gradients "
            f"and optimizer state {fmt_bytes(one.memory.state)}"
        )
    return NothingFits(flag, value, why, needs)


def _agree_size(micro_batch: int, checkpointing: bool) -> tuple[int, bool]:
    """One size on every rank: the smallest micro-batch, checkpointing if any rank has it."""
    micro = -collectives.max_over_ranks(-micro_batch)
    return micro, bool(collectives.max_over_ranks(int(checkpointing)))


def _agreed(chosen: Candidate, candidates: list[Candidate]) -> Candidate:
    """The same choice on every rank: the smallest micro-batch, checkpointing if any rank."""
    micro, checkpointing = _agree_size(chosen.micro_batch, chosen.checkpointing)
    same = [c for c in candidates if (c.micro_batch, c.checkpointing) == (micro, checkpointing)]
    return same[0] if same else Candidate(micro, checkpointing, True)


@contextmanager
def _restored(model: torch.nn.Module, prober: _Prober):
    """Probe steps update the weights: put them, the mode and checkpointing back after."""
    saved, training = _snapshot(model), model.training
    was_checkpointing = checkpointing_enabled(model)
    model.train()
    try:
        yield
    finally:
        prober.close()
        _put_back(saved)
        set_checkpointing(model, was_checkpointing)
        model.train(training)
        gc.collect()
        devices.empty_cache(prober.device)


def find_micro_batch(
    model: torch.nn.Module,
    make_batch: Callable[[int], object],
    loss_fn: Callable,
    *,
    seq_len: int,
    tokens_per_step: int,
    world_size: int = 1,
    precision: str = "fp32",
    memory_budget: int | None = None,
    max_micro_batch: int | None = None,
    try_checkpointing: bool = True,
    max_seconds: float | None = None,
    make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer] | None = None,
    batch_tolerance: float = BATCH_TOLERANCE,
    time_candidate: Callable[[Candidate], None] | None = None,
) -> FitResult:
    """Measure which micro-batch fits and runs fastest; k keeps `tokens_per_step`.

    model: on its device, plain or DDP-wrapped; its weights, mode and checkpointing setting are
      restored afterwards (the probe steps update a copy's worth of state, then put it back).
    make_batch(b): a micro-batch of b sequences of seq_len tokens, on the model's device.
    loss_fn(model, batch) -> (loss summed over valid tokens, their count), as the engine takes.
    tokens_per_step: the target over all ranks; micro-batches above target / (seq_len x world)
      are not tried (k would drop below 1). max_micro_batch bounds them further.
    memory_budget: bytes; a size whose measured peak is above it counts as out of memory.
    max_seconds: ends the search and the timing early (the best found so far is kept).
    make_optimizer(model): the optimizer whose state is measured; AdamW by default.
    batch_tolerance: how far (a fraction) the global batch may land from the target when a
      size that does is faster (`fit_search.choose`).
    time_candidate(c): sets c.tokens_per_s and c.noise; None times real training steps (a
      test passes a function of the size, so that what it checks does not depend on timing).
    Raises BadInput when the target is below one sequence per rank, NothingFits (a BadInput)
    when micro-batch 1 does not fit.
    """
    cap = tokens_per_step // (seq_len * world_size)
    if cap < 1:
        raise BadInput(
            "--tokens-per-step",
            fmt_int(tokens_per_step),
            f"below one sequence of --seq-len {seq_len} on each of {world_size} rank(s)",
        )
    cap = min(cap, max_micro_batch or cap)
    deadline = None if max_seconds is None else time.perf_counter() + max_seconds

    def stop() -> bool:
        late = deadline is not None and time.perf_counter() > deadline
        return bool(collectives.max_over_ranks(int(late)))

    prober = _Prober(
        model, make_batch, loss_fn, precision, make_optimizer or _default_optimizer,
        memory_budget, seq_len,
    )  # fmt: skip
    target = Target(tokens_per_step, seq_len * world_size)
    with _restored(model, prober):
        checkpointing = try_checkpointing and set_checkpointing(model, False)
        timer = time_candidate or prober.time
        candidates = search(prober.probe, timer, target, cap, checkpointing, stop, _agree_size)
    chosen = choose(candidates, target, batch_tolerance)
    if chosen is None:
        raise _nothing_fits(candidates, memory_budget, seq_len, _device_of(model))
    chosen = _agreed(chosen, candidates)
    k = target.accum_steps(chosen.micro_batch)
    return FitResult(
        micro_batch=chosen.micro_batch,
        accum_steps=k,
        checkpointing=chosen.checkpointing,
        tokens_per_s=chosen.tokens_per_s,
        memory=chosen.memory,
        seq_len=seq_len,
        world_size=world_size,
        target_tokens=tokens_per_step,
        budget_bytes=memory_budget,
        candidates=candidates,
        batch_tolerance=batch_tolerance,
    )


def _device_of(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def measure_step(
    model: torch.nn.Module,
    make_batch: Callable[[int], object],
    loss_fn: Callable,
    micro_batch: int,
    *,
    precision: str = "fp32",
    checkpointing: bool = False,
    make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer] | None = None,
) -> MemoryUse:
    """The memory of one training step at `micro_batch`, measured as the search measures it
    (see the module docstring); the model's weights and settings are restored afterwards.
    Raises the device's out-of-memory error when it does not fit."""
    prober = _Prober(
        model, make_batch, loss_fn, precision, make_optimizer or _default_optimizer, None, 0
    )
    with _restored(model, prober):
        if checkpointing and not set_checkpointing(model, True):
            raise ValueError("measure_step: the model cannot turn on activation checkpointing")
        return prober.measure(micro_batch)
