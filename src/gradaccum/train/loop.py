"""`gradaccum train`: a causal LM trained at a fixed tokens-per-step budget.

A `Run` is built (checks, data, model, plan: everything that can still reject the input,
before anything is written): a new one by `Run.fresh`, a resumed one by `Run.resumed`, which
also opens its checkpoint, judges what changed and restores the rest. It then trains one
window at a time: fetch the window's k micro-batches, forward and backward each, one
optimizer step, a metrics line; evaluated and saved every so often; finished with the model's
export, the plot and the summary.

With --task sft the same loop trains on examples: the data, the windows (a number of
examples or a budget of counted tokens per step, micro-batches padded to their longest) and
the evaluation come from `sft`; everything else is shared. --task grpo reads its prompts as
SFT examples and evaluates as SFT does; its windows (sampled, scored completions) and its
loss (`gradaccum.rl`) come from `grpo`.

The parts, each in its module: the batch as it trains (`batch_state`), how `--micro-batch
auto` is settled (`micro_batch`), what a checkpoint holds (`payload`), out-of-memory recovery
(`recovery`), the files in --out (`outputs`), the closing words (`summary`), a mixture of
experts' load-balancing loss (`moe`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from gradaccum import rl
from gradaccum.data.batches import Batches
from gradaccum.engine.accumulator import Accumulator, StepResult
from gradaccum.grpo.rewards import RewardError
from gradaccum.models.loss import causal_lm_loss
from gradaccum.parallel import collectives, devices
from gradaccum.parallel.process_group import RankInfo, init_distributed, teardown
from gradaccum.train import adapters, grpo, micro_batch, moe, parts, sft, sft_plan, summary
from gradaccum.train.batch_state import BatchState
from gradaccum.train.checks import WARM_START, prepare
from gradaccum.train.config import AUTO, TrainConfig
from gradaccum.train.console import Clock, Console, Progress, StopSignals
from gradaccum.train.epochs import pretrain_epoch_tokens
from gradaccum.train.evaluation import evaluate
from gradaccum.train.evaluation import to_device as _to_device
from gradaccum.train.recovery import OUT_OF_MEMORY, PEER_OUT_OF_MEMORY, STOP, Recovery, lost_rank
from gradaccum.train.resolve import Resolved, resolve_run
from gradaccum.train.rundir import best, payload, resume
from gradaccum.train.rundir.checkpoint import step_folders
from gradaccum.train.rundir.metrics import read_metrics, window_record
from gradaccum.train.rundir.outputs import Outputs
from gradaccum.train.rundir.payload import RunState
from gradaccum.train.schedule import Schedule, make_scheduler
from gradaccum.utils.atomic import interrupted
from gradaccum.utils.errors import BadInput, RunFailed, first_line

__all__ = ["TrainConfig", "evaluate", "train"]

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
        config, stopped = sft_first(config, rank_info, should_stop)
        if stopped is not None:
            return stopped
        return Run.build(config, rank_info).train(should_stop)
    finally:
        teardown(rank_info)


WARM_START_STEPS = 600
"""Steps of the SFT stage that --task grpo on the built-in set without --init-from starts
with (the built-in tasks' answers are then partly right: rewards to learn from)."""


def sft_first(
    config: TrainConfig, rank_info: RankInfo, should_stop
) -> tuple[TrainConfig, dict | None]:
    """--task grpo with no model given (no --model, --model-config or --init-from) on the
    built-in set: a short SFT run in --out/sft first (continued where it stopped, skipped
    once finished), then the GRPO run from it: (the GRPO config, None); or (config, the SFT
    run's summary) when a stop request ended the SFT stage."""
    given = config.init_from or config.model_config or config.model or config.data
    if config.task != "grpo" or given:
        return config, None
    grpo.check_builtin_rewards(config)  # --reward refused before the SFT stage, not after
    folder = os.path.join(config.out, WARM_START)
    if not os.path.exists(os.path.join(folder, "model.pt")):
        stage = TrainConfig(task="sft", seq_len=config.seq_len,
                            seed=config.seed, max_steps=WARM_START_STEPS, out=folder,
                            resume=bool(step_folders(folder)), json=config.json,
                            device=config.device, precision=config.precision)  # fmt: skip
        if rank_info.rank == 0 and not config.json:
            print(f"grpo: no --init-from: first {WARM_START_STEPS} steps of SFT on the built-in "
                  f"set in {folder}, then GRPO from that model", flush=True)  # fmt: skip
        summary_ = Run.build(prepare(stage), rank_info).train(should_stop)
        if summary_.get("stopped"):
            return config, summary_
    resume = bool(step_folders(config.out))  # the GRPO stage's own checkpoints
    return replace(config, init_from=os.path.abspath(folder), model=None, resume=resume), None


def epoch_tokens(config: TrainConfig, data) -> int | None:
    """A pretraining run's --epochs in tokens (`epochs.pretrain_epoch_tokens`); None for SFT,
    whose epochs `sft.plan_config` counts in windows, or without --epochs."""
    if config.task != "pretrain":
        return None
    return pretrain_epoch_tokens(config.epochs, len(data.train), config.seq_len)


class Run:
    """One training run, from its checked inputs to its summary.

    `Run.build` makes a new run (`fresh`) or continues one (`resumed`); `train` then starts,
    loops over `train_step` (one window) with `evaluate_now` and `save` between windows,
    and `finish`es.
    """

    def __init__(
        self,
        config: TrainConfig,
        rank_info: RankInfo,
        console: Console,
        data: parts.Data,
        model: torch.nn.Module,
        model_info,
        resolved: Resolved,
        batch: BatchState,
        schedule: Schedule,
        outputs: Outputs,
        notes: list[str] | None = None,
    ):
        self.config, self.rank_info, self.console = config, rank_info, console
        self.data, self.model_info, self.resolved = data, model_info, resolved
        self.batch, self.schedule, self.outputs = batch, schedule, outputs
        self.notes = notes or []  # what a resume changed, one line each
        self.sharded = config.shards_model  # --sync micro or hsdp: FSDP2 on every rank
        self.model = parts.place(model, config, rank_info)
        self.moe = moe.make(config, self.model)  # None for a dense model
        self.sft = data if config.task in ("sft", "grpo") else None
        """A --task sft or grpo run's data (`sft.SFTParts`); None for pretraining."""
        self.policy = self._policy_loss()  # --task grpo's loss; None otherwise
        self.optimizer = parts.optimizer(self.model, config)
        self.scheduler = make_scheduler(self.optimizer, schedule)
        self.acc = Accumulator(
            self.model,
            self.optimizer,
            self.scheduler,
            max_grad_norm=config.max_grad_norm or None,
            precision=config.precision,
            noise_scale=config.noise_scale,
            sync=config.sync if self.sharded else "window",
            count_tokens=rl.counter(config.loss_type, config.max_completion_length)
            if self.policy is not None
            else "auto",
        )
        self.batches = self._make_batches(batch.micro_batch)
        self.window_examples = 0  # examples (--task grpo: completions) in the last window
        self.window_fields: dict = {}  # --task grpo: the last window's rewards and lengths
        self.sft_plan: sft_plan.SFTPlan | None = None  # --task sft: what its steps hold
        abandon = self.moe.abandon if self.moe is not None else None
        sharded = config.sync if self.sharded else None
        self.recovery = Recovery(self.acc, self.batches, batch, rank_info, self._shrunk,
                                 config.dist_timeout, abandon, sharded)  # fmt: skip
        self.state = RunState()
        self.progress: Progress | None = None  # the bar or log lines, while the loop runs
        self.clock = Clock()

    def _policy_loss(self) -> rl.PolicyLoss | None:
        """--task grpo: the loss (`rl.PolicyLoss`), its prompts and rewards checked first."""
        config = self.config
        if config.task != "grpo":
            return None
        if self.moe is not None:
            raise BadInput("--model", config.preset, "a mixture of experts: not with --task grpo")
        self.prompts = grpo.prompts_of(self.sft.train, self.sft.tokenizer, config.seq_len)
        self.eval_sizes = grpo.eval_sizes(config, self.batch.total, len(self.sft.val))
        self.eval_prompts = grpo.eval_prompts(self.sft.val, self.sft.tokenizer, config.seq_len,
                                              self.eval_sizes[1])  # fmt: skip
        grpo.check(config, self.prompts)
        self.rewards = grpo.rewards_of(config, self.prompts)  # before any generation
        return rl.PolicyLoss(config.loss_type, config.epsilon, config.epsilon_high, config.beta,
                             config.max_completion_length, config.temperature)  # fmt: skip

    def _make_batches(self, micro: int):
        """The training stream: sequences (`Batches`), SFT windows (`sft.SFTStream`), or
        sampled and scored completions (`grpo.GRPOStream`)."""
        rank, world = self.rank_info.rank, self.rank_info.world_size
        if self.policy is not None:
            reference = None
            if self.config.beta:  # the starting model, frozen
                reference = parts.new_model(self.config, self.data.info, self.device)[0]
                reference.to(self.device).eval().requires_grad_(False)
            return grpo.GRPOStream(self.config, self.prompts, self.sft.tokenizer, self.rewards,
                                   lambda: parts.unwrapped(self.model), micro, self.rank_info,
                                   reference)  # fmt: skip
        if self.sft is not None:
            pad = self.sft.tokenizer.pad_id
            fill = self.moe is None  # no empty rows for a balance to route
            return sft.SFTStream(self.config, self.sft.train, pad, micro, rank, world, fill)
        data = self.data  # with --document-mask, its eod_id masks each micro-batch
        return Batches(data.train, micro, self.config.seed, rank, world, eod_id=data.eod_id)

    @classmethod
    def build(cls, config: TrainConfig, rank_info: RankInfo) -> Run:
        """The run `config` asks for: continued from --out's checkpoint on --resume."""
        parts.check_sync(config, rank_info)
        return cls.resumed(config, rank_info) if config.resume else cls.fresh(config, rank_info)

    @classmethod
    def fresh(cls, config: TrainConfig, rank_info: RankInfo) -> Run:
        """A new run: its data, a new model, the batch planned (`--micro-batch auto`
        measured where it is left to choose)."""
        console = Console(enabled=rank_info.rank == 0, quiet=config.json)
        torch.manual_seed(config.seed)
        data = parts.load_data(config)
        model, model_info = parts.new_model(config, data.info, rank_info.device)
        plan_config = config
        if config.task == "grpo":
            plan_config = grpo.plan_config(config, rank_info.world_size)
        elif config.task == "sft":
            measured = None
            if config.micro_batch == AUTO:
                per_step = sft.examples_per_step(config, data.train)
                vocab = data.info.vocab_size
                measured = micro_batch.measure_sft(
                    config, model, vocab, per_step, rank_info, console.say
                )
            plan_config = sft.plan_config(config, data.train, rank_info.world_size, measured)
        elif micro_batch.measures(config, rank_info.world_size):
            plan_config = micro_batch.measure(config, model, data, rank_info, console.say)
        length = epoch_tokens(config, data)
        resolved = resolve_run(config, plan_config, model_info, rank_info, length)
        batch = BatchState.planned(config, resolved, rank_info.world_size)
        schedule = batch.lr_schedule(config, resolved)
        outputs = Outputs(config, rank_info)
        return cls(
            config, rank_info, console, data, model, model_info, resolved, batch, schedule, outputs
        )

    @classmethod
    def resumed(cls, config: TrainConfig, rank_info: RankInfo) -> Run:
        """The run in --out continued from its newest intact checkpoint, exactly, with the
        changes `resume` allows applied and named in `notes`."""
        console = Console(enabled=rank_info.rank == 0, quiet=config.json)
        ckpt = resume.open_checkpoint(config, console.say)
        resume.check_metrics(config, ckpt)
        torch.manual_seed(config.seed)
        data = parts.load_data(config)
        model, model_info = parts.checkpoint_model(config, data.info, ckpt.path, rank_info.device)
        notes = resume.check_data(config, ckpt, data.info)
        if config.task == "grpo":
            plan_config = grpo.plan_config(config, rank_info.world_size)
        elif config.task == "sft":  # the windows are counted in examples, whatever the layout
            plan_config = sft.resume_plan_config(config, ckpt, data.train, rank_info.world_size)
        else:
            plan_config = resume.batch_config(config, ckpt, rank_info.world_size)
        length = epoch_tokens(config, data)
        resolved = resolve_run(config, plan_config, model_info, rank_info, length)
        batch = BatchState.planned(config, resolved, rank_info.world_size)
        schedule, length_notes = resume.lr_schedule(config, ckpt, resolved, batch)
        notes += length_notes + resume.batch_lines(ckpt, batch)
        notes += resume.applied_changes(config, ckpt)
        outputs = Outputs.resuming(config, rank_info, ckpt)
        built = (data, model, model_info, resolved, batch, schedule, outputs, notes)
        run = cls(config, rank_info, console, *built)
        run.restore(ckpt.trainer_state)
        return run

    @property
    def device(self) -> torch.device:
        return self.rank_info.device

    @property
    def is_main(self) -> bool:
        return self.rank_info.rank == 0

    # ---- restore, start ----------------------------------------------------------------

    def restore(self, trainer_state: dict) -> None:
        """Continue exactly where the checkpoint stopped, with the changes `notes` names."""
        self.notes += payload.restore(self, trainer_state)  # an MoE balance's changed mode

    def start(self) -> None:
        """Say what is about to happen, take the folder's lock, write config.yaml. No room on
        the disk for any of it: RunFailed in one line, and a new run's start leaves nothing."""
        if self.sft is not None and self.policy is None:
            self.sft_plan = sft_plan.measure(
                self.config,
                self.sft.train,
                self.batch.micro_batch,
                self.rank_info.world_size,
                self.batch.total,
                self.resolved.warmup_steps,
                fill_rows=self.moe is None,
            )
        lines = summary.opening_lines(self)
        if self.policy is not None:
            lines += self.sft.summary_lines()
            lines.append(grpo.eval_line(self.config, self.eval_sizes, self.batch.total))
        elif self.sft is not None:
            lines += self.sft.summary_lines()
            lines += sft.plan_lines(self.config, self.sft, self.batch.micro_batch)
        else:
            lines += parts.document_mask_lines(self.data)
        lines += self.moe.opening_lines() if self.moe is not None else []
        for line in lines:
            self.console.say(line)
        for line in self.notes:
            self.console.say(f"resume: {line}")
        self.outputs.open(self.acc.steps, self.batch.micro_batch)

    def write_record(self, record: dict) -> None:
        """One metrics record into metrics.jsonl (and TensorBoard), `Outputs.write`."""
        self.outputs.write(record, self.progress.note)

    # ---- the loop ----------------------------------------------------------------------

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
                return self.finish(stopped)
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
        if self.policy is not None and self.acc.steps == 0 and self.is_main:
            self.evaluate_now()  # --task grpo: the starting model's figures, to compare
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
        if self.sft is None:
            micro_batches = [next(self.batches) for _ in range(self.batch.k)]
        else:  # this rank's share of the window's examples (completions), per micro-batch
            sft_window = next(self.batches)
            micro_batches, self.window_examples = sft_window.micro_batches, sft_window.examples
            self.window_fields = getattr(sft_window, "fields", {})  # --task grpo's record
            if self.policy is not None:
                self.policy.start_tracking()
        micro_batches = [_to_device(b, self.device) for b in micro_batches]
        stand_in = micro_batches[-1]  # repeated, weight 0, by a rank with fewer micro-batches
        if self.sft is not None and not sft_window.shares:  # no example here: the stand-in
            micro_batches = []  # only joins the collectives, weight 0, routing no token
        moe = self.moe  # None for a dense model, whose window is only the engine's
        if moe is None:
            window = self.acc.begin_window(micro_batches)  # counts the window's tokens over ranks
        else:  # and the balance's routed tokens and counts, in the same collective
            window = moe.begin_window(self.acc, self.model, micro_batches)
        self.batch.agreed(window.micro_steps)  # under torchrun, the most micro-batches a rank has

        def forward_backward(micro: dict, weight: float) -> None:  # autocast: window.micro_step
            if self.policy is not None:  # the window's completions, a stand-in not tracked
                loss_sum, num_tokens = self.policy(self.model, micro, track=weight != 0)
                window.backward(loss_sum, num_tokens, weight)
            elif moe is None:
                loss_sum, num_tokens = causal_lm_loss(self.model, micro)
                window.backward(loss_sum, num_tokens, weight)  # world / N
            else:  # cross-entropy and the micro-batch's term of the window's balance
                moe.backward(window, self.model, micro, weight)

        def agree(i: int) -> int | None:  # every rank ends the window at the same micro-step
            flag = self.recovery.agree(signals.requested is not None, i, window.micro_steps)
            return flag if flag in (STOP, OUT_OF_MEMORY) else None

        # the micro-steps (gradients sync on the last only), then clip, optimizer and
        # scheduler step, zero_grad: once
        result = window.run(micro_batches, forward_backward, stand_in, before_micro_step=agree)
        if not isinstance(result, StepResult):  # a stop or out of memory: window abandoned
            return PEER_OUT_OF_MEMORY if result == OUT_OF_MEMORY else None
        if moe is not None:
            moe.end(result)
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
        record, words = window_record(result, seconds, self.batch, st.elapsed_s), []
        if self.policy is not None:  # the completions, their rewards, the loss's figures
            record.update(completions=self.window_examples, counted=result.tokens)
            record.update(self.window_fields)
            record.update(grpo.loss_fields(self.policy.totals, self.config.beta))
            reward = grpo.reward_words(record, self.rewards)
            words.append(f"reward {reward}, length {record['completion_length']:.1f}")
        elif self.sft is not None:  # what the window held: examples, and the tokens N counts
            record.update(examples=self.window_examples, counted_tokens=result.tokens)
            words.append(f"{self.window_examples} ex, {result.tokens} tok")
        if self.moe is not None:  # the load-balancing loss and the experts' load
            record.update(self.moe.record_fields())
            words.append(self.moe.progress())
        if self.is_main:
            self.write_record(record)
        done_here = result.step - self.clock.first_step
        self.progress.accum_steps = self.batch.k
        grown = self.batch.follow_noise(result, self.acc.steps)  # --batch-schedule auto
        if grown:
            self.progress.note(grown)
            self.progress.total = self.batch.total
        self.progress.update(
            result.step,
            result.loss,
            result.tokens,
            seconds,
            result.lr,
            now - self.clock.here,
            done_here,
            window="  ".join(words),
        )

    def _eval_due(self) -> bool:
        step, every = self.acc.steps, self.config.eval_every
        finished = self.batch.finished(step)
        evaluates = self.is_main or self.sharded  # a sharded model's forward needs every rank
        return evaluates and (finished or bool(every and step % every == 0))

    def evaluate_now(self) -> None:
        """Rank 0 (every rank when the model is sharded, rank 0 alone writing): the eval loss
        (and on the built-in SFT set exact match) into metrics.jsonl and a progress line; with
        --save-best a loss lower than any before makes this step's checkpoint the best
        (`save_best`). Nothing without an eval set (a single SFT example, --eval-fraction
        0)."""
        model, precision = parts.unwrapped(self.model), self.config.precision
        micro, step = self.batch.micro_batch, self.acc.steps
        if not len(self.data.val):
            return
        if self.sft is not None:
            answers = self.eval_sizes[0] if self.policy is not None else None
            fields, lines = sft.evaluate(model, self.sft, micro, self.device, precision, answers)
            if self.policy is not None:  # --task grpo: the reward of held-out samples too
                sampled, words = grpo.evaluate_rewards(model, self.eval_prompts, self.sft.tokenizer,
                                                       self.rewards, self.config)  # fmt: skip
                fields, lines[0] = {**fields, **sampled}, lines[0] + words
        else:
            loss = evaluate(model, self.data.val, micro, self.device, precision, self.data.eod_id)
            fields, lines = {"eval_loss": loss}, [f"eval loss {loss:.4f}"]
        record = {"step": step, "tokens": self.batch.tokens, **fields}
        if self.is_main:
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

    # ---- save, finish ------------------------------------------------------------------

    def trainer_state(self) -> dict:
        """Everything but the weights that the run needs to continue exactly (`payload`)."""
        return payload.trainer_state(self)

    def checkpoint_contents(self) -> tuple[dict, dict]:
        """What a checkpoint of the run as it stands holds: (model state_dict, trainer state);
        a sharded model's: (each rank's own shards, the trainer state on rank 0)."""
        if self.sharded:
            return payload.sharded_contents(self)
        return parts.unwrapped(self.model).state_dict(), self.trainer_state()

    def save(self) -> None:
        """A checkpoint of the last finished window, unless one of it exists (`Outputs.save`)."""
        contents, config = self.checkpoint_contents, self.model_info.config
        self.outputs.save(self.acc.steps, contents, config, self.progress.note)

    def save_best(self, eval_loss: float) -> str:
        """--save-best, rank 0, after an evaluation at a new lowest `eval_loss`: this step's
        checkpoint written now as the best (`Outputs.save_best`); the words the eval line
        ends with."""
        found = best.Best(self.acc.steps, eval_loss, best.eval_set_fingerprint(self))
        contents, config = self.checkpoint_contents, self.model_info.config
        if self.outputs.save_best(found, contents, config, self.progress.note):
            return ", the best so far (checkpoint kept)"
        return ", the best so far (its checkpoint not written)"

    def finish(self, stopped: str | None) -> dict:
        """Export the model (a finished run only), plot the losses, return the summary, with
        the files written (`files`) and those not, and why (`not_written`). No room for the
        export ends the run in one line (RunFailed) naming the checkpoint still there."""
        config, outputs, step = self.config, self.outputs, self.acc.steps
        if stopped:
            self.console.say(summary.stopped_line(stopped, step, self.batch.total, outputs))
        records, files = [], []
        model = parts.unwrapped(self.model)
        if self.sharded and stopped is None:  # gathered by every rank into rank 0's copy
            model = parts.whole_model(self.model, config, self.data.info, self.is_main)
        if self.is_main:
            outputs.metrics.close()
            records = read_metrics(os.path.join(config.out, "metrics.jsonl"))
            files = ["metrics.jsonl", "config.yaml"]
            if stopped is None:  # model.pt (and out/hf), or LoRA's adapter/ (and merged/)
                tokenizer = self.sft.tokenizer_dir if self.sft is not None else None
                at = f"step {step}/{self.batch.total}"
                files += outputs.export_model(model, self.model_info, tokenizer, at)
                line = adapters.merge_line(model, config) if "merged/" in files else None
                if line:  # --merge-lora on a base in 4 or 8 bits: what the merge changed
                    self.console.say(line)
                if config.save_best:  # after the final export: its weights are loaded over
                    files += outputs.export_best(model, self.model_info, tokenizer, step, at)
            title = summary.plot_title(records, self)
            files += summary.plot(records, outputs, self.data.info.entropy_floor, title)
            files += outputs.finish_trackers(self.console.say)  # the plots to them, closed
            files += ["checkpoints/"] if outputs.saved_step is not None else []
        noise = self.acc.noise.last if self.acc.noise is not None else None
        line = summary.critical_batch_line(noise, self.batch.tokens_per_step)
        if line:
            self.console.say(line)
        line = summary.best_line(self, f"{best.BEST_FOLDER}/" in files)
        if line:
            self.console.say(line)
        result = summary.summary(self, records, stopped, time.perf_counter() - self.clock.started)
        result.update(moe.summary_fields(self.moe, records))
        result["files"] = files
        result["not_written"] = dict(outputs.not_written)
        return result
