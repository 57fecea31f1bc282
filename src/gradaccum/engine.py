"""The accumulation engine: one window of micro-batches, at most one optimizer step.

The rules it keeps (docs/design.md, "Numerical rules"):
- the window's loss is the sum over every valid token divided by N, the valid tokens of the
  whole window summed over the data-parallel ranks; each micro-batch's backward uses
  `loss_sum * world / N` (DDP and FSDP2 average over ranks, the factor `world` undoes that):
  `backward_scale`, computed once per window;
- clip, optimizer step, scheduler step and zero_grad run once per window;
- low-precision parameters add each gradient into an fp32 buffer as it is produced
  (`grads.GradStore`);
- a non-finite loss or gradient anywhere in the window skips the whole window;
- nothing per micro-batch outlives its micro-step: host memory does not grow with k.

Seams for tools built on the engine: `Accumulator.add_micro_grad_hook` (each micro-batch's
own gradient), `Window.abandon` / `Accumulator.abandon_window` (drop a window, e.g. after
running out of memory), and k free to change from one window to the next.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

import torch

from . import devices, sync
from .grads import GradStore
from .noise import NoiseEstimate, NoiseScale
from .precision import PRECISIONS, LossScaler, autocast_dtype, is_low_precision

NORMALIZE = ("tokens", "micro_batch_mean")

LossFn = Callable[[torch.nn.Module, object], tuple[torch.Tensor, "int | torch.Tensor"]]


@dataclass
class StepResult:
    """What one window did. Losses are per token; counts are summed over ranks."""

    loss: float
    """Mean loss per valid token over the window (all micro-batches, all ranks)."""
    tokens: int
    """Valid tokens in the window over all ranks (N)."""
    micro_steps: int
    """Forward/backward passes this rank ran (equal on every rank)."""
    grad_norm: float
    """L2 norm of the window's gradient before clipping; nan when skipped."""
    skipped: bool
    """True when the optimizer did not step (non-finite loss or gradient, or no tokens)."""
    lr: float
    """Learning rate of the first parameter group for this step."""
    step: int
    """Optimizer steps taken so far, this one included."""
    skipped_total: int
    """Windows skipped so far."""
    loss_scale: float | None = None
    """fp16 loss scale used in this window; None in fp32/bf16."""
    peak_memory_bytes: int | None = None
    """Peak device memory since the window began; None where the device does not track it."""
    grad_collectives: int = 0
    """Gradient collectives launched in the window on this rank: DDP bucket all-reduces,
    FSDP2 reduce-scatters, or the engine's own all-reduce of its fp32 buffer (bf16/fp16
    parameters under DDP). 0 on one device; -1 when they could not be counted (a DDP model
    that already had a communication hook: see `sync.count_grad_traffic`)."""
    grad_bytes: int = 0
    """Bytes of gradient this rank handed to those collectives (-1 when not counted)."""
    noise: NoiseEstimate | None = None
    """The gradient noise scale after this window (`Accumulator(noise_scale=True)`); None
    when off, or before the first window of at least 2 micro-batches over all ranks."""


def count_labels(ignore_index: int = -100, key: str = "labels") -> Callable[[object], torch.Tensor]:
    """A `count_tokens` callable: valid labels in a dict batch (`batch[key]`) or `batch[1]`."""

    def count(batch) -> torch.Tensor:
        labels = batch[key] if isinstance(batch, Mapping) else batch[1]
        return (labels != ignore_index).sum()

    return count


def _auto_count(ignore_index: int) -> Callable[[object], torch.Tensor | None]:
    by_labels = count_labels(ignore_index)

    def count(batch):
        if isinstance(batch, Mapping) and "labels" in batch:
            return by_labels(batch)
        return None

    return count


def windows(iterable: Iterable, accum_steps: int, drop_last: bool = False) -> Iterator[list]:
    """Group micro-batches into windows of `accum_steps`; the short last one is kept unless
    `drop_last`. The engine weighs a short window by its own token count."""
    if isinstance(accum_steps, bool) or not isinstance(accum_steps, int) or accum_steps < 1:
        raise ValueError(f"accum_steps {accum_steps!r}: must be a whole number, at least 1")
    window: list = []
    for batch in iterable:
        window.append(batch)
        if len(window) == accum_steps:
            yield window
            window = []
    if window and not drop_last:
        yield window


def backward_scale(
    normalize: str,
    tokens: float,
    micro_steps: int,
    world: int,
    wrapper_averages: bool,
    loss_scale: float = 1.0,
) -> float:
    """What each micro-batch's backward multiplies its loss by, for one window.

    normalize "tokens": the loss is the micro-batch's summed token loss and `tokens` is N, the
      window's valid tokens over all ranks: scale = world / N (docs/design.md, numerical rules).
    normalize "micro_batch_mean": the loss is the micro-batch's own mean, and the window's
      gradient is the mean over its `micro_steps` x `world` micro-batches.
    world: ranks in the data-parallel group. wrapper_averages: whether the sync divides the
      summed gradient by `world` (DDP, FSDP2), which the factor `world` undoes; the engine's
      own all-reduce (bf16/fp16 parameters under DDP) sums, so it needs none.
    loss_scale: the fp16 loss scale (1 otherwise); unscaled once at the window's end.
    """
    undo_average = world if wrapper_averages else 1
    if normalize == "tokens":
        return undo_average * loss_scale / max(tokens, 1)
    return undo_average * loss_scale / max(micro_steps * world, 1)


class Accumulator:
    """Runs windows of micro-batches and one optimizer step per window.

    model: a plain module, or one wrapped in DistributedDataParallel or sharded with FSDP2,
      either of them possibly inside torch.compile (their gradient collectives get counted:
      `sync.count_grad_traffic`, which also says how to keep a DDP communication hook of
      your own).
    count_tokens: "auto" counts `labels != ignore_index` in dict batches before the first
      backward; a callable(batch) -> int does it for other batches; None (or a batch "auto"
      cannot read) scales by an estimate of N from the first micro-batch and corrects the
      summed gradient once at the window's end.
    accum_dtype: dtype of the accumulation buffer for bf16/fp16 parameters (fp32; bf16 only
      to study the error it causes).
    master_weights: for bf16/fp16 parameters, keep fp32 copies that the optimizer updates (the
      optimizer is re-pointed at them, so it must not have state yet).
    sync_every_micro_batch: reduce gradients after every micro-batch (FSDP2: keeps gradients
      sharded, k times the traffic); default is one sync per window.
    noise_scale: estimate the gradient noise scale (the critical batch size) from each
      micro-batch's own gradient as backward produces it (`gradaccum.noise`): one squared
      norm per parameter and micro-batch, reported in `StepResult.noise`. Needs the token
      mean and per-micro-batch gradients: one device or DDP, not FSDP2. `noise_decay` is
      the decay of its moving averages, per window.
    group: the data-parallel process group; by default DDP's `process_group` or FSDP2's mesh.
      N, the world factor and every collective of the engine use it.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler=None,
        max_grad_norm: float | None = None,
        precision: str = "fp32",
        accum_dtype: torch.dtype = torch.float32,
        master_weights: bool = False,
        normalize: str = "tokens",
        count_tokens: Callable | str | None = "auto",
        ignore_index: int = -100,
        sync_every_micro_batch: bool = False,
        loss_scaler: LossScaler | None = None,
        group=None,
        noise_scale: bool = False,
        noise_decay: float = 0.99,
    ):
        _check_arguments(precision, normalize, max_grad_norm, accum_dtype)
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.max_grad_norm = max_grad_norm
        self.precision = precision
        self.normalize = normalize
        self.sync_every_micro_batch = sync_every_micro_batch
        self.count_tokens = _auto_count(ignore_index) if count_tokens == "auto" else count_tokens
        self.scaler = loss_scaler or LossScaler(enabled=precision == "fp16")
        self.autocast_dtype = autocast_dtype(precision)
        self.steps = 0
        self.skipped_total = 0
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ValueError("model has no parameters that require grad")
        self.device = params[0].device
        self.dp = sync.data_parallel(model, group)
        """The model's wrapper, data-parallel group and its size (`sync.DataParallel`)."""
        _refuse_low_precision_sums(self.dp, params, accum_dtype, sync_every_micro_batch)
        self.store = GradStore(params, self.dp, optimizer, accum_dtype, master_weights)
        """Where the window's gradient lives until the optimizer takes it."""
        self.noise = self._make_noise(params, noise_decay) if noise_scale else None
        """The noise-scale estimator (`gradaccum.noise.NoiseScale`), or None."""
        self._last_batch = None

    def _make_noise(self, params, decay: float) -> NoiseScale:
        if self.normalize != "tokens":
            raise ValueError("noise_scale=True needs normalize='tokens' (the window's token mean)")
        if self.dp.kind == "fsdp2":
            raise ValueError(
                "noise_scale=True needs each micro-batch's own gradient, which FSDP2 does not "
                "expose per micro-batch; use DDP or one device"
            )
        noise = NoiseScale(self.device, decay)
        self._noise_hooks = noise.watch(params)
        return noise

    def close(self) -> None:
        """Remove every hook this Accumulator put on the model's parameters (fp32 buffers,
        noise scale), so that another Accumulator can take the same model."""
        self.store.close()
        for handle in getattr(self, "_noise_hooks", []):
            handle.remove()
        self._noise_hooks = []

    # ---- one window ----------------------------------------------------------------------

    def step(self, micro_batches: Iterable, loss_fn: LossFn) -> StepResult:
        """Forward and backward every micro-batch of one window, then step once.

        `loss_fn(model, batch)` returns the loss SUMMED over the batch's valid tokens and
        their count. Under torchrun a rank with fewer micro-batches repeats its last batch of
        this window (or, with none this window, its last one before) with weight 0, so every
        rank joins the same collectives. A window that raises is abandoned (`Window.abandon`).
        """
        if not isinstance(micro_batches, Sequence):
            micro_batches = list(micro_batches)
        last = micro_batches[len(micro_batches) - 1] if len(micro_batches) else self._last_batch
        window = self._begin(micro_batches, None, has_batch=last is not None)
        try:
            for i in range(window.micro_steps):
                real = i < len(micro_batches)
                batch = micro_batches[i] if real else last
                with window.micro_step():  # nothing of this micro-batch outlives it
                    window.backward(*loss_fn(self.model, batch), weight=1.0 if real else 0.0)
        except BaseException:
            window.abandon()
            raise
        self._last_batch = last
        return window.finish()

    def begin_window(self, micro_batches: Sequence | int, tokens: int | None = None) -> Window:
        """Start a window by hand (for users who write their own inner loop).

        `micro_batches` is the window's list (tokens are counted from it) or just its length;
        `tokens` is this rank's valid-token count when known. Then, per micro-batch:
        `with w.micro_step(): loss_sum, n = ...; w.backward(loss_sum, n)`; finally `w.finish()`
        (or `w.abandon()`). The length may differ from one window to the next.
        """
        return self._begin(micro_batches, tokens, has_batch=True)

    def abandon_window(self) -> None:
        """Drop a window's partial gradients after a failed micro-batch (out of memory):
        nothing stepped, nothing counted, the loss scale untouched. `step` does this itself
        when a micro-batch raises; call it after a failure in a hand-written loop. Under
        torchrun every rank must abandon the same window."""
        self.store.clear()
        if self.noise is not None:
            self.noise.abandon()

    def _begin(self, micro_batches: Sequence | int, tokens: int | None, has_batch: bool) -> Window:
        local_steps = micro_batches if isinstance(micro_batches, int) else len(micro_batches)
        counted = self._count_local(micro_batches) if tokens is None else int(tokens)
        known = counted is not None and self.normalize == "tokens"
        total, steps = counted or 0, local_steps
        if self.dp.averages:
            total, steps = sync.agree_on_window(total, local_steps, self.dp.group, has_batch)
        window = Window(self, steps, total if known else None)
        if self.noise is not None and not isinstance(micro_batches, int):
            window.sequences = _count_rows(micro_batches)
        return window

    def _count_local(self, micro_batches) -> int | None:
        """This rank's valid tokens in the window (one host sync), or None if not countable."""
        if isinstance(micro_batches, int) or self.count_tokens is None:
            return None
        total = 0
        for batch in micro_batches:
            count = self.count_tokens(batch)
            if count is None:
                return None
            total = total + count
        return int(total)

    # ---- checkpointing -------------------------------------------------------------------

    def state_dict(self) -> dict:
        state = {
            "steps": self.steps,
            "skipped_total": self.skipped_total,
            "scaler": self.scaler.state_dict(),
        }
        if self.noise is not None:
            state["noise"] = self.noise.state_dict()
        return {**state, **self.store.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.steps = int(state["steps"])
        self.skipped_total = int(state["skipped_total"])
        self.scaler.load_state_dict(state["scaler"])
        self.store.load_state_dict(state)
        if self.noise is not None and "noise" in state:
            self.noise.load_state_dict(state["noise"])

    # ---- per-micro-batch gradients, for tools that need them (noise scale, verify) ---------

    def add_micro_grad_hook(self, fn: Callable[[str, torch.Tensor], None]):
        """Call `fn(param_name, grad)` with each micro-batch's own gradient of each parameter,
        as backward produces it and before it is added to the running sum: local to this
        rank, before any sync, in the parameter's dtype, and scaled as that backward was:
        by `backward_scale(...)` (world / N for token normalization, times the fp16 loss
        scale). When N is not counted up front the factor uses an estimate of N and the
        window's sum is corrected only at its end. Returns handles with `.remove()`."""
        handles = []
        for name, p in self.model.named_parameters():
            if p.requires_grad:
                handles.append(p.register_hook(_bind(fn, name)))
        return handles


def _check_arguments(precision, normalize, max_grad_norm, accum_dtype) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: expected one of {', '.join(PRECISIONS)}")
    if normalize not in NORMALIZE:
        raise ValueError(f"normalize {normalize!r}: expected one of {', '.join(NORMALIZE)}")
    if max_grad_norm is not None and not max_grad_norm > 0:
        raise ValueError(f"max_grad_norm {max_grad_norm}: must be positive")
    if accum_dtype not in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        raise ValueError(f"accum_dtype {accum_dtype}: expected a floating dtype")


def _refuse_low_precision_sums(dp, params, accum_dtype, sync_every_micro_batch) -> None:
    """Refuse the combinations whose window sum would silently be added in bf16/fp16 although
    fp32 accumulation (`accum_dtype`) was asked for."""
    if is_low_precision(accum_dtype):
        return
    low = next((p.dtype for p in params if is_low_precision(p.dtype)), None)
    if dp.kind == "ddp" and dp.world > 1 and low is not None and sync_every_micro_batch:
        raise ValueError(
            f"sync_every_micro_batch=True with DDP and {low} parameters: DDP would all-reduce "
            f"every micro-batch's gradient in {low}, while the engine adds the window in fp32 "
            "and all-reduces that sum once; drop sync_every_micro_batch (or keep fp32 "
            "parameters)"
        )
    if dp.kind != "fsdp2":
        return
    summed_in = sync.fsdp2_accumulation_dtype(dp.wrapper)
    if summed_in is not None and is_low_precision(summed_in):
        raise ValueError(
            f"FSDP2 would add the window's micro-batch gradients in {summed_in}: shard with "
            "fully_shard(..., mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32))"
        )
    if low is not None and sync_every_micro_batch:
        raise ValueError(
            f"sync_every_micro_batch=True with FSDP2 and {low} parameters: each micro-batch's "
            f"reduced shard would be added to the last in {low}; drop sync_every_micro_batch "
            "(or keep fp32 parameters with MixedPrecisionPolicy(param_dtype=torch.bfloat16, "
            "reduce_dtype=torch.float32))"
        )


@dataclass
class _Measured:
    """A window's figures after its one host sync; gradient figures are unscaled."""

    loss: float
    grad_norm: float
    tokens: float
    unscale: float  # what the summed gradient must be multiplied by (late N, loss scale)
    lr: float
    loss_scale: float | None
    noise_sums: list[float] = field(default_factory=list)  # sum_i n_i |g_i|^2, n, sequences

    @property
    def finite(self) -> bool:
        return math.isfinite(self.loss) and math.isfinite(self.grad_norm)

    @property
    def ok(self) -> bool:
        return self.finite and self.tokens > 0


class Window:
    """One window in progress: see `Accumulator.begin_window`."""

    def __init__(self, acc: Accumulator, micro_steps: int, tokens: int | None):
        self.acc = acc
        self.micro_steps = micro_steps
        self.tokens = tokens  # N over all ranks when counted up front, else None
        self._index = 0
        self._world = acc.dp.world
        # The backward scale, once per window; None until the first micro-batch when N is
        # not known up front (it is then scaled by an estimate of N, corrected at the end).
        self._scale = (
            None
            if tokens is None and acc.normalize == "tokens"
            else self._scale_for(tokens or 0, acc.scaler.scale)
        )
        # Running sums (on the device, no host sync): nothing per micro-batch outlives it.
        self._loss_sum = torch.zeros((), dtype=torch.float64, device=acc.device)
        self._tokens_seen = torch.zeros((), dtype=torch.float64, device=acc.device)
        self._traffic_start = acc.store.traffic()
        self.sequences = 0
        """This rank's sequences (rows) in the window, for the noise scale in sequences."""
        devices.reset_peak_memory(acc.device)

    def _scale_for(self, tokens: float, loss_scale: float) -> float:
        acc = self.acc
        return backward_scale(
            acc.normalize,
            tokens,
            self.micro_steps,
            self._world,
            acc.dp.averages and not acc.store.manual_sync,
            loss_scale,
        )

    @contextmanager
    def micro_step(self):
        """Context for one micro-batch's forward and backward: autocast, and no gradient sync
        except on the window's last micro-batch."""
        acc = self.acc
        last = self._index == self.micro_steps - 1
        skip_sync = acc.store.manual_sync or not (last or acc.sync_every_micro_batch)
        with ExitStack() as stack:
            stack.enter_context(sync.no_backward_sync(acc.dp.wrapper, enabled=skip_sync))
            stack.enter_context(devices.autocast(acc.device, acc.autocast_dtype))
            yield
        self._index += 1

    def backward(self, loss_sum: torch.Tensor, num_tokens, weight: float = 1.0) -> None:
        """Backward of one micro-batch's summed loss, scaled so that the window adds up to the
        token mean (or the micro-batch mean, if the Accumulator was built that way). Weight 0
        marks a repeated batch that only joins the collectives."""
        acc = self.acc
        loss = loss_sum.float()
        if acc.normalize == "micro_batch_mean":
            loss = loss / torch.as_tensor(num_tokens, device=loss.device).clamp(min=1)
        if self._scale is None:
            self._scale = self._estimated_scale(num_tokens if weight else 0)
        if weight:
            self._loss_sum.add_(loss.detach())
            self._tokens_seen.add_(num_tokens)
        scaled = loss * (self._scale if weight else 0.0)
        if acc.autocast_dtype is None:
            scaled.backward()
        else:
            with torch.autocast(acc.device.type, enabled=False):
                scaled.backward()
        if acc.noise is not None:  # its hooks saw this backward's gradients, scaled
            acc.noise.end_micro(self._scale if weight else 0.0, num_tokens)

    def _estimated_scale(self, first_tokens) -> float:
        # N is not known: estimate it as the first micro-batch's tokens (summed over ranks,
        # so that every rank scales alike) times the micro-steps. One host sync, and under
        # data parallelism one 8-byte all-reduce, per window; `finish` corrects it exactly.
        first = torch.as_tensor(first_tokens, dtype=torch.float64, device=self.acc.device)
        if self.acc.dp.averages:
            first = sync.all_reduce_sum(first.reshape(1), self.acc.dp.group)
        return self._scale_for(float(first.sum()) * self.micro_steps, self.acc.scaler.scale)

    def finish(self) -> StepResult:
        """Reduce -> measure (the window's one host sync) -> step or skip -> result."""
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
        else:
            acc.skipped_total += 1
        acc.scaler.update(found_inf=not measured.finite)
        acc.store.clear()
        return self._result(measured)

    def abandon(self) -> None:
        """Drop this window: partial gradients cleared, nothing stepped or counted, the loss
        scale untouched (for out-of-memory recovery; then run the window again, smaller)."""
        self.acc.abandon_window()

    def _measure(self, grads: list[torch.Tensor]) -> _Measured:
        acc = self.acc
        sums = torch.stack([self._loss_sum, self._tokens_seen])
        if acc.noise is not None:  # they travel in the window's one small all-reduce
            rows = torch.tensor([float(self.sequences)], dtype=sums.dtype, device=sums.device)
            sums = torch.cat([sums, acc.noise.local_sums().to(sums.device), rows])
        if acc.dp.averages:
            sums = sync.all_reduce_sum(sums, acc.dp.group)
        loss_total, seen = sums[0], sums[1]
        n_tokens = seen if self.tokens is None else torch.full_like(seen, self.tokens)
        if acc.normalize == "tokens":
            loss = loss_total / n_tokens.clamp(min=1)
        else:
            loss = loss_total / (self.micro_steps * self._world)
        norm = _total_norm(grads, acc.device).double().to(loss.device)
        figures = torch.cat([torch.stack([loss, norm, n_tokens, seen]), sums[2:]]).tolist()
        loss_f, norm_f, tokens_f, seen_f = figures[:4]
        if acc.normalize == "tokens" and self.micro_steps and round(seen_f) != round(tokens_f):
            acc.store.clear()
            raise ValueError(
                f"the window's micro-batches hold {round(tokens_f)} valid tokens by count_tokens"
                f" but loss_fn reported {round(seen_f)}: both must count the same labels (if "
                "loss_fn shifts labels itself, pass a count_tokens that shifts them too)"
            )
        # The gradient was summed under self._scale; the window's own is that of N, unscaled.
        unscale = self._scale_for(tokens_f, 1.0) / self._scale if self._scale else 1.0
        loss_scale = acc.scaler.scale if acc.scaler.enabled else None
        lr = float(acc.optimizer.param_groups[0]["lr"])
        measured = _Measured(loss_f, norm_f * unscale, tokens_f, unscale, lr, loss_scale)
        measured.noise_sums = figures[4:]
        return measured

    def _step(self, grads: list[torch.Tensor], measured: _Measured) -> None:
        """Unscale and clip in one pass, step the optimizer and the scheduler once."""
        acc = self.acc
        coef = measured.unscale
        if acc.max_grad_norm is not None:
            coef *= min(1.0, acc.max_grad_norm / (measured.grad_norm + 1e-6))
        if coef != 1.0 and grads:
            torch._foreach_mul_(grads, coef)
        acc.store.step(acc.optimizer.step)
        if acc.scheduler is not None:
            acc.scheduler.step()
        acc.steps += 1

    def _result(self, measured: _Measured) -> StepResult:
        collectives, nbytes = self.acc.store.window_traffic(self._traffic_start)
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
            noise=None if self.acc.noise is None else self.acc.noise.last,
        )


def _bind(fn: Callable[[str, torch.Tensor], None], name: str) -> Callable[[torch.Tensor], None]:
    return lambda grad: fn(name, grad)


def _total_norm(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    if not grads:
        return torch.zeros((), device=device)
    if hasattr(torch.nn.utils, "get_total_norm"):  # torch >= 2.6
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
    else:
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    if hasattr(norm, "full_tensor"):  # DTensor gradients under FSDP2
        norm = norm.full_tensor()
    return norm


def _count_rows(micro_batches) -> int:
    """Sequences (rows) in a window's batches: `labels` of dict batches, `batch[1]` of
    tuples; 0 when a batch has neither (the noise scale is then reported in tokens only)."""
    rows = 0
    for batch in micro_batches:
        labels = batch.get("labels") if isinstance(batch, Mapping) else None
        if labels is None and isinstance(batch, (tuple, list)) and len(batch) > 1:
            labels = batch[1]
        if not isinstance(labels, torch.Tensor) or labels.dim() == 0:
            return 0
        rows += labels.shape[0]
    return rows
