"""The accumulation engine: one window of micro-batches, at most one optimizer step.

The rules it keeps (DESIGN.md, "Numerical rules"):
- the window's loss is the sum over every valid token divided by N, the valid tokens of the
  whole window summed over ranks; each micro-batch's backward uses `loss_sum * world / N`
  (DDP and FSDP2 average over ranks, the factor `world` undoes that);
- clip, optimizer step, scheduler step and zero_grad run once per window;
- low-precision parameters add each gradient into an fp32 buffer as it is produced;
- a non-finite loss or gradient anywhere in the window skips the whole window.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import devices, sync
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


class Accumulator:
    """Runs windows of micro-batches and one optimizer step per window.

    model: a plain module, or one wrapped in DistributedDataParallel or sharded with FSDP2
      (their gradient collectives get counted: `sync.count_grad_traffic`, which also says how
      to keep a DDP communication hook of your own).
    count_tokens: "auto" counts `labels != ignore_index` in dict batches before the first
      backward; a callable(batch) -> int does it for other batches; None (or a batch "auto"
      cannot read) rescales the summed gradient once at the window's end instead.
    accum_dtype: dtype of the accumulation buffer for bf16/fp16 parameters (fp32; bf16 only
      to study the error it causes).
    master_weights: for bf16/fp16 parameters, keep fp32 copies that the optimizer updates (the
      optimizer is re-pointed at them, so it must not have state yet).
    sync_every_micro_batch: reduce gradients after every micro-batch (FSDP2: keeps gradients
      sharded, k times the traffic); default is one sync per window.
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
    ):
        if precision not in PRECISIONS:
            raise ValueError(f"precision {precision!r}: expected one of {', '.join(PRECISIONS)}")
        if normalize not in NORMALIZE:
            raise ValueError(f"normalize {normalize!r}: expected one of {', '.join(NORMALIZE)}")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm {max_grad_norm}: must be positive")
        if accum_dtype not in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
            raise ValueError(f"accum_dtype {accum_dtype}: expected a floating dtype")
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.max_grad_norm = max_grad_norm
        self.precision = precision
        self.normalize = normalize
        self.sync_every_micro_batch = sync_every_micro_batch
        self.count_tokens = _auto_count(ignore_index) if count_tokens == "auto" else count_tokens
        self.scaler = loss_scaler or LossScaler(enabled=precision == "fp16")
        self.steps = 0
        self.skipped_total = 0

        self._params = [p for p in model.parameters() if p.requires_grad]
        if not self._params:
            raise ValueError("model has no parameters that require grad")
        self.device = self._params[0].device
        self._autocast = autocast_dtype(precision)
        self._data_parallel = sync.averages_over_ranks(model)
        self._last_batch = None
        self._traffic = sync.count_grad_traffic(model) if self._data_parallel else None

        # FSDP2 reduces and shards gradients itself (its MixedPrecisionPolicy sets the reduce
        # dtype), so buffers apply to plain and DDP models only.
        self._buffered = any(
            self._needs_buffer(p, accum_dtype) for p in self._params
        ) and not sync.is_fsdp2(model)
        # Under DDP the buffers are not .grad tensors DDP can reduce: every micro-step runs
        # without DDP's sync and the engine all-reduces the flat fp32 buffer once.
        self._manual_sync = self._buffered and sync.is_ddp(model) and sync.world_size() > 1
        self._buffers: dict[torch.Tensor, torch.Tensor] = {}
        self._written: set[int] = set()
        self._flat: torch.Tensor | None = None
        if self._buffered:
            self._make_buffers(accum_dtype)
        self._masters: dict[torch.Tensor, torch.nn.Parameter] = {}
        if master_weights:
            self._make_masters()

    # ---- fp32 accumulation buffers and master weights -------------------------------------

    @staticmethod
    def _needs_buffer(p: torch.Tensor, accum_dtype: torch.dtype) -> bool:
        # Decided per parameter: a model may mix fp32 (norms, embeddings) and bf16 weights.
        return is_low_precision(p.dtype) and p.dtype != accum_dtype

    def _make_buffers(self, dtype: torch.dtype) -> None:
        # Under manual sync every parameter, fp32 ones too, goes through the flat buffer so a
        # single all-reduce covers the whole gradient.
        chosen = [p for p in self._params if self._manual_sync or self._needs_buffer(p, dtype)]
        self._flat = torch.zeros(sum(p.numel() for p in chosen), dtype=dtype, device=self.device)
        offset = 0
        for p in chosen:
            self._buffers[p] = self._flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
            p.register_post_accumulate_grad_hook(self._accumulate_into_buffer)

    def _accumulate_into_buffer(self, p: torch.Tensor) -> None:
        buf = self._buffers[p]
        if id(p) in self._written:
            buf.add_(p.grad)
        else:
            buf.copy_(p.grad)
            self._written.add(id(p))
        p.grad = None  # free the low-precision gradient at once

    def _make_masters(self) -> None:
        if not self._buffered:
            raise ValueError("master_weights=True needs bf16/fp16 parameters with fp32 buffers")
        if self.optimizer.state:
            raise ValueError("master_weights=True: build the Accumulator before the first step")
        for p in self._params:
            if p in self._buffers and is_low_precision(p.dtype):
                self._masters[p] = torch.nn.Parameter(p.detach().to(self._flat.dtype))
        for group in self.optimizer.param_groups:
            group["params"] = [self._masters.get(p, p) for p in group["params"]]

    # ---- one window ----------------------------------------------------------------------

    def step(self, micro_batches: Iterable, loss_fn: LossFn) -> StepResult:
        """Forward and backward every micro-batch of one window, then step once.

        `loss_fn(model, batch)` returns the loss SUMMED over the batch's valid tokens and
        their count. Under torchrun a rank with fewer micro-batches (its data ran out) repeats
        its last batch with weight 0, so every rank joins the same collectives.
        """
        micro_batches = list(micro_batches)
        has_batch = bool(micro_batches) or self._last_batch is not None
        window = self._begin(micro_batches, None, has_batch)
        for i in range(window.micro_steps):
            real = i < len(micro_batches)
            batch = micro_batches[i] if real else self._last_batch
            if batch is None:
                raise RuntimeError("a rank with no data yet cannot join a window")
            with window.micro_step():
                loss_sum, num_tokens = loss_fn(self.model, batch)
                window.backward(loss_sum, num_tokens, weight=1.0 if real else 0.0)
        if micro_batches:
            self._last_batch = micro_batches[-1]
        return window.finish()

    def begin_window(self, micro_batches: list | int, tokens: int | None = None) -> Window:
        """Start a window by hand (for users who write their own inner loop).

        `micro_batches` is the window's list (tokens are counted from it) or just its length;
        `tokens` is this rank's valid-token count when known. Then, per micro-batch:
        `with w.micro_step(): loss_sum, n = ...; w.backward(loss_sum, n)`; finally `w.finish()`.
        """
        return self._begin(micro_batches, tokens, has_batch=True)

    def _begin(self, micro_batches: list | int, tokens: int | None, has_batch: bool) -> Window:
        local_steps = micro_batches if isinstance(micro_batches, int) else len(micro_batches)
        counted = self._count_local(micro_batches) if tokens is None else int(tokens)
        known = counted is not None and self.normalize == "tokens"
        total, steps = counted or 0, local_steps
        if self._data_parallel:
            total, steps = sync.agree_on_window(total, local_steps, has_batch=has_batch)
        return Window(self, steps, total if known else None)

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
        if self._masters:
            state["masters"] = [m.detach().clone() for m in self._masters.values()]
        return state

    def load_state_dict(self, state: dict) -> None:
        self.steps = int(state["steps"])
        self.skipped_total = int(state["skipped_total"])
        self.scaler.load_state_dict(state["scaler"])
        if self._masters:
            with torch.no_grad():
                for m, saved in zip(self._masters.values(), state["masters"], strict=True):
                    m.copy_(saved)
                for p, m in self._masters.items():
                    p.copy_(m)

    # ---- per-micro-batch gradients, for tools that need them (noise scale) -----------------

    def add_micro_grad_hook(self, fn: Callable[[str, torch.Tensor], None]):
        """Call `fn(param_name, grad)` with each micro-batch's own gradient of each parameter,
        before it is added to the running sum (local to this rank, before any sync, scaled as
        the backward was). Returns handles with `.remove()`."""
        handles = []
        for name, p in self.model.named_parameters():
            if p.requires_grad:
                handles.append(p.register_hook(_bind(fn, name)))
        return handles

    # ---- used by Window ------------------------------------------------------------------

    def _live_buffers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(parameter, buffer) pairs that hold this window's gradient. Under manual sync all
        of them: a parameter unused on this rank may have a gradient from another."""
        return [
            (p, buf)
            for p, buf in self._buffers.items()
            if self._manual_sync or id(p) in self._written
        ]

    def _gradients(self) -> list[torch.Tensor]:
        grads = [buf for _, buf in self._live_buffers()]
        grads += [p.grad for p in self._params if p not in self._buffers and p.grad is not None]
        return grads

    def _clear(self) -> None:
        for p in self._params:
            p.grad = None
        for m in self._masters.values():
            m.grad = None
        self._written.clear()


class Window:
    """One window in progress: see `Accumulator.begin_window`."""

    def __init__(self, acc: Accumulator, micro_steps: int, tokens: int | None):
        self.acc = acc
        self.micro_steps = micro_steps
        self.tokens = tokens  # N over all ranks when counted up front, else None
        self._index = 0
        # DDP and FSDP2 average over ranks, the engine's own fp32 sync sums.
        self._world = sync.world_size() if acc._data_parallel else 1
        self._rank_factor = 1 if acc._manual_sync else self._world
        self._late_scale: float | None = None
        # Per micro-batch (summed loss or mean, valid tokens), summed once at finish: no
        # small tensor arithmetic on the per-micro-batch path.
        self._losses: list[torch.Tensor] = []
        self._counts: list[torch.Tensor | int] = []
        traffic = acc._traffic
        self._traffic_start = (traffic.collectives, traffic.bytes) if traffic else (0, 0)
        devices.reset_peak_memory(acc.device)

    @contextmanager
    def micro_step(self):
        """Context for one micro-batch's forward and backward: autocast, and no gradient sync
        except on the window's last micro-batch."""
        acc = self.acc
        last = self._index == self.micro_steps - 1
        skip_sync = acc._manual_sync or not (last or acc.sync_every_micro_batch)
        with ExitStack() as stack:
            stack.enter_context(sync.no_backward_sync(acc.model, enabled=skip_sync))
            stack.enter_context(devices.autocast(acc.device, acc._autocast))
            yield
        self._index += 1

    def backward(self, loss_sum: torch.Tensor, num_tokens, weight: float = 1.0) -> None:
        """Backward of one micro-batch's summed loss, scaled so that the window adds up to the
        token mean (or the micro-batch mean, if the Accumulator was built that way). Weight 0
        marks a repeated batch that only joins the collectives."""
        acc = self.acc
        loss_sum = loss_sum.float()
        if acc.normalize == "micro_batch_mean":
            n = torch.as_tensor(num_tokens, device=loss_sum.device).clamp(min=1)
            mean = loss_sum / n / self.micro_steps
            # The sync must leave the mean over ranks, whether it averages or sums.
            scaled, factor, kept = mean, self._rank_factor / self._world, mean
        else:
            scaled, factor, kept = (
                loss_sum,
                self._rank_factor * self._token_factor(num_tokens),
                loss_sum,
            )
        if weight:
            self._losses.append(kept.detach())
            self._counts.append(num_tokens)
        else:
            factor = 0.0
        if acc.scaler.enabled:
            factor *= acc.scaler.scale
        scaled = scaled * factor
        if acc._autocast is None:
            scaled.backward()
        else:
            with torch.autocast(acc.device.type, enabled=False):
                scaled.backward()

    def _token_factor(self, n) -> float:
        if self.tokens is not None:
            return 1.0 / max(self.tokens, 1)
        if self._late_scale is None:
            # N is not known yet: scale by an estimate from the first micro-batch (one host
            # sync) and correct once at the end. Ranks must agree on the estimate, so under
            # data parallelism it is 1 / micro_steps.
            if self.acc._data_parallel:
                self._late_scale = 1.0 / self.micro_steps
            else:
                self._late_scale = 1.0 / (max(float(n), 1.0) * self.micro_steps)
        return self._late_scale

    def finish(self) -> StepResult:
        """Sync (where the engine owns it), unscale, check, clip, step once, clear."""
        acc = self.acc
        if acc._manual_sync:
            for p, buf in acc._buffers.items():
                if id(p) not in acc._written:
                    buf.zero_()  # a parameter unused on this rank adds nothing
            dist.all_reduce(acc._flat)
        device = acc.device
        stats = torch.zeros(2, dtype=torch.float64, device=device)
        if self._losses:
            stats[0] = torch.stack(self._losses).to(device, torch.float64).sum()
            stats[1] = (
                torch.stack([torch.as_tensor(c).to(device) for c in self._counts])
                .to(torch.float64)
                .sum()
            )
        if acc._data_parallel:
            stats = sync.all_reduce_sum(stats)
        grads = acc._gradients()
        loss_total, tokens_seen = stats[0], stats[1]
        n_tokens = self.tokens if self.tokens is not None else tokens_seen
        correction = 1.0
        if acc.normalize == "tokens" and self.tokens is None and self._late_scale is not None:
            correction = (1.0 / (torch.as_tensor(n_tokens).clamp(min=1) * self._late_scale)).item()
        if acc.scaler.enabled:
            correction /= acc.scaler.scale
        if correction != 1.0 and grads:
            torch._foreach_mul_(grads, correction)
        norm = _total_norm(grads, acc.device)
        if acc.normalize == "tokens":
            loss = loss_total / torch.as_tensor(n_tokens, dtype=torch.float64).clamp(min=1)
        else:
            loss = loss_total / self._world
        loss_f, norm_f, tokens_f, reported = torch.stack(
            [
                loss.double(),
                norm.double().to(loss.device),
                torch.as_tensor(n_tokens, dtype=torch.float64, device=loss.device),
                tokens_seen,
            ]
        ).tolist()  # the window's one host sync
        if acc.normalize == "tokens" and self.micro_steps and round(reported) != round(tokens_f):
            acc._clear()
            raise ValueError(
                f"the window's micro-batches hold {round(tokens_f)} valid tokens by count_tokens"
                f" but loss_fn reported {round(reported)}: both must count the same labels (if "
                "loss_fn shifts labels itself, pass a count_tokens that shifts them too)"
            )
        lr = float(acc.optimizer.param_groups[0]["lr"])
        scale = acc.scaler.scale if acc.scaler.enabled else None
        ok = math.isfinite(loss_f) and math.isfinite(norm_f) and tokens_f > 0
        if ok:
            if acc.max_grad_norm is not None and grads:
                coef = min(1.0, acc.max_grad_norm / (norm_f + 1e-6))
                if coef < 1.0:
                    torch._foreach_mul_(grads, coef)
            self._hand_to_optimizer()
            acc.optimizer.step()
            if acc._masters:
                with torch.no_grad():
                    for p, m in acc._masters.items():
                        p.copy_(m)
            if acc.scheduler is not None:
                acc.scheduler.step()
            acc.steps += 1
        else:
            acc.skipped_total += 1
        acc.scaler.update(found_inf=not (math.isfinite(norm_f) and math.isfinite(loss_f)))
        acc._clear()
        return StepResult(
            loss=loss_f,
            tokens=int(round(tokens_f)),
            micro_steps=self.micro_steps,
            grad_norm=norm_f if ok else math.nan,
            skipped=not ok,
            lr=lr,
            step=acc.steps,
            skipped_total=acc.skipped_total,
            loss_scale=scale,
            peak_memory_bytes=devices.peak_memory_bytes(acc.device),
            **self._traffic_counts(),
        )

    def _traffic_counts(self) -> dict[str, int]:
        acc = self.acc
        if acc._manual_sync:  # DDP never syncs: the engine's one all-reduce is the traffic
            flat = acc._flat
            return {"grad_collectives": 1, "grad_bytes": flat.numel() * flat.element_size()}
        if acc._traffic is None:  # one device (nothing to count), or counting was refused
            none = 0 if not acc._data_parallel else -1
            return {"grad_collectives": none, "grad_bytes": none}
        start_collectives, start_bytes = self._traffic_start
        return {
            "grad_collectives": acc._traffic.collectives - start_collectives,
            "grad_bytes": acc._traffic.bytes - start_bytes,
        }

    def _hand_to_optimizer(self) -> None:
        acc = self.acc
        for p, buf in acc._live_buffers():
            if p in acc._masters:
                acc._masters[p].grad = buf if buf.dtype == acc._masters[p].dtype else buf.float()
            else:
                p.grad = buf.to(p.dtype) if buf.dtype != p.dtype else buf


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
