"""`gradaccum train`: a causal LM trained at a fixed tokens-per-step budget.

A `Run` is built (checks, data, model, plan: everything that can still reject the input,
before anything is written), restored from a checkpoint on --resume, then trained one window
at a time: fetch the window's k micro-batches, forward and backward each, one optimizer step,
a metrics line; evaluated and saved every so often; finished with the model's export, the
plot and the summary.
"""

from __future__ import annotations

import gc
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import torch
import torch.distributed as dist

from ..engine.accumulator import Accumulator, StepResult
from ..models.gpt import build_model, causal_lm_loss
from ..parallel import devices, sync
from ..parallel.process_group import RankInfo, init_distributed, peer_lost, teardown
from ..plan.sizes import fmt_count
from ..utils.atomic import interrupted, write_text_atomic
from ..utils.errors import BadInput, DiskFull, RanksLost, RunFailed, first_line
from . import checkpoint, checks, resume
from .batching import AUTO, make_batching, smallest_target, token_schedule
from .config import DEFAULT_MAX_TOKENS, DEFAULT_TOKENS_PER_STEP, TrainConfig, to_toml
from .console import Console, Progress, StopSignals
from .lock import RunLock
from .metrics import MetricsWriter, plot_loss, read_metrics
from .resolve import resolve_plan
from .schedule import Schedule, make_scheduler

__all__ = ["TrainConfig", "evaluate", "train"]

EVAL_TOKENS = 32768
"""Held-out tokens the eval loss is measured on (fewer if the split is smaller)."""

DIVERGED_WINDOWS = 50
"""Windows in a row with a non-finite loss or gradient after which the run gives up."""

GO, STOP, OUT_OF_MEMORY = 0, 1, 2
"""What the ranks agree on before each micro-batch (the largest wins)."""
PEER_OUT_OF_MEMORY = "peer out of memory"
"""`Run._window`'s answer when another rank ran out of memory in the window."""


def train(config: TrainConfig, should_stop: Callable[[int], bool] | None = None) -> dict:
    """Run the training `config` describes; return the summary (the --json object).

    should_stop(step) is asked after every window, like a signal: True saves and stops.
    Raises BadInput (a one-line `--flag value: why`) for input found bad, before anything is
    written to --out.
    """
    config = prepare(config)
    try:
        rank_info = init_distributed(device=config.device, timeout_s=config.dist_timeout)
    except ValueError as err:  # a bad torchrun environment or a device the backend cannot use
        raise BadInput("--device", config.device, first_line(err)) from None
    try:
        return Run.build(config, rank_info).train(should_stop)
    finally:
        teardown(rank_info)


def prepare(config: TrainConfig) -> TrainConfig:
    """`config` with its default --out chosen and its paths absolute (a resume from another
    folder finds them), after every check that needs no data: nothing read, nothing written."""
    config = replace(
        config,
        out=config.out or checks.default_out(),
        **{
            name: os.path.abspath(getattr(config, name))
            for name in ("data", "model_config", "init_from")
            if getattr(config, name) is not None and not getattr(config, name).startswith("hf:")
        },
    )
    checks.check_out_folder(config.out)
    if not config.resume:  # a resume's model comes from its checkpoint, not from these paths
        checks.check_paths(config)
    elif config.data is not None:
        checks.check_paths(replace(config, model_config=None, init_from=None, model=None))
    checks.check_device(config.device)
    checks.check_run_folder(config.out, config.resume)
    if config.tensorboard:
        from .tensorboard import check_available

        check_available()
    return config


@dataclass
class RunState:
    """What a run has done so far, saved with each checkpoint."""

    tokens: int = 0
    """Tokens trained on (all ranks)."""
    elapsed_s: float = 0.0
    """Seconds since the loop started, over every resume."""
    train_s: float = 0.0
    """Seconds inside training windows only (not eval, saving or start-up)."""
    initial_loss: float | None = None
    """Loss of the run's first window, nats per token."""


def _load_data(config: TrainConfig):
    from ..data.tokens import load_tokens

    try:
        return load_tokens(config.data, config.seq_len, config.seed)
    except BadInput:
        raise
    except (ValueError, OSError, ImportError) as err:
        raise BadInput("--data", config.data or "(built-in)", first_line(err)) from None


def _build_model(config: TrainConfig, data_info, ckpt):
    if ckpt is not None:  # the model as trained: config.json and weights of the checkpoint
        try:
            return build_model(
                init_from=ckpt.path, vocab_size=data_info.vocab_size, seq_len=config.seq_len
            )
        except BadInput as err:
            raise BadInput(
                "--resume", config.out, f"the checkpoint's model does not fit ({err.why or err})"
            ) from None
    return build_model(
        preset=config.preset,
        config_path=config.model_config,
        init_from=config.init_from,
        vocab_size=data_info.vocab_size,
        seq_len=config.seq_len,
    )


AUTO_FIT_SECONDS = 4.0
"""Seconds `--micro-batch auto` spends probing and timing micro-batch sizes."""


def _measures_micro_batch(config: TrainConfig, rank_info: RankInfo) -> bool:
    """--micro-batch auto with the batch left to choose: measured (`gradaccum.fit`), not
    estimated. With --accum-steps given, the batch follows from it as before."""
    target = _target(config)
    return (
        config.micro_batch == "auto"
        and config.accum_steps is None
        and target >= config.seq_len * rank_info.world_size
    )


def _target(config: TrainConfig) -> int:
    """The tokens per step the micro-batch is chosen for: a schedule's smallest batch."""
    if config.batch_schedule is not None:
        return smallest_target(config)
    return config.tokens_per_step or DEFAULT_TOKENS_PER_STEP


def measure_micro_batch(config: TrainConfig, model, train_set, rank_info: RankInfo, say):
    """`config` with the micro-batch that fits and trains fastest here, probed for at most
    AUTO_FIT_SECONDS (forward, backward and optimizer step at growing sizes, bounded on CPU by
    CPU_MICRO_TOKENS per micro-batch); its table is printed. The model's weights and the RNG
    are left as they were, so the run trains as if nothing was probed."""
    import numpy as np

    from .. import fit
    from .resolve import CPU_MICRO_TOKENS

    device = rank_info.device
    model.to(device)

    def make_batch(micro_batch: int) -> dict:
        rows = train_set.batch(np.arange(micro_batch) % len(train_set)).to(device)
        return {"input_ids": rows[:, :-1].contiguous(), "labels": rows[:, 1:].contiguous()}

    on_cpu = devices.total_memory_bytes(device) is None
    rng = checkpoint.rng_state()
    result = fit.find_micro_batch(
        model,
        make_batch,
        causal_lm_loss,
        seq_len=config.seq_len,
        tokens_per_step=_target(config),
        world_size=rank_info.world_size,
        precision=config.precision,
        max_micro_batch=max(1, CPU_MICRO_TOKENS // config.seq_len) if on_cpu else None,
        try_checkpointing=False,
        max_seconds=AUTO_FIT_SECONDS,
        make_optimizer=lambda m: _optimizer(m, config),
    )
    checkpoint.set_rng_state(rng)
    say(fit.render_table(result).rstrip("\n"))
    return replace(config, micro_batch=result.micro_batch)


def _optimizer(model: torch.nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    # Decay matrices and embeddings, not biases and norm gains (nanoGPT, GPT-3).
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": config.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=config.lr, betas=(0.9, 0.95), eps=1e-8)


def _to_device(batch: dict, device: torch.device) -> dict:
    return {key: value.to(device, non_blocking=True) for key, value in batch.items()}


@torch.no_grad()
def evaluate(
    model: torch.nn.Module, val, micro_batch: int, device: torch.device, precision: str
) -> float:
    """Mean loss per token over the first EVAL_TOKENS tokens of the held-out split (the same
    sequences every time, so eval losses of a run compare with each other)."""
    from ..data.tokens import eval_batches
    from ..engine.precision import autocast_dtype

    was_training = model.training
    model.eval()
    loss_sum, tokens = 0.0, 0
    for batch in eval_batches(val, micro_batch, max(1, EVAL_TOKENS // val.seq_len)):
        with devices.autocast(device, autocast_dtype(precision)):
            s, n = causal_lm_loss(model, _to_device(batch, device))
        loss_sum += float(s)
        tokens += int(n)
    model.train(was_training)
    return loss_sum / max(tokens, 1)


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The model itself, under DDP's `module` and torch.compile's `_orig_mod`."""
    model = getattr(model, "module", model) if sync.is_ddp(model) else model
    return getattr(model, "_orig_mod", model)


class Run:
    """One training run, from its checked inputs to its summary.

    `Run.build` reads the data and the model and plans the batch (a resume also opens its
    checkpoint and judges what changed); `train` then restores, starts, loops over
    `train_step` (one window) with `evaluate_now` and `save` between windows, and `finish`es.
    """

    def __init__(self, config, rank_info, console, data, model, model_info, resolved, ckpt):
        self.config, self.rank_info, self.console = config, rank_info, console
        self.device = rank_info.device
        self.is_main = rank_info.rank == 0
        self.train_set, self.val_set, self.data_info = data
        self.model_info, self.resolved, self.ckpt = model_info, resolved, ckpt
        self.k, self.total = resolved.accum_steps, resolved.total_steps
        self.micro_batch = resolved.micro_batch
        """Sequences per micro-batch as trained now: out of memory mid-window halves it."""
        self.micro_index = -1
        """The micro-batch of the window in progress (-1 before its first)."""
        self.notes: list[str] = []  # what a resume changed, one line each
        self.batching = make_batching(
            config, self.micro_batch, rank_info.world_size, resolved.accum_steps
        )
        """k of each window: fixed, or by --batch-schedule (`gradaccum.train.batching`)."""
        self.total_tokens = config.max_tokens or DEFAULT_MAX_TOKENS
        """With a batch schedule, the run ends once it has trained on this many tokens."""
        self.schedule = Schedule(resolved.total_steps, resolved.warmup_steps, config.schedule)
        if self.batching.varies:
            self.k = self.batching.next_k(0)
            self.total = self.batching.steps_left(0, self.total_tokens)
            self.schedule = token_schedule(config, self.total_tokens, self.tokens_per_step)
        self.model = self._place(model)
        self.optimizer = _optimizer(self.model, config)
        self.state = RunState()
        self.metrics: MetricsWriter | None = None
        self.tensorboard = None  # a TensorBoardWriter on rank 0 with --tensorboard
        self.progress: Progress | None = None  # the bar or log lines, while the loop runs
        self.lock = RunLock(config.out)
        self.started = time.perf_counter()

    @classmethod
    def build(cls, config: TrainConfig, rank_info: RankInfo) -> Run:
        console = Console(enabled=rank_info.rank == 0, quiet=config.json)
        ckpt = resume.open_checkpoint(config, console.say) if config.resume else None
        if ckpt is not None:
            resume.check_metrics(config, ckpt)
        torch.manual_seed(config.seed)
        data = _load_data(config)
        model, model_info = _build_model(config, data[2], ckpt)
        notes, plan_config = [], config
        if ckpt is None and _measures_micro_batch(config, rank_info):
            plan_config = measure_micro_batch(config, model, data[0], rank_info, console.say)
        if ckpt is not None:
            notes = resume.check_data(config, ckpt, data[2])
            plan_config = resume.batch_config(config, ckpt, rank_info.world_size)
        resolved = resolve_plan(  # a schedule's plan: its first batch, its lr rule, by phase
            plan_config,
            model_info,
            rank_info.world_size,
            rank_info.device,
            batch_schedule=None if config.batch_schedule == AUTO else config.batch_schedule,
        )
        run = cls(config, rank_info, console, data, model, model_info, resolved, ckpt)
        if ckpt is not None and run.batching.varies:
            run.schedule, length_notes = resume.token_schedule(config, ckpt, run.total_tokens)
        elif ckpt is not None:
            run.schedule, length_notes = resume.schedule(config, ckpt, resolved)
        if ckpt is not None:
            batch = resume.batch_line(ckpt, resolved)
            run.notes = notes + length_notes + ([batch] if batch else [])
            run.notes += resume.applied_changes(config, ckpt)
        run._assemble()
        return run

    def _place(self, model: torch.nn.Module) -> torch.nn.Module:
        config = self.config
        model.to(self.device)
        if config.activation_checkpointing:
            if hasattr(model, "set_activation_checkpointing"):
                model.set_activation_checkpointing(True)
            else:
                model.gradient_checkpointing_enable()
        if config.compile:  # before DDP, so the engine still sees DDP and its no_sync
            model = torch.compile(model)
        if self.rank_info.world_size > 1:
            from torch.nn.parallel import DistributedDataParallel

            ids = [self.device.index] if self.device.type not in ("cpu", "mps") else None
            model = DistributedDataParallel(model, device_ids=ids)
        return model

    def _assemble(self) -> None:
        from ..data.tokens import Batches

        config = self.config
        self.scheduler = make_scheduler(self.optimizer, self.schedule)
        self.acc = Accumulator(
            self.model,
            self.optimizer,
            self.scheduler,
            max_grad_norm=config.max_grad_norm or None,
            precision=config.precision,
            noise_scale=config.noise_scale,
        )
        self.batches = Batches(
            self.train_set,
            self.resolved.micro_batch,
            config.seed,
            rank=self.rank_info.rank,
            world_size=self.rank_info.world_size,
        )

    @property
    def tokens_per_step(self) -> int:
        """Tokens of the next (or last) window over all ranks: micro x seq x k x world."""
        return self.micro_batch * self.config.seq_len * self.k * self.rank_info.world_size

    def _finished(self) -> bool:
        if self.batching.varies:
            return self.state.tokens >= self.total_tokens
        return self.acc.steps >= self.total

    def _next_window(self) -> None:
        """With a batch schedule: k and the lr of the window about to start (both follow
        from the tokens seen, and for `auto` the checkpointed growth, so a resume repeats them)."""
        if not self.batching.varies:
            return
        seen = self.state.tokens
        self.k = self.batching.next_k(seen)
        # In warmup, the lr reached by the window's end (as step-counted warmup's first step
        # takes lr / warmup_steps, not 0); after it, the decay where the window starts.
        at = seen + self.tokens_per_step - 1 if seen < self.schedule.warmup_steps else seen
        factor = self.schedule(at) * self.batching.lr_factor()
        for group in self.optimizer.param_groups:
            group["lr"] = self.config.lr * factor

    # ---- restore, start ----------------------------------------------------------------

    def restore(self) -> None:
        """Continue exactly where the checkpoint stopped, with the changes `notes` names."""
        state, config = self.ckpt.trainer_state, self.config
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        # The optimizer's saved hyperparameters give way to the settings as (re)given.
        self.scheduler.base_lrs = [config.lr] * len(self.optimizer.param_groups)
        for group in self.optimizer.param_groups:
            group["initial_lr"] = config.lr
            group["lr"] = config.lr * self.schedule(self.scheduler.last_epoch)
        self.optimizer.param_groups[0]["weight_decay"] = config.weight_decay
        self.acc.load_state_dict(state["accumulator"])
        try:
            self.batches.load_state_dict(state["data"], other_data=config.allow_data_change)
        except ValueError as err:
            raise BadInput("--resume", config.out, str(err)) from None
        checkpoint.set_rng_state(state["rng"])
        self.state = RunState(**state["progress"])
        if self.batching.varies:
            self.batching.load_state_dict(state["batching"])
            self.k = self.batching.next_k(self.state.tokens)
            self._count_steps()

    def start(self) -> None:
        """Say what is about to happen, take the folder's lock, write train.toml. No room on
        the disk for any of it: RunFailed in one line, and a new run's start leaves nothing."""
        config, info, say = self.config, self.data_info, self.console.say
        say(self.resolved.table)
        say(f"model  {self.model_info.source}: {self.model_info.params:,} parameters")
        floor = info.entropy_floor
        say(
            f"data   {info.source}: vocab {info.vocab_size}, ln V = {math.log(info.vocab_size):.3f}"
            + (f", entropy floor {floor:.3f} nats/token" if floor is not None else "")
        )
        resuming = f", resuming at step {self.acc.steps}" if self.ckpt is not None else ""
        say(f"device {self.device}, precision {config.precision}, out {config.out}{resuming}")
        if self.device.type == "cpu" and config.precision != "fp32":
            say(
                f"note: {config.precision} on CPU is usually several times slower than fp32 "
                "(few CPUs have fast low-precision matmuls); fp32 is the faster choice here"
            )
        for line in self.notes:
            say(f"resume: {line}")
        # A new run's start that meets a full disk leaves --out as it was: what it made goes.
        undo = checks.undo_start(config.out) if self.ckpt is None and self.is_main else None
        try:
            self._take_lock()
            if self.is_main:
                self._open_files()
        except DiskFull as err:
            self.lock.release()
            if undo is not None:
                undo()
            if self.ckpt is not None:
                raise RunFailed(
                    f"{err}; the run did not resume, {config.out} is as it was"
                ) from None
            raise RunFailed(f"{err}; the run did not start and left nothing behind") from None

    def _open_files(self) -> None:
        """train.toml, metrics.jsonl and, with --tensorboard, its event file."""
        config = self.config
        write_text_atomic(os.path.join(config.out, "train.toml"), to_toml(config.chosen()))
        keep = self.ckpt.trainer_state["metrics_lines"] if self.ckpt is not None else None
        self.metrics = MetricsWriter(os.path.join(config.out, "metrics.jsonl"), keep)
        if config.tensorboard:
            from .tensorboard import TensorBoardWriter

            # Events past the checkpoint's step came after it and will be written again.
            purge = self.acc.steps + 1 if self.ckpt is not None else None
            self.tensorboard = TensorBoardWriter(config.out, purge_step=purge)

    def write_record(self, record: dict) -> None:
        """One metrics record into metrics.jsonl and, with --tensorboard, TensorBoard. No
        room for metrics.jsonl stops the run (RunFailed naming the checkpoint still there: a
        run without its metrics would not resume exactly); no room for TensorBoard's file
        turns TensorBoard off, said in one line, and the run goes on."""
        try:
            self.metrics.write(record)  # whole lines only: the file ends at the last whole one
        except DiskFull as err:
            raise RunFailed(
                f"{err} at step {record['step']}; the run stopped, {self._kept('free space and ')}"
            ) from None
        if self.tensorboard is not None:
            try:
                self.tensorboard.write(record)
            except DiskFull as err:
                self._close_tensorboard()
                self.not_written["tensorboard/"] = f"past step {record['step'] - 1}: {err.reason}"
                self.progress.note(
                    f"{err}; TensorBoard is off from step {record['step']}, "
                    "metrics.jsonl goes on holding every field"
                )

    def _kept(self, fix: str = "") -> str:
        """The checkpoint a run that cannot go on leaves, and the command to go on from it."""
        out = self.config.out
        if self.saved_step is None:
            return f"no checkpoint was written yet: {fix}start again with --out {out}"
        return (
            f"the checkpoint at step {self.saved_step} is still there: {fix}continue with: "
            f"gradaccum train --resume --out {out}"
        )

    def _close_tensorboard(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None

    def _take_lock(self) -> None:
        failed = None
        if self.is_main:
            try:
                self.lock.acquire()
            except (BadInput, DiskFull) as err:
                failed = err
        # Every rank leaves with the same error, or none of them waits on the others.
        if sync.max_over_ranks(int(failed is not None)):
            raise failed or BadInput("--out", self.config.out, "in use by a running run")

    # ---- the loop ----------------------------------------------------------------------

    def train(self, should_stop: Callable[[int], bool] | None) -> dict:
        """Restore, start, loop, finish. A second Ctrl-C is a KeyboardInterrupt whose text
        says at which step and which checkpoint is still there (exit 130, one line)."""
        self.saved_step = self.ckpt.step if self.ckpt is not None else None
        """The step of the newest checkpoint on disk (None before the first)."""
        self.not_written: dict[str, str] = {}  # file -> why, for the closing line
        self.failed_save: tuple[int, str] | None = None  # the last save that failed, and why
        with StopSignals() as signals:
            if self.ckpt is not None:
                self.restore()
            try:
                self.start()
                stopped = self._loop(signals, should_stop)
            except KeyboardInterrupt as err:
                self._abandon_files()
                raise self._interrupt(err) from None
            except BaseException as err:
                self._abandon_files()
                if signals.interrupted or interrupted(err):  # a Ctrl-C a library reworded
                    raise self._interrupt(KeyboardInterrupt()) from None
                lost = self._lost(err) if isinstance(err, RuntimeError) else None
                if lost is None:
                    raise
                raise lost from None
            finally:
                self._close_tensorboard()
            try:  # still under the signals: one Ctrl-C here lets the run finish, two stop it
                return self.finish(stopped)
            except BaseException as err:
                if not (signals.interrupted or interrupted(err)):
                    raise
                raise KeyboardInterrupt(
                    f"while finishing at step {self.acc.steps}; {self._kept()}"
                ) from None
            finally:
                self.lock.release()

    def _abandon_files(self) -> None:
        """On the way out of a run that did not finish: the lock released, metrics closed."""
        self.lock.release()
        if self.metrics is not None:
            self.metrics.close()

    def _interrupt(self, err: KeyboardInterrupt) -> KeyboardInterrupt:
        """A second Ctrl-C, with the words `gradaccum: interrupted` is followed by."""
        if str(err):  # save() said what it left
            return err
        return KeyboardInterrupt(f"at step {self.acc.steps}; {self._kept()}")

    def _lost(self, err: RuntimeError) -> RanksLost | None:
        """A collective that failed because another rank died or stopped answering, as one
        line; None for any other error."""
        if self.rank_info.world_size == 1 or not peer_lost(err):
            return None
        text = first_line(err)
        return RanksLost(
            f"rank {self.rank_info.rank} of {self.rank_info.world_size}: another rank stopped "
            f"answering (it died or hangs; --dist-timeout {self.config.dist_timeout:g} s) at step "
            f"{self.acc.steps}: {text}"
        )

    def _loop(self, signals: StopSignals, should_stop) -> str | None:
        self.progress = Progress(self.console, self.total, self.acc.steps, self.k)
        self.first_step = self.last_saved = self.acc.steps
        self.here = time.perf_counter()  # this process's start, for the ETA
        self.loop_start = self.here - self.state.elapsed_s
        skipped_in_a_row, stopped = 0, None
        try:
            while not self._finished():
                result = self.train_step(signals)
                if result is None:  # a stop request arrived mid-window
                    stopped = signals.requested or "another rank"
                    break
                self.record(result)
                skipped_in_a_row = skipped_in_a_row + 1 if result.skipped else 0
                if skipped_in_a_row >= DIVERGED_WINDOWS:
                    raise RuntimeError(
                        f"{DIVERGED_WINDOWS} windows in a row had a non-finite loss or gradient "
                        f"(last loss {result.loss}); training diverged"
                    )
                if not result.skipped and self._eval_due():
                    self.evaluate_now()
                stop = signals.requested or (
                    "request" if should_stop and should_stop(self.acc.steps) else None
                )
                if bool(sync.max_over_ranks(int(stop is not None))):
                    stopped = stop or "another rank"
                    break
                if self.config.save_every and self.acc.steps % self.config.save_every == 0:
                    self.save()
        finally:
            self.progress.close()
        self.save()
        return stopped

    def train_step(self, signals: StopSignals) -> StepResult | None:
        """One window: k micro-batches forward and backward, one optimizer step. None when a
        stop request came mid-window: the window is abandoned (nothing stepped, nothing
        counted) and the data and RNG rewound to its start, as the last checkpoint would be.
        Out of memory mid-window: the window is abandoned and rewound the same way, then
        redone from its first micro-batch with half the micro-batch and twice k (the same
        tokens per step), see `shrink_micro_batch`."""
        t0 = time.perf_counter()
        self._next_window()
        position, rng = self.batches.position, checkpoint.rng_state()
        while True:
            try:
                result = self._window(signals)
                failed = None
            except devices.out_of_memory_errors() as err:
                failed = first_line(err)
            # Rewound outside the handler: its traceback holds the window's tensors.
            if failed is None and isinstance(result, StepResult):
                break
            if failed is not None:
                self._tell_ranks_out_of_memory(failed)
            self.acc.abandon_window()
            self.batches.position = position
            checkpoint.set_rng_state(rng)
            if failed is None and result is None:
                return None
            self.shrink_micro_batch(failed or "on another rank")
            position = self.batches.position
        devices.synchronize(self.device)
        self.step_s = time.perf_counter() - t0
        return result

    def _window(self, signals: StopSignals) -> StepResult | str | None:
        """The window's StepResult; None on a stop request, PEER_OUT_OF_MEMORY when another
        rank ran out of memory (every rank then redoes the window smaller)."""
        self.micro_index = -1  # before the micro-batches
        micro_batches = [_to_device(next(self.batches), self.device) for _ in range(self.k)]
        window = self.acc.begin_window(micro_batches)  # counts the window's tokens over ranks
        for self.micro_index, micro_batch in enumerate(micro_batches):
            agreed = self._agree(signals)
            if agreed == OUT_OF_MEMORY:
                return PEER_OUT_OF_MEMORY
            if agreed == STOP:
                return None
            with window.micro_step():  # autocast; gradients sync on the last micro-batch only
                loss_sum, num_tokens = causal_lm_loss(self.model, micro_batch)
                window.backward(loss_sum, num_tokens)  # scaled by world / N of the window
        return window.finish()  # clip, optimizer and scheduler step, zero_grad: once

    def _tell_ranks_out_of_memory(self, error: str) -> None:
        """Under torchrun, after this rank ran out of memory on micro-batch i: the others are
        about to agree before micro-batch i+1 (`_agree`), so this rank joins that agreement
        with OUT_OF_MEMORY and all redo the window. On the window's last micro-batch the
        others may already be in the gradients' all-reduce: nothing to join, the run stops."""
        if self.rank_info.world_size == 1:
            return
        if not 0 <= self.micro_index < self.k - 1:
            smaller = _smaller_micro_batch(self.micro_batch)
            advice = (
                f"--resume --micro-batch {smaller}" if smaller else "--activation-checkpointing"
            )
            raise RunFailed(
                f"rank {self.rank_info.rank}: out of memory in step {self.acc.steps + 1} "
                f"outside the window's first k-1 micro-batches ({error}), where the ranks "
                f"cannot redo it together; continue with {advice} (the tokens per step stay)"
            )
        sync.max_over_ranks(OUT_OF_MEMORY)

    def shrink_micro_batch(self, error: str) -> None:
        """After out of memory mid-window: the largest micro-batch of at most half the
        sequences that divides the old one, k up by the same factor (tokens per step
        unchanged), the device's cache emptied, the event in metrics.jsonl and on the console.
        Every rank does the same (they agreed in `_agree`)."""
        old, step = self.micro_batch, self.acc.steps + 1
        smaller = _smaller_micro_batch(old)
        if smaller is None:
            raise RunFailed(
                f"rank {self.rank_info.rank}: out of memory in step {step} at micro-batch "
                f"{old} ({error}); try --activation-checkpointing or a shorter --seq-len"
            )
        gc.collect()
        devices.empty_cache(self.device)
        self.k = self.k * old // smaller
        self.micro_batch = smaller
        self.batches.set_micro_batch(smaller)
        self.batching.set_micro_tokens(smaller * self.config.seq_len, self.k)
        if self.batching.varies:
            self._count_steps()
        line = (
            f"step {step}: out of memory at micro-batch {old} ({error}); redoing the window "
            f"with micro-batch {smaller} x k {self.k}, the same tokens per step"
        )
        self.progress.note(line)
        if self.is_main:
            self.write_record(
                {
                    "step": step,
                    "event": "out_of_memory",
                    "micro_batch": smaller,
                    "accum_steps": self.k,
                    "elapsed_s": time.perf_counter() - self.loop_start,
                }
            )

    def _agree(self, signals: StopSignals) -> int:
        """Before each micro-batch: GO, STOP (a stop request) or OUT_OF_MEMORY (a rank ran
        out of memory on the micro-batch before), the same on every rank: ranks must abandon
        the same micro-step, or one waits in the last one's all-reduce."""
        here = STOP if signals.requested is not None else GO
        if self.rank_info.world_size == 1:
            return here
        return sync.max_over_ranks(here)

    def record(self, result: StepResult) -> None:
        """The window's numbers into the run's state, metrics.jsonl and the progress line."""
        st, dt, now = self.state, self.step_s, time.perf_counter()
        st.tokens += result.tokens
        st.train_s += dt
        st.elapsed_s = now - self.loop_start
        if st.initial_loss is None:
            st.initial_loss = result.loss
        if self.is_main:
            self.write_record(
                {
                    "step": result.step,
                    "loss": result.loss,
                    "tokens": st.tokens,
                    "tokens_per_s": result.tokens / dt,
                    "lr": result.lr,
                    "grad_norm": result.grad_norm,
                    "accum_steps": self.k,
                    "micro_batch": self.micro_batch,
                    "tokens_per_step": result.tokens,
                    "skipped": result.skipped,
                    "elapsed_s": st.elapsed_s,
                    **_noise_fields(result),
                }
            )
        done_here = result.step - self.first_step
        self.progress.accum_steps = self.k
        if self.batching.varies:
            self._follow_batching(result)
        self.progress.update(
            result.step, result.loss, result.tokens, dt, result.lr, now - self.here, done_here
        )

    def _follow_batching(self, result: StepResult) -> None:
        """After a window of a batch-schedule run: `auto` may grow k, and the steps left
        with it."""
        noise = result.noise
        if self.batching.after_window(result.step, noise.b_simple_tokens if noise else None):
            self.progress.note(
                f"step {result.step}: critical batch about {fmt_count(noise.b_simple_tokens)} "
                f"tokens: k {self.k} -> {self.batching.k} "
                f"({fmt_count(self.batching.k * self.batching.per_micro_step)} tokens per step)"
            )
            self._count_steps()

    def _count_steps(self) -> None:
        """A batch-schedule run's total steps from where it stands (they change only when
        `auto` grows k or the micro-batch shrinks)."""
        self.total = self.acc.steps + self.batching.steps_left(self.state.tokens, self.total_tokens)
        if self.progress is not None:
            self.progress.total = self.total

    def _eval_due(self) -> bool:
        step, every = self.acc.steps, self.config.eval_every
        return self.is_main and (self._finished() or bool(every and step % every == 0))

    def evaluate_now(self) -> None:
        loss = evaluate(
            _unwrapped(self.model),
            self.val_set,
            self.micro_batch,
            self.device,
            self.config.precision,
        )
        self.write_record(
            {
                "step": self.acc.steps,
                "tokens": self.state.tokens,
                "eval_loss": loss,
                "elapsed_s": time.perf_counter() - self.loop_start,
            }
        )
        self.progress.note(f"step {self.acc.steps}: eval loss {loss:.4f}")

    # ---- save, finish ------------------------------------------------------------------

    def trainer_state(self) -> dict:
        """Everything but the weights that the run needs to continue exactly."""
        return {
            "step": self.acc.steps,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "accumulator": self.acc.state_dict(),
            "data": self.batches.state_dict(),
            "data_fingerprint": self.data_info.fingerprint,
            "rng": checkpoint.rng_state(),
            "config": self.config.to_dict(),
            "plan": {
                **self.resolved.summary(),
                "micro_batch": self.micro_batch,
                "accum_steps": self.k,
            },
            "schedule": self.schedule.state_dict(),
            "batching": self.batching.state_dict(),
            "metrics_lines": self.metrics.lines,
            "progress": asdict(self.state),
        }

    def save(self) -> None:
        """A checkpoint of the last finished window, unless one of it exists. A failed write
        (a full disk) leaves the previous checkpoint and is said in one line; training goes on.
        A second Ctrl-C during the write leaves the previous one too, nothing half-written,
        and says so in the KeyboardInterrupt's text."""
        step = self.acc.steps
        if step == self.last_saved:
            return
        if self.is_main:
            try:
                checkpoint.save(
                    self.config.out,
                    step,
                    _unwrapped(self.model).state_dict(),
                    self.model_info.config,
                    self.trainer_state(),
                    run_config=self.config.to_dict(),
                    keep=self.config.keep_checkpoints,
                )
            except KeyboardInterrupt:
                raise self._interrupted_save(step) from None
            except (OSError, DiskFull) as err:
                why = err.reason if isinstance(err, DiskFull) else err.strerror or first_line(err)
                self.failed_save = (step, why)
                self.progress.note(
                    f"checkpoint at step {step} not written ({why}); {self._older()}"
                )
            else:
                self.saved_step = step
        else:
            self.saved_step = step  # rank 0 writes it; the others cannot tell
        if self.rank_info.world_size > 1:
            dist.barrier()
        self.last_saved = step

    def _older(self) -> str:
        root = os.path.join(self.config.out, checkpoint.CHECKPOINTS)
        if self.saved_step is None:
            return f"none is in {root} yet"
        path = os.path.join(root, f"step-{self.saved_step:08d}")
        return f"the one at step {self.saved_step} is still there ({path})"

    def _interrupted_save(self, step: int) -> KeyboardInterrupt:
        """A Ctrl-C during the save of `step`: made current before it landed (pruning the
        older ones), or not made at all."""
        root = os.path.join(self.config.out, checkpoint.CHECKPOINTS)
        if checkpoint.read_latest_name(root) == f"step-{step:08d}":
            self.saved_step = step
            return KeyboardInterrupt(f"after the checkpoint at step {step}; {self._kept()}")
        return KeyboardInterrupt(
            f"during the checkpoint at step {step}, which was not written; {self._kept()}"
        )

    def finish(self, stopped: str | None) -> dict:
        """Export the model (a finished run only), plot the losses, return the summary, with
        the files written (`files`) and those not, and why (`not_written`). No room for the
        export ends the run in one line (RunFailed) naming the checkpoint still there."""
        config, step = self.config, self.acc.steps
        if stopped:
            self.console.say(self._stopped_line(stopped))
        records, files = [], []
        if self.is_main:
            self.metrics.close()
            records = read_metrics(os.path.join(config.out, "metrics.jsonl"))
            files = ["metrics.jsonl", "train.toml"]
            if stopped is None:
                try:
                    state = _unwrapped(self.model).state_dict()
                    checkpoint.save_model(config.out, state, self.model_info.config)
                except DiskFull as err:
                    raise RunFailed(
                        f"{err}; the run trained to step {step}/{self.total} but its model is "
                        f"not exported, {self._kept('free space and ')}"
                    ) from None
                files += ["model.pt", "config.json"]
            files += self._plot(records)
            if config.tensorboard and "tensorboard/" not in self.not_written:
                files.append("tensorboard/")
            files += ["checkpoints/"] if self.saved_step is not None else []
        line = self.critical_batch_line()
        if line:
            self.console.say(line)
        summary = self.summary(records, stopped)
        summary["files"] = files
        summary["not_written"] = dict(self.not_written)
        return summary

    def _stopped_line(self, stopped: str) -> str:
        head = f"stopped by {stopped} at step {self.acc.steps}/{self.total}"
        if self.saved_step == self.acc.steps:
            return (
                f"{head}; checkpoint saved, continue with: gradaccum train --resume "
                f"--out {self.config.out}"
            )
        failed = self.failed_save
        if failed is not None and failed[0] == self.acc.steps:
            kept = self._kept("free space and ")
            return f"{head}; its checkpoint was not written ({failed[1]}), {kept}"
        return f"{head}, before its first window: nothing to save; {self._kept()}"

    def _plot(self, records: list[dict]) -> list[str]:
        """loss.png: ["loss.png"] once written, else [] and why in `not_written`."""
        try:
            written = plot_loss(
                records,
                os.path.join(self.config.out, "loss.png"),
                self.data_info.entropy_floor,
                title=self._plot_title(records),
            )
        except DiskFull as err:
            self.not_written["loss.png"] = err.reason
            return []
        if not written:
            self.not_written["loss.png"] = "matplotlib not installed: pip install 'gradaccum[plot]'"
        return ["loss.png"] if written else []

    def _plot_title(self, records: list[dict]) -> str:
        if not self.batching.varies:
            return (
                f"{self.model_info.source}, {self.tokens_per_step:,} tokens/step "
                f"(b {self.micro_batch} x k {self.k} x world {self.rank_info.world_size})"
            )
        sizes = [r["tokens_per_step"] for r in records if "tokens_per_step" in r] or [0]
        return (
            f"{self.model_info.source}, {fmt_count(sizes[0])} -> {fmt_count(sizes[-1])} "
            f"tokens/step (--batch-schedule {self.config.batch_schedule})"
        )

    def critical_batch_line(self) -> str | None:
        """With --noise-scale: the estimated critical batch against this run's, in one line;
        None before the first estimate."""
        last = self.acc.noise.last if self.acc.noise is not None else None
        if last is None or not math.isfinite(last.b_simple_tokens):
            return None
        critical, here = last.b_simple_tokens, self.tokens_per_step
        if critical <= 0:
            return None
        if here < critical / 2:
            meaning = (
                "below it, larger batches buy about proportionally fewer steps: the next run "
                "can take more tokens per step for little more compute"
            )
        elif here > 2 * critical:
            meaning = (
                "far above it, much of each step's compute is wasted: the next run can take "
                "fewer tokens per step and more steps for the same loss"
            )
        else:
            meaning = (
                "near it; below it larger batches buy proportionally fewer steps, far above it "
                "compute is wasted"
            )
        return (
            f"critical batch about {fmt_count(critical)} tokens (noise scale), this run "
            f"{fmt_count(here)} tokens per step: {meaning}"
        )

    def summary(self, records: list[dict], stopped: str | None) -> dict:
        """The --json object. Losses are nats per token: initial_loss of the run's first
        window, final_loss of its last, final_eval_loss on the held-out split. tokens_per_s
        counts only time inside training windows (not eval, saving or start-up); wall_s is
        this process's whole time. Ranks other than 0 read no metrics and report no losses."""
        train_lines = [r for r in records if "loss" in r]
        eval_lines = [r for r in records if "eval_loss" in r]
        st, r, info = self.state, self.resolved, self.data_info
        return {
            "initial_loss": st.initial_loss,
            "final_loss": train_lines[-1]["loss"] if train_lines else None,
            "final_eval_loss": eval_lines[-1]["eval_loss"] if eval_lines else None,
            "entropy_floor": info.entropy_floor,
            "ln_vocab": math.log(info.vocab_size),
            "steps": self.acc.steps,
            "total_steps": self.total,
            "tokens": st.tokens,
            "tokens_per_s": st.tokens / max(st.train_s, 1e-9),
            "skipped": sum(1 for x in train_lines if x.get("skipped")),
            "wall_s": time.perf_counter() - self.started,
            "micro_batch": self.micro_batch,
            "accum_steps": self.k,
            "world_size": r.world_size,
            "tokens_per_step": self.tokens_per_step,
            "batch_schedule": self.config.batch_schedule,
            "params": self.model_info.params,
            "device": str(self.device),
            "precision": self.config.precision,
            "stopped": stopped,
            "noise_scale_tokens": self._noise_tokens(),
            "out": self.config.out,
        }

    def _noise_tokens(self) -> float | None:
        last = self.acc.noise.last if self.acc.noise is not None else None
        if last is None or not math.isfinite(last.b_simple_tokens):
            return None
        return last.b_simple_tokens


def _smaller_micro_batch(micro_batch: int) -> int | None:
    """The micro-batch to redo a window with after out of memory: the largest divisor of
    at most half of `micro_batch` (so k grows by a whole factor); None at 1."""
    return next((b for b in range(micro_batch // 2, 0, -1) if micro_batch % b == 0), None)


def _noise_fields(result: StepResult) -> dict:
    """noise_scale_tokens and noise_scale_sequences of a window, where they are finite."""
    noise = result.noise
    if noise is None:
        return {}
    fields = {
        "noise_scale_tokens": noise.b_simple_tokens,
        "noise_scale_sequences": noise.b_simple_sequences,
    }
    return {k: v for k, v in fields.items() if v is not None and math.isfinite(v)}
