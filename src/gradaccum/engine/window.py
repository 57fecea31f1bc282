"""One window in progress: its micro-steps, their backward scale, and its one optimizer step.

`Accumulator.step` and `Accumulator.begin_window` make a `Window`. `Window.run` is the
engine's one window loop (every micro-step, then `finish`), which `Accumulator.step`,
`moe.balance.Balance.step` and the trainer call. Besides the numerical
rules (docs/design.md, "Numerical rules"), a window keeps the engine's rules of use
(docs/design.md, "Engine rules"), all checked at micro-step entry or at `finish`:
- it runs exactly the micro-steps it was begun with, one backward in each: a micro-step past
  the count is refused before its forward, a `finish` short of it is refused, and either way
  the window is dropped with nothing stepped (under DDP the sync rides on the declared last
  micro-step, so any other count would be silently wrong);
- it is used once: after `finish()` or `abandon()` every call refuses;
- a micro-step that raises drops the window (its partial gradients are not the window's);
- `loss_fn` (or `backward`) gets one-line errors naming what it returned when it breaks the
  contract (`loss_contract`): (loss summed over valid tokens, a tensor with its graph; their
  count).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from gradaccum.engine.grad_norm import by_kind, total_norm
from gradaccum.engine.loss_contract import checked_loss
from gradaccum.engine.scale import backward_scale
from gradaccum.engine.step_result import StepResult
from gradaccum.parallel import collectives, devices

if TYPE_CHECKING:
    from gradaccum.engine.grad_store import GradStore
    from gradaccum.engine.noise import NoiseScale
    from gradaccum.engine.precision import LossScaler
    from gradaccum.parallel.backends import Backend

__all__ = ["StepResult", "Window", "WindowOwner", "backward_scale", "repeated_batch"]

OPEN, FINISHED, ABANDONED = "open", "finished", "abandoned"

_DECLARE = (
    "begin_window(n) must be told the micro-steps you run, each with one backward; under "
    "torchrun run w.micro_steps of them on every rank, repeating a batch with weight=0 on a "
    "rank that has fewer"
)


class WindowOwner(Protocol):
    """What a window reads of the engine that begins it (`Accumulator`), and the two calls by
    which it hands its end back."""

    optimizer: torch.optim.Optimizer
    scheduler: object | None
    max_grad_norm: float | None
    normalize: str
    """"tokens" or "micro_batch_mean"."""
    sync: str
    """The sync policy: "window", "micro" or "hsdp"."""
    autocast_dtype: torch.dtype | None
    device: torch.device
    scaler: LossScaler
    dp: Backend
    store: GradStore
    noise: NoiseScale | None
    steps: int
    """Optimizer steps taken."""
    skipped_total: int
    """Windows finished without a step."""

    def window_finished(self, window: Window, stepped: bool, tokens: int) -> None:
        """The window's step taken (`stepped`) or skipped, its N `tokens`."""

    def window_dropped(self, window: Window) -> None:
        """The window dropped: its partial gradients cleared, nothing counted."""


def repeated_batch(micro_batches: Sequence, stand_in=None):
    """The batch a rank with fewer micro-batches than another (under torchrun a window runs
    the most any rank has) runs again with weight 0, so that every rank joins the same
    collectives: its last of this window, or with none `stand_in` (the last batch of its
    previous window, or the trainer's stand-in); None when neither exists."""
    return micro_batches[len(micro_batches) - 1] if len(micro_batches) else stand_in


def _lr_of(optimizer: torch.optim.Optimizer) -> float | None:
    """The first parameter group's lr. An optimizer may have none (a torch.optim.Optimizer
    subclass that sets its own step size): None, not a KeyError."""
    lr = optimizer.param_groups[0].get("lr")
    return None if lr is None else float(lr)


@dataclass
class _Measured:
    """A window's figures after its one host sync; gradient figures are unscaled."""

    loss: float
    grad_norm: float
    tokens: float
    unscale: float  # what the summed gradient must be multiplied by (late N, loss scale)
    lr: float | None
    loss_scale: float | None
    noise_sums: list[float] = field(default_factory=list)  # sum_i n_i |g_i|^2, n, sequences
    aux: float | None = None  # the aux terms summed over the window; None when none given

    @property
    def finite(self) -> bool:
        return math.isfinite(self.loss) and math.isfinite(self.grad_norm)

    @property
    def ok(self) -> bool:
        return self.finite and self.tokens > 0


class Window:
    """One window in progress: see `Accumulator.begin_window`. Used once.

    tokens: N over all ranks when counted up front, else None. capacity: the label elements
    of the window over all ranks when readable (N is at most that); floor: the least estimate
    of N when neither is known (the previous window's tokens per micro-step, times k).
    extra_sums: the counts given to `begin_window(extra_sums=)`, summed over ranks.
    sequences: this rank's sequences (rows) in the window, for the noise scale.
    """

    def __init__(
        self,
        acc: WindowOwner,
        micro_steps: int,
        tokens: int | None,
        capacity: int | None = None,
        floor: float = 0.0,
        extra_sums: torch.Tensor | None = None,
        sequences: int = 0,
    ):
        self.acc = acc
        self.micro_steps = micro_steps
        self.tokens = tokens
        self.state = OPEN
        """"open", then "finished" or "abandoned": a closed window refuses every call."""
        self._index = 0  # micro-steps completed
        self._backwards = 0  # backward passes run
        self._in_micro = False
        self._ran_backward = False  # in the micro-step in flight
        self._world = acc.dp.world
        self._floor = max(floor, float(micro_steps))
        self._scale = self._first_scale(tokens, capacity)
        # Running sums (on the device, no host sync): nothing per micro-batch outlives it.
        self._loss_sum = torch.zeros((), dtype=torch.float64, device=acc.device)
        self._tokens_seen = torch.zeros((), dtype=torch.float64, device=acc.device)
        self._aux_sum = torch.zeros((), dtype=torch.float64, device=acc.device)
        self._aux_given = 0  # micro-steps that passed an aux term (host-side count)
        self.extra_sums = extra_sums
        """The int64 counts given to `begin_window(extra_sums=)`, summed over ranks (this
        rank's own with one process); None when none were given."""
        self._traffic_start = acc.store.traffic()
        self.sequences = sequences
        """This rank's sequences (rows) in the window, for the noise scale in sequences."""
        devices.reset_peak_memory(acc.device)

    @property
    def micro_steps_run(self) -> int:
        """Micro-steps completed so far."""
        return self._index

    def _first_scale(self, tokens: int | None, capacity: int | None) -> float | None:
        # The backward scale, once per window. Without a count of N, the window's label
        # elements bound it from above, so no backward carries more than the loss scale
        # (fp16 does not overflow for want of N); `finish` corrects to the exact N. With
        # neither, the scale waits for the first micro-batch (`_estimated_scale`).
        acc = self.acc
        if tokens is not None or acc.normalize != "tokens":
            return self._scale_for(tokens or 0, acc.scaler.scale)
        if capacity is not None:
            return self._scale_for(capacity, acc.scaler.scale)
        return None

    def _scale_for(self, tokens: float, loss_scale: float) -> float:
        acc = self.acc
        return backward_scale(
            acc.normalize,
            tokens,
            self.micro_steps,
            self._world,
            acc.dp.averages_over_ranks and not acc.store.manual_sync,
            loss_scale,
        )

    # ---- the micro-steps -----------------------------------------------------------------

    def run(
        self,
        micro_batches: Sequence,
        forward_backward: Callable[[object, float], object],
        stand_in=None,
        before_micro_step: Callable[[int], object] | None = None,
    ) -> StepResult | object:
        """Every micro-step of the window, then `finish()`: the engine's one window loop.

        Micro-step i calls `forward_backward(batch, weight)` inside `with self.micro_step():`:
        the batch's forward and one `backward` with that weight. The batch is micro-batch
        i with weight 1 or, past this rank's own micro-batches, `repeated_batch(micro_batches,
        stand_in)` with weight 0. `before_micro_step(i)`, when given, is asked before
        micro-step i: None goes on; any other answer ends the window there, abandoned, and
        `run` returns that answer instead of a StepResult (the trainer's stop and
        out-of-memory agreement between ranks). Anything that raises abandons the window.
        """
        repeat = repeated_batch(micro_batches, stand_in)
        try:
            for i in range(self.micro_steps):
                answer = None if before_micro_step is None else before_micro_step(i)
                if answer is not None:
                    self.abandon()
                    return answer
                real = i < len(micro_batches)
                with self.micro_step():  # nothing of this micro-batch outlives it
                    forward_backward(micro_batches[i] if real else repeat, 1.0 if real else 0.0)
            return self.finish()
        except BaseException:
            self._drop()  # nothing to do when the micro-step or finish() dropped it already
            raise

    @contextmanager
    def micro_step(self):
        """Context for one micro-batch's forward and backward: autocast, and the gradient sync
        of the Accumulator's policy (`sync="window"`: none except on the window's last
        micro-batch; `Backend.micro_step_sync`). Refused past the window's micro-steps
        (before the forward); a body that raises drops the window."""
        self._require_open("micro_step()")
        if self._index >= self.micro_steps:
            self._refuse(
                f"micro_step() {self._index + 1} of a window begun with {self.micro_steps} "
                "micro-steps"
            )
        acc = self.acc
        last = self._index == self.micro_steps - 1
        if acc.store.manual_sync:  # the store all-reduces its fp32 buffer itself
            sync = acc.dp.no_backward_sync()
        else:
            sync = acc.dp.micro_step_sync(acc.sync, last)
        self._in_micro, self._ran_backward = True, False
        try:
            with ExitStack() as stack:
                stack.enter_context(sync)
                stack.enter_context(devices.autocast(acc.device, acc.autocast_dtype))
                yield
        except BaseException:
            self._in_micro = False
            self._drop()
            raise
        self._in_micro = False
        self._index += 1

    def backward(
        self,
        loss_sum: torch.Tensor,
        num_tokens,
        weight: float = 1.0,
        aux: torch.Tensor | None = None,
    ) -> None:
        """Backward of one micro-batch's summed loss, scaled so that the window adds up to the
        token mean (or the micro-batch mean, if the Accumulator was built that way). Once per
        micro-step, inside it. Weight 0 marks a repeated batch that only joins the
        collectives.

        aux: a 0-d tensor (with its graph) already normalized for the window, so that the
        window's terms summed over micro-batches and ranks are the objective's auxiliary term
        (the MoE load-balancing loss, `gradaccum.moe.balance`). It is added to the loss's
        backward undivided by N: times `world` where the wrapper averages over ranks and
        times the fp16 loss scale (`backward_scale` with tokens=1). Weight 0 drops it too.
        Refused when normalize="tokens" and N was not counted up front (the end-of-window
        correction to N would rescale it). Reported summed in `StepResult.aux_loss`."""
        self.run_backward(loss_sum, num_tokens, weight, "Window.backward got", aux)

    def run_backward(
        self, loss_sum, num_tokens, weight: float, source: str, aux: torch.Tensor | None = None
    ) -> None:
        """`backward`, its errors naming `source` ("loss_fn returned" from `Accumulator.step`)."""
        if not self._in_micro:
            self._require_open("backward()")
            raise RuntimeError(
                "Window.backward outside `with window.micro_step():` (the micro-step sets "
                "autocast and the gradient sync)"
            )
        if self._ran_backward:
            raise RuntimeError(
                f"Window.backward twice in micro-step {self._index + 1}: add the micro-batch's "
                "losses and call it once"
            )
        acc = self.acc
        loss = checked_loss(loss_sum, num_tokens, source)
        if aux is not None:
            self._check_aux(aux, source)
        if acc.normalize == "micro_batch_mean":
            loss = loss / torch.as_tensor(num_tokens, device=loss.device).clamp(min=1)
        if self._scale is None:
            self._scale = self._estimated_scale(num_tokens if weight else 0)
        if weight:
            self._loss_sum.add_(loss.detach())
            self._tokens_seen.add_(num_tokens)
        scaled = loss * (self._scale if weight else 0.0)
        if aux is not None:
            self._aux_given += 1
            if weight:
                self._aux_sum.add_(aux.detach().reshape(()).to(self._aux_sum))
            if aux.requires_grad:  # weight 0 keeps its graph too: the same parameters used
                scaled = scaled + aux.reshape(()) * (self._aux_scale() if weight else 0.0)
        if acc.autocast_dtype is None:
            scaled.backward()
        else:
            with torch.autocast(acc.device.type, enabled=False):
                scaled.backward()
        self._ran_backward = True
        self._backwards += 1
        if acc.noise is not None:  # its hooks saw this backward's gradients, scaled
            acc.noise.end_micro(self._scale if weight else 0.0, num_tokens)

    def _check_aux(self, aux, source: str) -> None:
        """The aux term's contract: a one-element tensor, N known up front (tokens mode)."""
        if not isinstance(aux, torch.Tensor) or aux.numel() != 1:
            is_tensor = isinstance(aux, torch.Tensor)
            what = f"shape {tuple(aux.shape)}" if is_tensor else type(aux).__name__
            raise ValueError(f"{source} aux of {what}: expected a 0-d tensor")
        if self.acc.normalize == "tokens" and self.tokens is None:
            raise ValueError(
                f"{source} an aux term in a window whose N is not known up front (the "
                "correction to N at its end would rescale the aux term too): count the tokens "
                "before the window (Accumulator(count_tokens=...) or begin_window(tokens=...))"
            )

    def _aux_scale(self) -> float:
        """An aux term's backward scale: the loss's without the division by N."""
        acc = self.acc
        averages = acc.dp.averages_over_ranks and not acc.store.manual_sync
        return backward_scale(
            "tokens", 1, self.micro_steps, self._world, averages, acc.scaler.scale
        )

    def _estimated_scale(self, first_tokens) -> float:
        # Neither N nor the label elements are known: estimate N as the first micro-batch's
        # tokens (summed over ranks, so that every rank scales alike) times the micro-steps,
        # never below the floor (the previous window's rate, at least 1 token per micro-step).
        # One host sync, and under data parallelism one 8-byte all-reduce; `finish` corrects.
        first = torch.as_tensor(first_tokens, dtype=torch.float64, device=self.acc.device)
        if self.acc.dp.averages_over_ranks:
            first = collectives.all_reduce_sum(first.reshape(1), self.acc.dp.group)
        estimate = max(float(first.sum()) * self.micro_steps, self._floor)
        return self._scale_for(estimate, self.acc.scaler.scale)

    # ---- closing -------------------------------------------------------------------------

    def finish(self) -> StepResult:
        """Reduce -> measure (the window's one host sync) -> step or skip -> result. Refused,
        the window dropped and nothing stepped, unless every micro-step it was begun with ran
        with one backward."""
        self._require_open("finish()")
        if self._in_micro:
            self._refuse("finish() inside a micro-step")
        if self._index < self.micro_steps:
            self._refuse(
                f"finish() after {self._index} of the {self.micro_steps} micro-steps the "
                "window was begun with"
            )
        if self._backwards < self.micro_steps:
            self._refuse(
                f"finish() after {self.micro_steps} micro-steps, {self._backwards} of which "
                "ran a backward"
            )
        self.state = FINISHED  # from here on a second finish() is refused
        try:
            return self._finish()
        except BaseException:
            self.state = ABANDONED
            self.acc.window_dropped(self)
            raise

    def abandon(self) -> None:
        """Drop this window: partial gradients cleared, nothing stepped or counted, the loss
        scale untouched (for out-of-memory recovery; then run the window again, smaller).
        Harmless on a window already abandoned; refused on one finished."""
        if self.state == FINISHED:
            raise RuntimeError("abandon() on a window already finished: its step is taken")
        self._drop()

    def _drop(self) -> None:
        if self.state == OPEN:
            self.state = ABANDONED
            self.acc.window_dropped(self)

    def _refuse(self, what: str):
        self._drop()
        raise RuntimeError(f"{what}: the window is dropped and nothing stepped ({_DECLARE})")

    def _require_open(self, call: str) -> None:
        if self.state != OPEN:
            raise RuntimeError(
                f"{call} on a window already {self.state}: begin another (acc.begin_window or "
                "acc.step)"
            )

    # ---- the window's one step -----------------------------------------------------------

    def _finish(self) -> StepResult:
        acc = self.acc
        acc.store.reduce()
        grads = acc.store.gradients()
        measured = self._measure(grads)
        if measured.ok:
            self._step(grads, measured)
            if acc.noise is not None:  # S_big: the window's gradient, unscaled, unclipped
                weighted, micro_batches, sequences = measured.noise_sums
                s_big = measured.grad_norm**2
                acc.noise.update((weighted, micro_batches), s_big, measured.tokens, sequences)
        acc.scaler.update(found_inf=not measured.finite)
        acc.store.clear()
        acc.window_finished(self, stepped=measured.ok, tokens=int(round(measured.tokens)))
        return self._result(measured)

    def _measure(self, grads: list[torch.Tensor]) -> _Measured:
        acc = self.acc
        given = torch.full_like(self._aux_sum, float(self._aux_given))
        sums = torch.stack([self._loss_sum, self._tokens_seen, self._aux_sum, given])
        if acc.noise is not None:  # they travel in the window's one small all-reduce
            rows = torch.tensor([float(self.sequences)], dtype=sums.dtype, device=sums.device)
            sums = torch.cat([sums, acc.noise.local_sums().to(sums.device), rows])
        if acc.dp.averages_over_ranks:
            sums = collectives.all_reduce_sum(sums, acc.dp.group)
        loss_total, seen, aux_sums = sums[0], sums[1], sums[2:4]
        n_tokens = seen if self.tokens is None else torch.full_like(seen, self.tokens)
        if acc.normalize == "tokens":
            loss = loss_total / n_tokens.clamp(min=1)
        else:
            loss = loss_total / (self.micro_steps * self._world)
        norm = total_norm(grads, acc.device).double().to(loss.device)
        head = torch.stack([loss, norm, n_tokens, seen])
        figures = torch.cat([head, aux_sums, sums[4:]]).tolist()
        loss_f, norm_f, tokens_f, seen_f, aux_f, aux_given = figures[:6]
        if acc.normalize == "tokens" and self.micro_steps and round(seen_f) != round(tokens_f):
            raise ValueError(
                f"loss_fn reported {round(seen_f)} valid tokens over the window, but its "
                f"micro-batches hold {round(tokens_f)} by count_tokens (labels != ignore_index "
                "of batch['labels'], or of batch[1] for tuples): both must count the tokens the "
                "loss sums over (if loss_fn shifts labels itself, pass a count_tokens that "
                "shifts them too); the window is dropped and nothing stepped"
            )
        # The gradient was summed under self._scale; the window's own is that of N, unscaled.
        unscale = self._scale_for(tokens_f, 1.0) / self._scale if self._scale else 1.0
        loss_scale = acc.scaler.scale if acc.scaler.enabled else None
        lr = _lr_of(acc.optimizer)
        measured = _Measured(loss_f, norm_f * unscale, tokens_f, unscale, lr, loss_scale)
        measured.noise_sums = figures[6:]
        measured.aux = aux_f if aux_given else None
        return measured

    def _step(self, grads: list[torch.Tensor], measured: _Measured) -> None:
        """Unscale and clip in one pass, step the optimizer and the scheduler once (a
        ReduceLROnPlateau is given the window's loss)."""
        acc = self.acc
        coef = measured.unscale
        if acc.max_grad_norm is not None:
            coef *= min(1.0, acc.max_grad_norm / (measured.grad_norm + 1e-6))
        if coef != 1.0:
            for same_kind in by_kind(grads):
                torch._foreach_mul_(same_kind, coef)
        acc.store.step(acc.optimizer.step)
        if isinstance(acc.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            acc.scheduler.step(measured.loss)
        elif acc.scheduler is not None:
            acc.scheduler.step()

    def _result(self, measured: _Measured) -> StepResult:
        collectives, nbytes, replica_collectives, replica_bytes = self.acc.store.window_traffic(
            self._traffic_start
        )
        return StepResult(
            loss=measured.loss,
            tokens=int(round(measured.tokens)),
            micro_steps=self.micro_steps,
            grad_norm=measured.grad_norm if measured.ok else math.nan,
            skipped=not measured.ok,
            lr=measured.lr,
            step=self.acc.steps,
            skipped_total=self.acc.skipped_total,
            loss_scale=measured.loss_scale,
            peak_memory_bytes=devices.peak_memory_bytes(self.acc.device),
            grad_collectives=collectives,
            grad_bytes=nbytes,
            grad_replica_collectives=replica_collectives,
            grad_replica_bytes=replica_bytes,
            noise=None if self.acc.noise is None else self.acc.noise.last,
            aux_loss=measured.aux,
        )
