"""What a run writes in --out as it goes, and the words for what is left there.

The folder's lock, config.yaml, metrics.jsonl and the trackers (--report-to, --tensorboard:
`trackers`) are opened at the start; a record goes to each as it comes; checkpoints are written
between windows. No room on the disk is one line every time: at the start a new run leaves
nothing behind and a resume leaves the folder as it was (RunFailed); for metrics.jsonl the
run stops (it would not resume exactly without it) naming the checkpoint still there; a
tracker that fails (TensorBoard's file meeting a full disk) is turned off and the run goes on; a
checkpoint that cannot be written stops the run at once (RunFailed naming its folder, the
system's reason and the checkpoint still there): the windows after it could not be kept either.
The best checkpoint of --save-best that fails is said and the run goes on: the next regular
checkpoint decides.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace

from gradaccum.models.export import export_hf_model
from gradaccum.parallel import collectives
from gradaccum.parallel.process_group import RankInfo
from gradaccum.settings.files import to_yaml
from gradaccum.train import adapters, checks
from gradaccum.train.config import TrainConfig
from gradaccum.train.rundir import checkpoint
from gradaccum.train.rundir.best import BEST_FOLDER, Best, load_weights
from gradaccum.train.rundir.lock import RunLock
from gradaccum.train.rundir.metrics import MetricsWriter
from gradaccum.train.rundir.settings import SETTINGS_FILE
from gradaccum.train.rundir.trackers import Trackers
from gradaccum.utils.atomic import write_text_atomic
from gradaccum.utils.errors import BadInput, DiskFull, RunFailed, first_line

HF_EXPORT = "hf"
"""The folder under --out of a finished run's Hugging Face model (`Outputs.export_hf`)."""


class Outputs:
    """--out of one run. `resumed_at`: the step of the checkpoint a resume starts from (None
    for a new run); `metrics_lines`: the metrics.jsonl lines that checkpoint saw."""

    def __init__(
        self,
        config: TrainConfig,
        rank_info: RankInfo,
        sharded: bool = False,
        resumed_at: int | None = None,
        metrics_lines: int | None = None,
    ):
        self.config, self.rank_info = config, rank_info
        self.sharded = sharded  # a model sharded with FSDP2: each rank writes its shards
        self.is_main = rank_info.rank == 0
        self.resumed_at, self._metrics_lines = resumed_at, metrics_lines
        self.lock = RunLock(config.out)
        self.metrics: MetricsWriter | None = None
        self.trackers: Trackers | None = None  # on rank 0 with --report-to or --tensorboard
        self.saved_step = resumed_at
        """The step of the newest checkpoint on disk (None before the first)."""
        self.last_saved: int | None = None
        """The step of the last save (written or failed): one step is saved once."""
        self.best = Best()  # --save-best's checkpoint, known to rank 0 (which evaluates)
        self.not_written: dict[str, str] = {}  # file -> why, for the closing line

    @classmethod
    def resuming(cls, config: TrainConfig, rank_info: RankInfo, sharded: bool, ckpt) -> Outputs:
        """The outputs of a run resumed from `ckpt` (a `checkpoint.Checkpoint`)."""
        return cls(config, rank_info, sharded, ckpt.step, ckpt.trainer_state["metrics_lines"])

    # ---- open, close -------------------------------------------------------------------

    def open(self, step: int, micro_batch: int | None = None) -> None:
        """Take the folder's lock, write config.yaml, open metrics.jsonl and TensorBoard's
        file, before training from optimizer step `step` (`micro_batch`: what an `auto`
        settled at, noted beside it in config.yaml). No room on the disk for any of it:
        RunFailed in one line, and a new run's start leaves nothing."""
        self.last_saved = step
        new = self.resumed_at is None
        # A new run's start that meets a full disk leaves --out as it was: what it made goes.
        undo = checks.undo_start(self.config.out) if new and self.is_main else None
        try:
            self._take_lock()
            if self.is_main:
                self._open_files(step, micro_batch)
        except DiskFull as err:
            self.lock.release()
            if undo is not None:
                undo()
            if not new:
                raise RunFailed(
                    f"{err}; the run did not resume, {self.config.out} is as it was"
                ) from None
            raise RunFailed(f"{err}; the run did not start and left nothing behind") from None

    def _take_lock(self) -> None:
        failed = None
        if self.is_main:
            try:
                self.lock.acquire()
            except (BadInput, DiskFull) as err:
                failed = err
        # Every rank leaves with the same error, or none of them waits on the others.
        if collectives.max_over_ranks(int(failed is not None)):
            raise failed or BadInput("--out", self.config.out, "in use by a running run")

    def _open_files(self, step: int, micro_batch: int | None) -> None:
        """config.yaml, metrics.jsonl and the trackers (`Trackers.start`)."""
        config = self.config
        header = "gradaccum train settings as chosen; gradaccum train --config this-file"
        comments = {}
        if config.micro_batch == "auto" and micro_batch is not None:
            # auto stays auto (the file is what was chosen), so a run from it settles it anew
            comments["micro_batch"] = micro_batch_note(micro_batch)
        text = to_yaml(config.sections(), header, comments)
        write_text_atomic(os.path.join(config.out, SETTINGS_FILE), text)
        path = os.path.join(config.out, "metrics.jsonl")
        self.metrics = MetricsWriter(path, self._metrics_lines)
        if config.trackers:
            # A resume continues each tracker's run from `step`: what came after is logged again.
            resumed = step if self.resumed_at is not None else None
            self.trackers = Trackers.start(config, resumed, self.not_written)

    def close_tensorboard(self) -> None:
        """TensorBoard's file closed; the other trackers stay open for the plots
        (`finish_trackers`)."""
        if self.trackers is not None:
            self.trackers.close("tensorboard")

    def finish_trackers(self, note: Callable[[str], None]) -> list[str]:
        """After the plots are written: every .png in --out to the trackers that take files,
        then each closed; the folders in --out the trackers wrote, for the summary's files."""
        if self.trackers is None:
            return []
        out = self.config.out
        plots = sorted(os.path.join(out, n) for n in os.listdir(out) if n.endswith(".png"))
        return self.trackers.finish(plots, note)

    def close_trackers(self) -> None:
        """Every tracker still open closed as failed: the run ended before `finish_trackers`."""
        if self.trackers is not None:
            self.trackers.close(failed=True)

    def abandon(self) -> None:
        """On the way out of a run that did not finish: the lock released, metrics closed,
        the trackers' runs closed as failed."""
        self.lock.release()
        if self.metrics is not None:
            self.metrics.close()
        self.close_trackers()

    # ---- as the run goes ---------------------------------------------------------------

    def write(self, record: dict, note: Callable[[str], None]) -> None:
        """One metrics record into metrics.jsonl and to every tracker. No room for
        metrics.jsonl stops the run (RunFailed naming the checkpoint still there: a run
        without its metrics would not resume exactly); a tracker that fails (no room for
        TensorBoard's file) is turned off, said in one line through `note`, and the run goes
        on."""
        try:
            self.metrics.write(record)  # whole lines only: the file ends at the last whole one
        except DiskFull as err:
            raise RunFailed(
                f"{err} at step {record['step']}; the run stopped, {self.kept('free space and ')}"
            ) from None
        if self.trackers is not None:
            self.trackers.log(record, note)

    def save(
        self,
        step: int,
        contents: Callable[[], tuple[dict, dict]],
        model_config: dict,
        note: Callable[[str], None],
    ) -> None:
        """A checkpoint at `step` of (model state_dict, trainer state) = `contents()`,
        unless one of it exists. A failed write (a full disk, a folder that cannot be written)
        leaves the previous checkpoint and stops the run on every rank (RunFailed, one line):
        training on would spend compute that no checkpoint or export could keep. A second
        Ctrl-C during the write leaves the previous one too, nothing half-written, and says so
        in the KeyboardInterrupt's text."""
        if step == self.last_saved:
            return
        failed = None
        writes = self.is_main or self.sharded  # a sharded model: each its shards
        if writes and step != self.saved_step:  # not already written as a new best
            failed = self._write(step, contents, model_config)
        # Rank 0 writes; every rank learns whether it could, so all stop together or none.
        if collectives.max_over_ranks(int(failed is not None)):
            raise RunFailed(self._save_failed(step, failed))
        self.saved_step = self.last_saved = step

    def _save_failed(self, step: int, failed: OSError | DiskFull | None) -> str:
        """The line of a run stopped by checkpoint `step` not written (`failed`: rank 0's
        error; None on the other ranks, which only know that it failed)."""
        folder = os.path.join(self.config.out, checkpoint.CHECKPOINTS, f"step-{step:08d}")
        if failed is None:
            return f"{folder}: not written on rank 0; the run stopped at step {step}"
        room = isinstance(failed, DiskFull)  # `atomic.writing` made every no-room error one
        fix = "free space and " if room else f"make {os.path.dirname(folder)} writable and "
        return (
            f"{folder}: not written ({_reason(failed)}); the run stopped at step {step} rather "
            f"than train on without a checkpoint, {self.kept(fix)}"
        )

    def save_best(
        self,
        best: Best,
        contents: Callable[[], tuple[dict, dict]],
        model_config: dict,
        note: Callable[[str], None],
    ) -> bool:
        """--save-best on rank 0, at an evaluation that found a lower eval loss: `best` made
        the best and its step's checkpoint written now, a save step or not, its trainer state
        (`contents()`) naming it. The other ranks do not evaluate: they wait in the next
        window's collectives, and a `save` of the same step only joins them; with a sharded
        model they evaluate too and write their shards here, and learn whether rank 0 could
        write the rest. False when it could not be written (said through `note`): the best
        stays the previous one."""
        previous, self.best = self.best, best
        failed = self._write(best.step, contents, model_config)
        if self.sharded and collectives.max_over_ranks(int(failed is not None)):
            failed = failed or OSError("not written on rank 0")  # every rank as rank 0
        if failed is not None:
            self.best = previous
            if self.is_main:
                note(f"checkpoint at step {best.step} not written ({_reason(failed)}); "
                     f"{self._older()}")  # fmt: skip
            return False
        self.saved_step = best.step
        return True

    def _write(self, step: int, contents, model_config: dict) -> OSError | DiskFull | None:
        """Rank 0's write of checkpoint `step` (every rank's, of a sharded model: each writes
        its shards, `checkpoint.save_sharded`), pruning all but the newest --keep-checkpoints
        and the best; the error that stopped it (a full disk is DiskFull), None once written."""
        config = self.config
        keep, best = config.keep_checkpoints, self.best.step if config.save_best else None
        try:
            model_state, trainer_state = contents()
            if self.sharded:
                checkpoint.save_sharded(config.out, step, model_state, model_config,
                                        trainer_state, config.to_dict(), keep, best,
                                        self.is_main)  # fmt: skip
                return None
            model_state = adapters.checkpoint_state(model_state, model_config)  # LoRA
            checkpoint.save(config.out, step, model_state, model_config, trainer_state,
                            config.to_dict(), keep, best)  # fmt: skip
        except KeyboardInterrupt:
            raise self._interrupted_save(step) from None
        except (OSError, DiskFull) as err:
            return err
        return None

    def _interrupted_save(self, step: int) -> KeyboardInterrupt:
        """A Ctrl-C during the save of `step`: made current before it landed (pruning the
        older ones), or not made at all."""
        root = os.path.join(self.config.out, checkpoint.CHECKPOINTS)
        if checkpoint.read_latest_name(root) == f"step-{step:08d}":
            self.saved_step = step
            return KeyboardInterrupt(f"after the checkpoint at step {step}; {self.kept()}")
        return KeyboardInterrupt(
            f"during the checkpoint at step {step}, which was not written; {self.kept()}"
        )

    def export(self, model_state: dict, model_config: dict, at: str, into: str = "") -> list[str]:
        """A finished run's model.pt and config.json in --out (or its sub-folder `into`); the
        files written. No room ends the run in one line (RunFailed) naming the checkpoint
        still there; `at`: where the run stands, "step 40/40"."""
        try:
            checkpoint.save_model(os.path.join(self.config.out, into), model_state, model_config)
        except DiskFull as err:
            raise RunFailed(
                f"{err}; the run trained to {at} but its model is not exported"
                f"{_to(into)}, {self.kept('free space and ')}"
            ) from None
        return [os.path.join(into, "model.pt"), os.path.join(into, "config.json")]

    def export_hf(self, model, tokenizer_dir: str | None, at: str, into: str = "") -> list[str]:
        """A finished run's Hugging Face model in --out/hf (or `into`/hf) as `save_pretrained`
        writes it, with the tokenizer's files of `tokenizer_dir`
        (`models.export.export_hf_model`), so that transformers' `from_pretrained` loads
        both; the files written. No room ends the run in one line (RunFailed) as for
        `export`."""
        folder = os.path.join(into, HF_EXPORT)
        try:
            export_hf_model(model, os.path.join(self.config.out, folder), tokenizer_dir)
        except DiskFull as err:
            raise RunFailed(
                f"{err}; the run trained to {at} but its model is not exported to "
                f"{folder}/, {self.kept('free space and ')}"
            ) from None
        return [f"{folder}/"]

    def export_lora(self, model, tokenizer, at: str, into: str = "") -> list[str]:
        """A finished LoRA run's adapter folder (and with --merge-lora the merged model) in
        --out (or `into`), `adapters.export`; the folders written. No room ends the run in
        one line (RunFailed) as for `export`."""
        config = replace(self.config, out=os.path.join(self.config.out, into))
        try:
            written = adapters.export(model, config, tokenizer)
        except DiskFull as err:
            raise RunFailed(
                f"{err}; the run trained to {at} but its adapters are not all exported"
                f"{_to(into)}, {self.kept('free space and ')}"
            ) from None
        return [os.path.join(into, name) for name in written]

    def export_model(
        self, model, model_info, tokenizer_dir: str | None, at: str, into: str = ""
    ) -> list[str]:
        """A finished run's model (unwrapped) in --out (or its sub-folder `into`): LoRA's
        adapter folder (`export_lora`), or model.pt (`export`) and for a Hugging Face model
        also hf/ (`export_hf`)."""
        if adapters.record_of(model_info) is not None:
            return self.export_lora(model, tokenizer_dir, at, into)
        files = self.export(model.state_dict(), model_info.config, at, into)
        if model_info.kind == "hf":  # also as transformers loads it
            files += self.export_hf(model, tokenizer_dir, at, into)
        return files

    def export_best(
        self, model, model_info, tokenizer_dir: str | None, step: int, at: str
    ) -> list[str]:
        """--save-best at the end of a run finished at `step`: the best checkpoint's model
        exported as --out/best/ by `export_model` (its weights loaded into `model` first,
        unless the best is `step`, the model as it ends); ["best/"], or [] with why in
        `not_written` when there is no best or its checkpoint is damaged. No room ends the
        run in one line (RunFailed) as for `export`."""
        folder = self.best.folder(self.config.out)
        if folder is None:
            self.not_written[f"{BEST_FOLDER}/"] = "no evaluation gave a finite eval loss"
            return []
        if self.best.step != step:
            damage = checkpoint.damage(folder)
            if damage is not None:
                self.not_written[f"{BEST_FOLDER}/"] = f"its checkpoint {damage}"
                return []
            load_weights(model, model_info, folder)
        os.makedirs(os.path.join(self.config.out, BEST_FOLDER), exist_ok=True)
        self.export_model(model, model_info, tokenizer_dir, at, into=BEST_FOLDER)
        return [f"{BEST_FOLDER}/"]

    # ---- what is left ------------------------------------------------------------------

    def kept(self, fix: str = "") -> str:
        """The checkpoint a run that cannot go on leaves, and the command to go on from it."""
        out = self.config.out
        if self.saved_step is None:
            return f"no checkpoint was written yet: {fix}start again with --out {out}"
        return (
            f"the checkpoint at step {self.saved_step} is still there: {fix}continue with: "
            f"gradaccum train --resume --out {out}"
        )

    def _older(self) -> str:
        root = os.path.join(self.config.out, checkpoint.CHECKPOINTS)
        if self.saved_step is None:
            return f"none is in {root} yet"
        path = os.path.join(root, f"step-{self.saved_step:08d}")
        return f"the one at step {self.saved_step} is still there ({path})"


def micro_batch_note(micro_batch: int) -> str:
    """config.yaml's words beside `micro_batch: auto`: what this run settled it at."""
    return (
        f"this run settled it at {micro_batch}; a run from this file measures it again, "
        f"micro_batch: {micro_batch} pins it"
    )


def _reason(err: OSError | DiskFull) -> str:
    """The system's words for a failed write: DiskFull's reason, an OSError's strerror."""
    return err.reason if isinstance(err, DiskFull) else err.strerror or first_line(err)


def _to(into: str) -> str:
    """The words " to best/" for an export into a sub-folder of --out; "" for --out."""
    return f" to {into}/" if into else ""
