"""The accumulation engine: one window of micro-batches, at most one optimizer step.

The rules it keeps (docs/design.md, "Numerical rules" and "Engine rules"):
- the window's loss is the sum over every valid token divided by N, the valid tokens of the
  whole window summed over the data-parallel ranks; each micro-batch's backward uses
  `loss_sum * world / N` (DDP and FSDP2 average over ranks, the factor `world` undoes that):
  `backward_scale`, computed once per window;
- clip, optimizer step, scheduler step and zero_grad run once per window; gradients are
  cleared when a window begins, so a backward run outside any window never leaks into one;
- every trainable parameter the optimizer holds is the engine's, the model's or not (a
  learnable temperature in loss_fn): cleared, buffered, corrected, clipped, and under data
  parallelism all-reduced by the engine where no wrapper syncs it;
- low-precision parameters add each gradient into an fp32 buffer as it is produced
  (`grad_store.GradStore`); under FSDP2 every sync policy (`sync=`: "window", "micro",
  "hsdp") sums the window in fp32 too (`parallel.fsdp2`);
- a non-finite loss or gradient anywhere in the window skips the whole window;
- a window runs exactly its micro-steps and is used once (`window.Window`);
- nothing per micro-batch outlives its micro-step: host memory does not grow with k.

Seams for tools built on the engine: `Accumulator.add_micro_grad_hook` (each micro-batch's
own gradient), `Window.abandon` / `Accumulator.abandon_window` (drop a window, e.g. after
running out of memory), and k free to change from one window to the next.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

import torch

from gradaccum.engine.grad_store import GradStore
from gradaccum.engine.loss_contract import loss_pair
from gradaccum.engine.noise import NoiseScale
from gradaccum.engine.precision import LossScaler, autocast_dtype, is_low_precision
from gradaccum.engine.scale import backward_scale
from gradaccum.engine.step_result import StepResult
from gradaccum.engine.window import Window, repeated_batch
from gradaccum.parallel import backends, collectives
from gradaccum.utils.choices import PRECISIONS, SYNC_POLICIES

__all__ = ["Accumulator", "StepResult", "Window", "backward_scale", "count_labels", "windows"]

NORMALIZE = ("tokens", "micro_batch_mean")

LossFn = Callable[[torch.nn.Module, object], tuple[torch.Tensor, "int | torch.Tensor"]]


def count_labels(ignore_index: int = -100, key: str = "labels") -> Callable[[object], torch.Tensor]:
    """A `count_tokens` callable: valid labels in a dict batch (`batch[key]`) or `batch[1]`."""

    def count(batch) -> torch.Tensor:
        labels = batch[key] if isinstance(batch, Mapping) else batch[1]
        return (labels != ignore_index).sum()

    return count


def _auto_count(ignore_index: int) -> Callable[[object], torch.Tensor | None]:
    by_labels = count_labels(ignore_index)

    def count(batch):
        if isinstance(batch, Mapping):
            return by_labels(batch) if "labels" in batch else None
        labels = _labels_of(batch)
        # (inputs, labels) tuples: integer labels, as a token loss takes them
        if labels is None or labels.is_floating_point() or labels.dtype == torch.bool:
            return None
        return (labels != ignore_index).sum()

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

    model: a plain module, or one wrapped in DistributedDataParallel or sharded with FSDP2,
      either of them possibly inside torch.compile (their gradient collectives get counted:
      `backends.count_grad_traffic`, which also says how to keep a DDP communication hook of
      your own). Under FSDP2 the engine turns on FSDP2's reduce-scatter of unused parameters
      (`FSDP2.reduce_unused_parameters`), so a parameter unused on some rank is exact.
    optimizer: every parameter it holds that requires grad is stepped from the window's
      gradient; those outside the model (`extras`) are broadcast from the first rank once
      and all-reduced by the engine once per window under DDP or FSDP2.
    scheduler: stepped once per window; a ReduceLROnPlateau is given the window's loss.
    count_tokens: "auto" counts `labels != ignore_index` before the first backward, in dict
      batches (`batch["labels"]`) and (inputs, labels) tuples of integer labels; a
      callable(batch) -> int does it for other batches. loss_fn's own counts are checked
      against it. None (or a batch "auto" cannot read) scales by an upper bound of N (the
      window's label elements, padding included) or else an estimate from the first
      micro-batch, and corrects the summed gradient once at the window's end.
    accum_dtype: dtype of the accumulation buffer for bf16/fp16 parameters (fp32; bf16 only
      to study the error it causes).
    master_weights: for bf16/fp16 parameters, keep fp32 copies that the optimizer updates (the
      optimizer is re-pointed at them, so it must not have state yet).
    sync: how the window's gradient meets across ranks (docs/distributed.md, "Sync policies"):
      "window" (default): no sync until the window's last micro-batch, one reduce per window,
        the whole gradient held per rank until then (DDP, FSDP2, one device);
      "micro": FSDP2 reduce-scatters after every micro-batch (k times the traffic, gradients
        held sharded); each unit's reduced shard is summed in fp32 whatever the parameters'
        dtype, and the optimizer sees that sum. Under DDP: an all-reduce after every
        micro-batch, in the parameters' dtype (refused for bf16/fp16 parameters);
      "hsdp": FSDP2 over a 2-D DeviceMesh (replicate, shard): reduce-scatter within the shard
        group after every micro-batch, all-reduce across replicas once per window.
    sync_every_micro_batch: True is sync="micro" (kept for existing callers).
    noise_scale: estimate the gradient noise scale (the critical batch size) from each
      micro-batch's own gradient as backward produces it (`gradaccum.engine.noise`): one squared
      norm per parameter and micro-batch, reported in `StepResult.noise`. Needs the token
      mean and per-micro-batch gradients: one device or DDP, not FSDP2. `noise_decay` is
      the decay of its moving averages, per window.
    group: the data-parallel process group; by default DDP's `process_group` or FSDP2's mesh.
      N, the world factor and every collective of the engine use it.
    Build it on every rank: with parameters outside the model, its construction under DDP or
    FSDP2 broadcasts them.
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
        sync: str = "window",
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
        self.sync = _sync_policy(sync, sync_every_micro_batch)
        """The sync policy: "window", "micro" or "hsdp"."""
        self.sync_every_micro_batch = self.sync == "micro"
        self.count_tokens = _auto_count(ignore_index) if count_tokens == "auto" else count_tokens
        self.scaler = loss_scaler or LossScaler(enabled=precision == "fp16")
        self.autocast_dtype = autocast_dtype(precision)
        self.steps = 0
        """Optimizer steps taken (windows finished and not skipped)."""
        self.skipped_total = 0
        """Windows finished without a step (non-finite loss or gradient, or no tokens)."""
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ValueError("model has no parameters that require grad")
        self.device = params[0].device
        self.dp = backends.data_parallel(model, group)
        """The model's data-parallel backend, chosen once: its wrapper, group and size, and
        how it syncs (`parallel.backends.Backend`)."""
        self.dp.set_sync_policy(self.sync)
        self.extras = _outside_model(optimizer, params)
        """(name, parameter) of each trainable parameter the optimizer holds and the model
        does not, named by its place in the optimizer (`param_groups[g][i]`)."""
        extras = [p for _, p in self.extras]
        params += extras
        named = "sync_every_micro_batch=True" if sync_every_micro_batch else f"sync={self.sync!r}"
        _refuse_low_precision_sums(self.dp, params, accum_dtype, self.sync, named)
        if self.dp.averages_over_ranks and self.dp.world > 1:
            collectives.broadcast_from_first(extras, self.dp.group)  # replicas start alike
            self.dp.reduce_unused_parameters()
        self.store = GradStore(params, self.dp, optimizer, accum_dtype, master_weights, extras)
        """Where the window's gradient lives until the optimizer takes it."""
        self.noise = self._make_noise(params, noise_decay) if noise_scale else None
        """The noise-scale estimator (`gradaccum.engine.noise.NoiseScale`), or None."""
        self._last_batch = None  # this rank's last, repeated by `step` in a window with none
        self._open: Window | None = None  # the window begun and not yet closed
        self._tokens_per_micro_step = 0.0  # of the last finished window: floors an estimate

    def _make_noise(self, params, decay: float) -> NoiseScale:
        if self.normalize != "tokens":
            raise ValueError("noise_scale=True needs normalize='tokens' (the window's token mean)")
        if self.dp.shards_gradients:
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
        their count. The micro-steps run in `Window.run`: under torchrun a rank with fewer
        micro-batches repeats its last batch of this window (or, with none this window, its
        last one before) with weight 0, so every rank joins the same collectives; a window
        that raises is abandoned (`Window.abandon`).
        """
        if not isinstance(micro_batches, Sequence):
            micro_batches = list(micro_batches)
        repeat = repeated_batch(micro_batches, self._last_batch)
        window = self._begin(micro_batches, None, has_batch=repeat is not None)

        def forward_backward(batch, weight: float) -> None:  # its loss dies with its micro-step
            window.run_backward(*loss_pair(loss_fn(self.model, batch)), weight, "loss_fn returned")

        result = window.run(micro_batches, forward_backward, stand_in=self._last_batch)
        self._last_batch = repeat
        return result

    def begin_window(
        self,
        micro_batches: Sequence | int,
        tokens: int | None = None,
        extra_sums: torch.Tensor | None = None,
    ) -> Window:
        """Start a window by hand (for users who write their own inner loop).

        `micro_batches` is the window's list (tokens are counted from it) or just its length;
        `tokens` is this rank's valid-token count when known. Then, per micro-batch:
        `with w.micro_step(): loss_sum, n = ...; w.backward(loss_sum, n)`; finally `w.finish()`
        (or `w.abandon()`). The window must run exactly `w.micro_steps` micro-steps (under
        torchrun the largest count over ranks), one backward each, or it is refused with
        nothing stepped; it is used once. The length may differ from one window to the next.
        `extra_sums`: a 1-d int64 CPU tensor of this rank's own counts, summed over ranks in
        the same all-gather that agrees on the window's size (no collective of its own) and
        exposed as `w.extra_sums`; every rank must pass the same length (the MoE balance's
        routed tokens and expert counts: `gradaccum.moe.balance`).
        """
        return self._begin(micro_batches, tokens, has_batch=True, extra_sums=extra_sums)

    def abandon_window(self) -> None:
        """Drop a window's partial gradients after a failed micro-batch (out of memory):
        nothing stepped, nothing counted, the loss scale untouched; the open window, if any,
        refuses further use. `step` does this itself when a micro-batch raises; call it after
        a failure in a hand-written loop. Under torchrun every rank must abandon the same
        window."""
        if self._open is not None:
            self._open.abandon()
        else:
            self._drop_gradients()

    def window_finished(self, window: Window, stepped: bool, tokens: int) -> None:
        """Called by `window` once its optimizer step is taken (`stepped`) or skipped, before
        its result is made: the step or skip counted, and its N (`tokens`) per micro-step
        kept, to floor the next window's estimate of N."""
        if self._open is window:
            self._open = None
        if stepped:
            self.steps += 1
        else:
            self.skipped_total += 1
        if tokens > 0 and window.micro_steps:
            self._tokens_per_micro_step = tokens / window.micro_steps

    def window_dropped(self, window: Window) -> None:
        """Called by `window` when it is dropped (abandoned, refused, or failed in `finish`):
        its partial gradients cleared, nothing counted."""
        if self._open is window:
            self._open = None
        self._drop_gradients()

    def _drop_gradients(self) -> None:
        self.store.clear()
        self.store.drop_unreduced(reset=True)
        if self.noise is not None:
            self.noise.abandon()

    def _begin(
        self,
        micro_batches: Sequence | int,
        tokens: int | None,
        has_batch: bool,
        extra_sums: torch.Tensor | None = None,
    ) -> Window:
        if self._open is not None:
            w = self._open
            raise RuntimeError(
                f"a window is still open ({w.micro_steps_run} of {w.micro_steps} micro-steps run): "
                "finish() or abandon() it before beginning another"
            )
        # zero_grad once per window, here: whatever ran backward before must not leak in
        self.store.clear()
        self.store.drop_unreduced()
        if self.noise is not None:
            self.noise.abandon()
        local_steps = micro_batches if isinstance(micro_batches, int) else len(micro_batches)
        counted = self._count_local(micro_batches) if tokens is None else int(tokens)
        known = counted is not None and self.normalize == "tokens"
        capacity = None if known else _label_capacity(micro_batches)
        extra = collectives.extra_vector(extra_sums)
        size = collectives.WindowSize(counted or 0, local_steps, capacity, extra)
        if self.dp.averages_over_ranks:
            size = collectives.agree_on_window_size(
                counted or 0, local_steps, self.dp.group, has_batch, capacity, extra
            )
        floor = self._tokens_per_micro_step * size.micro_steps
        counted_rows = self.noise is not None and not isinstance(micro_batches, int)
        window = Window(
            self,
            size.micro_steps,
            size.tokens if known else None,
            size.capacity,
            floor,
            extra_sums=size.extra_sums,
            sequences=_count_rows(micro_batches) if counted_rows else 0,
        )
        self._open = window
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
            "tokens_per_micro_step": self._tokens_per_micro_step,
        }
        if self.noise is not None:
            state["noise"] = self.noise.state_dict()
        return {**state, **self.store.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.steps = int(state["steps"])
        self.skipped_total = int(state["skipped_total"])
        self.scaler.load_state_dict(state["scaler"])
        self._tokens_per_micro_step = float(state.get("tokens_per_micro_step", 0.0))
        self.store.load_state_dict(state)
        if self.noise is not None and "noise" in state:
            self.noise.load_state_dict(state["noise"])

    # ---- per-micro-batch gradients, for tools that need them (noise scale, verify) ---------

    def add_micro_grad_hook(self, fn: Callable[[str, torch.Tensor], None]):
        """Call `fn(param_name, grad)` with each micro-batch's own gradient of each parameter
        (the model's by name, those outside it as `optimizer.param_groups[g][i]`), as backward
        produces it and before it is added to the running sum: local to this rank, before any
        sync, in the parameter's dtype, and scaled as that backward was: by
        `backward_scale(...)` (world / N for token normalization, times the fp16 loss scale).
        When N is not counted up front the factor uses a bound or an estimate of N and the
        window's sum is corrected only at its end. Returns handles with `.remove()`."""
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        return [p.register_hook(_bind(fn, name)) for name, p in named + self.extras]


def _check_arguments(precision, normalize, max_grad_norm, accum_dtype) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: expected one of {', '.join(PRECISIONS)}")
    if normalize not in NORMALIZE:
        raise ValueError(f"normalize {normalize!r}: expected one of {', '.join(NORMALIZE)}")
    if max_grad_norm is not None and not max_grad_norm > 0:
        raise ValueError(f"max_grad_norm {max_grad_norm}: must be positive")
    if accum_dtype not in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        raise ValueError(f"accum_dtype {accum_dtype}: expected a floating dtype")


def _outside_model(optimizer, model_params) -> list[tuple[str, torch.nn.Parameter]]:
    """The trainable parameters `optimizer` holds that are not among `model_params`, each
    once; a sharded one (a DTensor) is refused, as the engine could not tell how to sum it."""
    seen = {id(p) for p in model_params}
    out = []
    for g, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            name = f"optimizer.param_groups[{g}][{i}]"
            if hasattr(p, "device_mesh"):
                raise ValueError(
                    f"{name} (shape {tuple(p.shape)}) is a DTensor outside the model: shard it "
                    "with the model (fully_shard) or keep it a plain tensor"
                )
            out.append((name, p))
    return out


def _sync_policy(sync: str, every_micro_batch: bool) -> str:
    """The sync policy from `sync` and the older `sync_every_micro_batch` (True: "micro")."""
    if sync not in SYNC_POLICIES:
        raise ValueError(f"sync {sync!r}: expected one of {', '.join(SYNC_POLICIES)}")
    if every_micro_batch and sync == "hsdp":
        raise ValueError(
            f"sync_every_micro_batch=True is sync='micro', which contradicts sync={sync!r}: "
            "pass sync alone"
        )
    return "micro" if every_micro_batch else sync


def _refuse_low_precision_sums(dp, params, accum_dtype, sync: str, named: str) -> None:
    """Refuse the combinations whose window sum would silently be added in bf16/fp16 although
    fp32 accumulation (`accum_dtype`) was asked for. Asked of the backend: the engine syncs
    its fp32 buffers itself under DDP only, and only FSDP2 shards gradients and reduces
    them in a dtype of its own. `named`: the argument as the caller gave it."""
    if is_low_precision(accum_dtype):
        return
    low = next((p.dtype for p in params if is_low_precision(p.dtype)), None)
    if dp.buffers_synced_by_engine and low is not None and sync == "micro":
        raise ValueError(
            f"{named} with DDP and {low} parameters: DDP would all-reduce every "
            f"micro-batch's gradient in {low}, while the engine adds the window in fp32 and "
            "all-reduces that sum once; use sync='window' (or keep fp32 parameters, or shard "
            "with FSDP2, whose sync='micro' sums in fp32)"
        )
    summed_in = dp.accumulation_dtype()
    if summed_in is not None and is_low_precision(summed_in):
        what = "add the window's" if sync == "window" else "reduce each of the window's"
        raise ValueError(
            f"FSDP2 would {what} micro-batch gradients in {summed_in}: shard with "
            "fully_shard(..., mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32))"
        )


def _bind(fn: Callable[[str, torch.Tensor], None], name: str) -> Callable[[torch.Tensor], None]:
    return lambda grad: fn(name, grad)


def _labels_of(batch) -> torch.Tensor | None:
    """The labels of a batch: `batch["labels"]` of a dict, `batch[1]` of a tuple or list;
    None when there is no such tensor of at least one dimension."""
    if isinstance(batch, Mapping):
        labels = batch.get("labels")
    elif isinstance(batch, (tuple, list)) and len(batch) > 1:
        labels = batch[1]
    else:
        return None
    return labels if isinstance(labels, torch.Tensor) and labels.dim() > 0 else None


def _count_rows(micro_batches) -> int:
    """Sequences (rows) in a window's batches, from their labels; 0 when a batch has none
    (the noise scale is then reported in tokens only)."""
    rows = 0
    for batch in micro_batches:
        labels = _labels_of(batch)
        if labels is None:
            return 0
        rows += labels.shape[0]
    return rows


def _label_capacity(micro_batches) -> int | None:
    """Label elements in a window's batches (valid or not: an upper bound of its tokens, read
    from shapes, no host sync); None when a batch has no labels to read or only a length is
    given."""
    if isinstance(micro_batches, int):
        return None
    total = 0
    for batch in micro_batches:
        labels = _labels_of(batch)
        if labels is None:
            return None
        total += labels.numel()
    return total
