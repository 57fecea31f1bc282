"""`gradaccum train`: a model trained by its task at a fixed batch per optimizer step.

A run is built first (`build`: checks, data, model, plan: everything that can still reject
the input, before anything is written). `Run` then trains one window at a time: the task's
window of micro-batches, forward and backward each (the task's summed loss and its count;
the engine divides once by the window's count over every micro-batch and rank), one
optimizer step, a metrics line; evaluated and saved every so often; finished with the
model's export, the plot and the summary.

What differs between pretraining, fine-tuning and RL is the task's (`gradaccum.train.tasks`:
the protocol, the three built-in tasks, a user's own by --task MODULE:CLASS); the rest is
here and in its parts: the batch as it trains (`batch_state`), what a checkpoint holds
(`payload`), out-of-memory recovery (`recovery`), the files in --out (`outputs`), the
closing words (`summary`), a mixture of experts' load-balancing term (`moe`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from gradaccum.engine.accumulator import Accumulator, StepResult
from gradaccum.grpo.rewards import RewardError
from gradaccum.parallel import collectives, devices
from gradaccum.parallel.process_group import RankInfo, init_distributed, teardown
from gradaccum.train import build, moe, parts, summary
from gradaccum.train.checks import prepare
from gradaccum.train.config import TrainConfig
from gradaccum.train.console import Clock, Progress, StopSignals
from gradaccum.train.evaluation import evaluate
from gradaccum.train.evaluation import to_device as _to_device
from gradaccum.train.objective import TaskObjective
from gradaccum.train.recovery import OUT_OF_MEMORY, PEER_OUT_OF_MEMORY, STOP, Recovery, lost_rank
from gradaccum.train.rundir import best, payload
from gradaccum.train.rundir.metrics import window_record
from gradaccum.train.rundir.payload import RunState
from gradaccum.train.schedule import make_scheduler
from gradaccum.train.tasks import Begin, task_class
from gradaccum.utils.atomic import interrupted
from gradaccum.utils.errors import BadInput, RunFailed, first_line, release_frames

__all__ = ["TrainConfig", "evaluate", "prepare", "train"]

DIVERGED_WINDOWS = 50
"""Windows in a row with a non-finite loss or gradient after which the run gives up."""


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
        first = getattr(task_class(config.task), "first_stage", None)
        if first is not None:  # a stage before the run (--task grpo's SFT warm start)
            stage = lambda stage_config: _run(stage_config, rank_info, should_stop)  # noqa: E731
            config, stopped = first(config, rank_info, stage)
            if stopped is not None:
                return stopped
        return Run.build(config, rank_info).train(should_stop)
    except BaseException as err:
        release_frames(err)  # the run's model, held by its frames, freed before the group
        raise
    finally:
        teardown(rank_info)


def _run(config: TrainConfig, rank_info: RankInfo, should_stop) -> dict:
    return Run.build(prepare(config), rank_info).train(should_stop)


class Run:
    """One training run, from its built parts (`build.Built`) to its summary: `train`
    starts, loops over `train_step` (one window) with `evaluate_now` and `save` between
    windows, and `finish`es."""

    def __init__(self, built: build.Built):
        self.config, self.rank_info, self.console = built.config, built.rank_info, built.console
        self.task, self.data, self.model_info = built.task, built.data, built.model_info
        self.resolved, self.batch, self.schedule = built.resolved, built.batch, built.schedule
        self.outputs, self.notes = built.outputs, built.notes
        config = self.config
        self.sharded = self.resolved.shards_model  # micro or hsdp: FSDP2 on every rank
        self.model = parts.place(built.model, config, self.rank_info, self.resolved.sync)
        self.moe = moe.make(config, self.model)  # None for a dense model
        self.task.begin(Begin(self.model, self.model_info, self.batch.total, self.moe is None,
                              self.data))  # fmt: skip
        self.objective = self.moe or TaskObjective(self.task)
        self.optimizer = parts.optimizer(self.model, config)
        self.scheduler = make_scheduler(self.optimizer, self.schedule)
        self.acc = Accumulator(self.model, self.optimizer, self.scheduler,
                               max_grad_norm=config.max_grad_norm or None,
                               precision=config.precision, noise_scale=config.noise_scale,
                               sync=self.resolved.sync,
                               count_tokens=self.task.count_tokens)  # fmt: skip
        self.batches = self.task.stream(self.data, self.batch.micro_batch)
        self.recovery = Recovery(self.acc, self.batches, self.batch, self.rank_info, self._shrunk,
                                 config.dist_timeout, self.objective.abandon,
                                 self.resolved.sync if self.sharded else None)  # fmt: skip
        self.state = RunState()
        self.progress: Progress | None = None  # the bar or log lines, while the loop runs
        self.clock = Clock()
        if built.trainer_state is not None:  # continue exactly where the checkpoint stopped
            self.notes += payload.restore(self, built.trainer_state)

    @classmethod
    def build(cls, config: TrainConfig, rank_info: RankInfo) -> Run:
        """The run `config` asks for: continued from --out's checkpoint on --resume."""
        parts.check_sync(config, rank_info)
        return cls((build.resumed if config.resume else build.fresh)(config, rank_info))

    @property
    def device(self):
        return self.rank_info.device

    @property
    def is_main(self) -> bool:
        return self.rank_info.rank == 0

    def start(self) -> None:
        """Say what is about to happen, take the folder's lock, write config.yaml. No room on
        the disk for any of it: RunFailed in one line, and a new run's start leaves nothing."""
        table, task_lines = self.task.opening(self.data, self.batch, self.resolved)
        length = self.task.length_line(self.data, self.batch, self.resolved)
        lines = summary.opening_lines(self, table or self.resolved.table, length) + task_lines
        lines += self.moe.opening_lines() if self.moe is not None else []
        for line in lines:
            self.console.say(line)
        for line in self.notes:
            self.console.say(f"resume: {line}")
        self.outputs.open(self.acc.steps, self.batch.micro_batch)

    def write_record(self, record: dict) -> None:
        """One metrics record into metrics.jsonl (and TensorBoard), `Outputs.write`."""
        self.outputs.write(record, self.progress.note)

    def train(self, should_stop: Callable[[int], bool] | None) -> dict:
        """Start, loop, finish. A second Ctrl-C is a KeyboardInterrupt whose text says at
        which step and which checkpoint is still there (exit 130, one line)."""
        with StopSignals() as signals:
            try:
                self.start()
                stopped = self._loop(signals, should_stop)
            except KeyboardInterrupt as err:
                self.outputs.abandon()
                raise self._interrupt(err) from None
            except BaseException as err:
                self.outputs.abandon()
                if signals.interrupted or interrupted(err):  # a Ctrl-C a library reworded
                    raise self._interrupt(KeyboardInterrupt()) from None
                if isinstance(err, RewardError):  # --reward failed mid-run: what is kept
                    raise RunFailed(f"{err}; {self.outputs.kept('fix it, then ')}") from None
                lost = lost_rank(err, self.rank_info, self.config.dist_timeout, self.acc.steps)
                if lost is None:
                    raise
                raise lost from None
            finally:
                self.outputs.close_tensorboard()
            try:  # still under the signals: one Ctrl-C here lets the run finish, two stop it
                return summary.finish(self, stopped)
            except BaseException as err:
                if not (signals.interrupted or interrupted(err)):
                    raise
                raise KeyboardInterrupt(
                    f"while finishing at step {self.acc.steps}; {self.outputs.kept()}"
                ) from None
            finally:
                self.outputs.close_trackers()  # when finishing failed before finish_trackers
                self.outputs.lock.release()

    def _interrupt(self, err: KeyboardInterrupt) -> KeyboardInterrupt:
        """A second Ctrl-C, with the words `gradaccum: interrupted` is followed by."""
        if str(err):  # save() said what it left
            return err
        return KeyboardInterrupt(f"at step {self.acc.steps}; {self.outputs.kept()}")

    def _loop(self, signals: StopSignals, should_stop) -> str | None:
        self.progress = Progress(self.console, self.batch.total, self.acc.steps, self.batch.k)
        self.clock.start_loop(self.state.elapsed_s, self.acc.steps)
        skipped_in_a_row, stopped = 0, None
        if self.task.evaluates_first and self.acc.steps == 0 and self.is_main:
            self.evaluate_now()  # the starting model's figures, to compare
        try:
            while not self.batch.finished(self.acc.steps):
                done = self.train_step(signals)
                if done is None:  # a stop request arrived mid-window
                    stopped = signals.requested or "another rank"
                    break
                result = done[0]
                self.record(*done)
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
                if self.recovery.agree_between_windows(stop is not None):
                    stopped = stop or "another rank"
                    break
                if self.config.save_every and self.acc.steps % self.config.save_every == 0:
                    self.save()
        finally:
            self.progress.close()
        self.save()
        return stopped

    def train_step(self, signals: StopSignals) -> tuple[StepResult, float] | None:
        """One window: k micro-batches forward and backward, one optimizer step; its result
        and seconds. None when a stop request came mid-window: the window is abandoned
        (nothing stepped, nothing counted) and the data and RNG rewound to its start, as the
        last checkpoint would be. Out of memory mid-window: the window is abandoned and
        rewound the same way, then redone from its first micro-batch with half the
        micro-batch and twice k (the same tokens per step), see `gradaccum.train.recovery`."""
        t0 = time.perf_counter()
        factor = self.batch.next_window(self.schedule)
        if factor is not None:  # a batch schedule's window sets its own lr
            for group in self.optimizer.param_groups:
                group["lr"] = self.config.lr * factor
        result = self.recovery.run(lambda: self._window(signals))
        if result is None:
            return None
        devices.synchronize(self.device)
        return result, time.perf_counter() - t0

    def _window(self, signals: StopSignals) -> StepResult | str | None:
        """The window's StepResult; None on a stop request, PEER_OUT_OF_MEMORY when another
        rank ran out of memory (every rank then redoes the window smaller)."""
        self.recovery.begin_window()
        self.window = self.task.next_window(self.batches, self.batch.k)
        micro_batches = [_to_device(b, self.device) for b in self.window.micro_batches]
        stand_in = micro_batches[-1]  # repeated, weight 0, by a rank with fewer micro-batches
        if not self.window.shares:  # no example here: the stand-in only joins the
            micro_batches = []  # collectives, weight 0, routing no token
        objective, model = self.objective, self.model
        window = objective.begin_window(self.acc, model, micro_batches)  # counts over ranks
        self.batch.agreed(window.micro_steps)  # under torchrun, the most micro-batches a rank has

        def forward_backward(micro: dict, weight: float) -> None:  # autocast: window.micro_step
            objective.backward(window, model, micro, weight)  # the summed loss x world / N

        def agree(i: int) -> int | None:  # every rank ends the window at the same micro-step
            flag = self.recovery.agree(signals.requested is not None, i, window.micro_steps)
            return flag if flag in (STOP, OUT_OF_MEMORY) else None

        # the micro-steps (gradients sync on the last only), then clip, optimizer and
        # scheduler step, zero_grad: once
        result = window.run(micro_batches, forward_backward, stand_in, before_micro_step=agree)
        if not isinstance(result, StepResult):  # a stop or out of memory: window abandoned
            return PEER_OUT_OF_MEMORY if result == OUT_OF_MEMORY else None
        objective.end(result)
        return result

    def _shrunk(self, line: str, event: dict) -> None:
        """After out of memory shrank the batch: the line printed, the event recorded."""
        self.progress.total = self.batch.total
        self.progress.note(line)
        if self.is_main:
            self.write_record({**event, "elapsed_s": self.clock.elapsed()})

    def record(self, result: StepResult, seconds: float) -> None:
        """The window's numbers into the run's state, metrics.jsonl and the progress line."""
        st, now = self.state, time.perf_counter()
        self.batch.add_tokens(result.tokens)
        st.train_s += seconds
        st.elapsed_s = now - self.clock.loop_start
        if st.initial_loss is None:
            st.initial_loss = result.loss
        record = window_record(result, seconds, self.batch, st.elapsed_s)
        fields, words = self.task.record(result, self.window)
        record.update(fields)
        record.update(self.objective.record_fields())  # a balance's loss and the experts' load
        progress = self.objective.progress()  # None: nothing of its own to say
        words += [progress] if progress is not None else []
        if self.is_main:
            self.write_record(record)
        self.progress.accum_steps = self.batch.k
        grown = self.batch.follow_noise(result, self.acc.steps)  # --batch-schedule auto
        if grown:
            self.progress.note(grown)
            self.progress.total = self.batch.total
        self.progress.update(result.step, result.loss, result.tokens, seconds, result.lr,
                             now - self.clock.here, result.step - self.clock.first_step,
                             window="  ".join(words))  # fmt: skip

    def _eval_due(self) -> bool:
        step, every = self.acc.steps, self.config.eval_every
        finished = self.batch.finished(step)
        evaluates = self.is_main or self.sharded  # a sharded model's forward needs every rank
        return evaluates and (finished or bool(every and step % every == 0))

    def evaluate_now(self) -> None:
        """Rank 0 (every rank when the model is sharded, rank 0 alone writing): the task's
        evaluation into metrics.jsonl and a progress line; with --save-best a loss lower than
        any before makes this step's checkpoint the best (`save_best`). Nothing without an
        eval set (a single SFT example, --eval-fraction 0)."""
        if not len(self.data.val):
            return
        step = self.acc.steps
        model = parts.unwrapped(self.model)
        fields, lines = self.task.evaluate(model, self.data, self.batch.micro_batch)
        if self.is_main:
            record = {"step": step, "tokens": self.batch.tokens, **fields}
            self.write_record({**record, "elapsed_s": self.clock.elapsed()})
        if self.config.save_best and self._improved(fields["eval_loss"]):
            lines[0] += self.save_best(fields["eval_loss"])
        self.progress.note(f"step {step}: {lines[0]}")
        for line in lines[1:]:
            self.progress.note(line)

    def _improved(self, eval_loss: float) -> bool:
        """Whether `eval_loss` is the best so far, as rank 0 judges it (told to every rank of
        a sharded model, which all join the checkpoint's gather)."""
        improved = self.is_main and self.outputs.best.improved_by(eval_loss)
        if self.sharded:
            improved = bool(collectives.max_over_ranks(int(improved)))
        return improved

    def checkpoint_contents(self) -> tuple[dict, dict]:
        """What a checkpoint of the run as it stands holds: (model state_dict, trainer state);
        a sharded model's: (each rank's own shards, the trainer state on rank 0)."""
        return payload.checkpoint_contents(self)

    def save(self) -> None:
        """A checkpoint of the last finished window, unless one of it exists (`Outputs.save`)."""
        contents, config = self.checkpoint_contents, self.model_info.config
        self.outputs.save(self.acc.steps, contents, config, self.progress.note)

    def save_best(self, eval_loss: float) -> str:
        """--save-best, rank 0, after an evaluation at a new lowest `eval_loss`: this step's
        checkpoint written now as the best (`Outputs.save_best`); the words the eval line
        ends with."""
        found = best.Best(self.acc.steps, eval_loss, self.task.eval_fingerprint(self.data))
        contents, config = self.checkpoint_contents, self.model_info.config
        if self.outputs.save_best(found, contents, config, self.progress.note):
            return ", the best so far (checkpoint kept)"
        return ", the best so far (its checkpoint not written)"
