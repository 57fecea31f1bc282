"""`train --report-to`: every metrics record, the run's settings and its plots also sent to
experiment trackers (TensorBoard, Weights & Biases, MLflow, trackio), as Transformers'
`report_to` names them. Each is the real library, from the optional extra `trackers`.

Offline and local unless the user's own environment variables say otherwise: W&B in offline
mode under `<out>/wandb/` (WANDB_MODE, WANDB_DIR), MLflow a file store `<out>/mlruns`
(MLFLOW_TRACKING_URI), trackio its database under `<out>/trackio/` (TRACKIO_DIR). Their
telemetry is off unless the user turned it on (WANDB_ERROR_REPORTING,
MLFLOW_DISABLE_TELEMETRY).

`Trackers` is the one place a tracker's failure is handled: a tracker that raises is turned
off, said in one line, and the run and metrics.jsonl go on. Only rank 0 reports. Each
tracker's run id is kept in `<out>/trackers.json` so that a resume continues the same run;
what was logged past the checkpoint is logged again (`docs/pretraining.md#trackers` says what
each tracker does with the overlap).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gradaccum.train.rundir import tensorboard
from gradaccum.train.rundir.tensorboard import TensorBoardWriter, scalars
from gradaccum.utils.atomic import write_text_atomic
from gradaccum.utils.errors import BadInput, DiskFull, first_line

IDS_FILE = "trackers.json"
"""In --out: each tracker's run id, for a resume to continue the same run."""
EXTRA = "pip install 'gradaccum[trackers]'"
PROJECT = "gradaccum"
"""The W&B project, MLflow experiment and trackio project a run goes to, unless WANDB_PROJECT
or MLFLOW_EXPERIMENT_NAME says another."""
FOLDERS = ("tensorboard", "wandb", "mlruns", "trackio", IDS_FILE)
"""What trackers write in --out by default: what a failed start removes again."""


def check_installed(config) -> None:
    """BadInput naming the flag, its value and the extra when a tracker the run reports to is
    not installed: before anything is read or written."""
    named = [] if config.report_to == "none" else config.report_to.split(",")
    if config.tensorboard and "tensorboard" not in named:
        tensorboard.check_available()
    for name in named:
        if not _installed(name):
            raise BadInput("--report-to", config.report_to, f"{name} is not installed: {EXTRA}")


def _installed(module: str) -> bool:
    # found without importing it: trackio reads TRACKIO_DIR, mlflow its telemetry switch, once
    # at import, and these are set when the tracker opens
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


@dataclass
class Start:
    """What a tracker opens with."""

    out: str
    params: dict
    """The settings as config.yaml holds them, flat: {"lr": 0.001, "seed": 0, ...}."""
    resumed_at: int | None
    """The checkpoint's optimizer step a resume continues from; None for a new run."""
    saved: dict
    """What this tracker's `open` returned in the run's previous session ({} if none)."""


def _under(out: str, path) -> str:
    """`path` as the summary names it: `name/` when it is a folder in --out, else itself."""
    rel = os.path.relpath(os.path.abspath(path), os.path.abspath(out))
    return str(path) if rel.startswith("..") else rel.rstrip("/") + "/"


class TensorBoardTracker:
    """Scalars in `<out>/tensorboard/` (`TensorBoardWriter`); a resume purges the events past
    its checkpoint. Takes no files."""

    name, label = "tensorboard", "TensorBoard"

    def __init__(self):
        self.writer, self.where = None, "tensorboard/"

    def open(self, start: Start) -> dict:
        # Events past the checkpoint's step came after it and will be written again.
        purge = start.resumed_at + 1 if start.resumed_at is not None else None
        self.writer = TensorBoardWriter(start.out, purge_step=purge)
        return {}

    def log(self, record: dict) -> None:
        self.writer.write(record)

    def files(self, paths: list[str]) -> None:
        pass

    def close(self, failed: bool = False) -> None:
        if self.writer is not None:
            self.writer.close()


class WandbTracker:
    """A W&B run, offline in `<out>/wandb/offline-run-*` unless WANDB_MODE / WANDB_DIR say
    otherwise (`wandb sync` uploads it later); the plots as images."""

    name, label = "wandb", "W&B"

    def __init__(self):
        self.run, self.where, self.step = None, "wandb", None

    def open(self, start: Start) -> dict:
        os.environ.setdefault("WANDB_ERROR_REPORTING", "false")  # read when wandb-core starts
        import wandb

        run_id = start.saved.get("id") if start.resumed_at is not None else None
        env = os.environ
        self.run = wandb.init(
            project=None if "WANDB_PROJECT" in env else PROJECT,
            name=None if "WANDB_NAME" in env else os.path.basename(os.path.abspath(start.out)),
            dir=None if "WANDB_DIR" in env else start.out,
            mode=None if "WANDB_MODE" in env else "offline",
            id=run_id,
            resume="allow" if run_id else None,
            settings=wandb.Settings(silent=True, console="off"),  # stdout stays ours
        )
        self.run.config.update(start.params, allow_val_change=True)  # a resume may change some
        self.where = _under(start.out, os.path.dirname(self.run.dir))
        return {"id": self.run.id}

    def log(self, record: dict) -> None:
        self.step, values = int(record["step"]), scalars(record)
        if values:
            self.run.log(values, step=self.step)

    def files(self, paths: list[str]) -> None:
        import wandb

        images = {f"plots/{Path(p).stem}": wandb.Image(p) for p in paths}
        if images:
            self.run.log(images, step=self.step)

    def close(self, failed: bool = False) -> None:
        if self.run is not None:
            self.run.finish(exit_code=1 if failed else 0)
            self.run = None


class MlflowTracker:
    """An MLflow run through the client API, in the file store `<out>/mlruns` unless
    MLFLOW_TRACKING_URI names another; the plots as artifacts. MLflow keeps a parameter's
    first value: a resume adds the new settings, a changed one stays as first logged."""

    name, label = "mlflow", "MLflow"

    def __init__(self):
        self.client, self.run_id, self.where = None, None, "mlflow"

    def open(self, start: Start) -> dict:
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # read at import
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            # mlflow 3 keeps the file store (no database server, no sqlalchemy) behind a switch
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            uri = Path(os.path.abspath(start.out), "mlruns").as_uri()
            self.where = "mlruns/"
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=uri)
        saved = start.saved if start.resumed_at is not None else {}
        known = {}
        if saved.get("run_id") and saved.get("tracking_uri") == uri:
            self.run_id = saved["run_id"]
            self.client.update_run(self.run_id, status="RUNNING")
            known = self.client.get_run(self.run_id).data.params
        else:
            self.run_id = self._new_run(os.path.basename(os.path.abspath(start.out)))
        params = [Param(k, str(v)) for k, v in start.params.items() if k not in known]
        for i in range(0, len(params), 100):  # log_batch takes 100 parameters at most
            self.client.log_batch(self.run_id, params=params[i : i + 100])
        return {"run_id": self.run_id, "tracking_uri": uri}

    def _new_run(self, name: str) -> str:
        experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME", PROJECT)
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
        return self.client.create_run(experiment_id, run_name=name).info.run_id

    def log(self, record: dict) -> None:
        from mlflow.entities import Metric

        now, step = int(time.time() * 1000), int(record["step"])
        metrics = [Metric(k, float(v), now, step) for k, v in scalars(record).items()]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def files(self, paths: list[str]) -> None:
        for path in paths:
            self.client.log_artifact(self.run_id, path)

    def close(self, failed: bool = False) -> None:
        if self.run_id is not None:
            self.client.set_terminated(self.run_id, "FAILED" if failed else "FINISHED")
            self.run_id = None


@contextlib.contextmanager
def _quiet():
    """trackio prints its banners on stdout, which under --json carries only the summary."""
    with contextlib.redirect_stdout(io.StringIO()):
        yield


class TrackioTracker:
    """A trackio run in its local database, `<out>/trackio/` unless TRACKIO_DIR names another
    folder (trackio reads it once, at its import: in one Python process, every run after the
    first writes where the first did); the plots as images."""

    name, label = "trackio", "trackio"

    def __init__(self):
        self.run, self.where, self.step = None, "trackio", None

    def open(self, start: Start) -> dict:
        os.environ.setdefault("TRACKIO_DIR", os.path.join(os.path.abspath(start.out), "trackio"))
        with _quiet():
            import trackio
            from trackio.utils import TRACKIO_DIR

            name = start.saved.get("name") if start.resumed_at is not None else None
            self.run = trackio.init(
                project=PROJECT,
                name=name,
                resume="allow" if name else "never",
                config=start.params,
                embed=False,
            )
        self.where = _under(start.out, TRACKIO_DIR)
        return {"project": PROJECT, "name": self.run.name, "dir": str(TRACKIO_DIR)}

    def log(self, record: dict) -> None:
        self.step, values = int(record["step"]), scalars(record)
        if values:
            self.run.log(values, step=self.step)

    def files(self, paths: list[str]) -> None:
        import trackio

        images = {f"plots/{Path(p).stem}": trackio.Image(p) for p in paths}
        if images:
            self.run.log(images, step=self.step)

    def close(self, failed: bool = False) -> None:
        if self.run is None:
            return
        import trackio
        from trackio import context_vars

        with _quiet():
            if context_vars.current_run.get() is self.run:
                trackio.finish()  # also forgets it: nothing left for trackio's exit hook
            else:
                self.run.finish()
        self.run = None


KINDS = {
    "tensorboard": TensorBoardTracker,
    "wandb": WandbTracker,
    "mlflow": MlflowTracker,
    "trackio": TrackioTracker,
}


class Trackers:
    """The trackers of one run, on rank 0: each record to each of them, and the one place
    their failures are handled. A tracker that raises is turned off: one line through
    `note` (a failure at the start is said with the first record), why in `not_written`
    for the closing line, and the run goes on. No room on the disk at the start stops it,
    as for the run's other files."""

    def __init__(self, trackers: list, not_written: dict[str, str]):
        self.on, self.done = trackers, []  # still on; closed after working to the end
        self.not_written = not_written  # the run's: name -> why, for the closing line
        self.pending: list[str] = []  # lines to say with the first record

    @classmethod
    def start(cls, config, resumed_at: int | None, not_written: dict[str, str]) -> Trackers:
        """Open the trackers `config.trackers` names, continuing their runs on a resume."""
        out = config.out
        saved = read_ids(out) if resumed_at is not None else {}
        params = {k: v for section in config.sections().values() for k, v in section.items()}
        trackers = cls([], not_written)
        ids = dict(saved)
        for name in config.trackers:
            tracker = KINDS[name]()
            try:
                ids[name] = tracker.open(Start(out, params, resumed_at, saved.get(name, {})))
            except DiskFull:
                trackers.close(failed=True)
                raise
            except Exception as err:
                trackers._off(tracker, err, "from the start")
            else:
                trackers.on.append(tracker)
        if ids != saved and any(t.name != "tensorboard" for t in trackers.on):
            trackers._keep_ids(out, ids)
        return trackers

    def _keep_ids(self, out: str, ids: dict) -> None:
        path = os.path.join(out, IDS_FILE)
        try:
            write_text_atomic(path, json.dumps(ids, indent=1) + "\n")
        except (OSError, DiskFull) as err:
            self.pending.append(
                f"{path}: not written ({first_line(err)}); a resume starts new tracker runs"
            )

    def log(self, record: dict, note: Callable[[str], None]) -> None:
        """`record` to every tracker still on, at its step."""
        self._say(note)
        for tracker in list(self.on):
            try:
                tracker.log(record)
            except Exception as err:
                step = int(record["step"])
                self._off(tracker, err, f"from step {step}", note, f"past step {step - 1}: ")

    def finish(self, paths: list[str], note: Callable[[str], None]) -> list[str]:
        """At the end of a run: the files at `paths` (the plots) to every tracker that takes
        files, then each tracker closed; the folders in --out they wrote, for the summary."""
        self._say(note)
        for tracker in list(self.on):
            try:
                tracker.files(paths)
            except Exception as err:
                self._off(tracker, err, "for the plots", note)
        self.close()
        return [t.where for t in self.done if t.where.endswith("/")]

    def close(self, name: str | None = None, failed: bool = False) -> None:
        """Close the tracker `name`, or all still open; `failed`: the run did not finish."""
        for tracker in [t for t in self.on if name in (None, t.name)]:
            self.on.remove(tracker)
            try:
                tracker.close(failed)
            except Exception as err:
                self.not_written[tracker.where] = f"not closed: {first_line(err)}"
            else:
                self.done.append(tracker)

    def _off(self, tracker, err: Exception, at: str, note=None, kept: str = "") -> None:
        """Turn `tracker` off after `err`, `at` ("from step 3"); `kept`: what it holds, for
        the closing line ("past step 2: ")."""
        if tracker in self.on:
            self.on.remove(tracker)
        with contextlib.suppress(Exception):  # it failed already: what is left is its own
            tracker.close(failed=True)
        why = err.reason if isinstance(err, DiskFull) else first_line(err)
        head = str(err) if isinstance(err, DiskFull) else f"{tracker.label} failed ({why})"
        self.not_written[tracker.where] = f"{kept}{why}"
        line = f"{head}; {tracker.label} is off {at}, metrics.jsonl goes on holding every field"
        self.pending.append(line)
        if note is not None:
            self._say(note)

    def _say(self, note: Callable[[str], None]) -> None:
        for line in self.pending:
            note(line)
        self.pending.clear()


def read_ids(out: str) -> dict:
    """What `<out>/trackers.json` holds: tracker -> what its `open` returned; {} if none."""
    try:
        with open(os.path.join(out, IDS_FILE), encoding="utf-8") as f:
            ids = json.load(f)
    except (OSError, ValueError):
        return {}
    return ids if isinstance(ids, dict) else {}
