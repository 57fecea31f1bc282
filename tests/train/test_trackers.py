"""--report-to: what each tracker wrote, read back from its local files with the tracker's own
library, holds metrics.jsonl's losses at their steps and the settings; a resume continues the
same tracker runs; a tracker that fails is turned off in one line; one that is not installed
is refused before anything is written.

One trained run (3 steps, its newest checkpoint then damaged, resumed from step 2 to step 4:
step 3 is logged twice) is read by several tests: the trackers' imports cost seconds."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from gradaccum.cli import main
from gradaccum.data.corpus import MarkovCorpus
from gradaccum.train.rundir import trackers
from gradaccum.train.rundir.metrics import read_metrics

from .helpers import one_line_error

# found, not imported: trackio takes its folder from TRACKIO_DIR once, when first imported
MISSING = [
    p for p in ("wandb", "mlflow", "trackio", "tensorboard") if not importlib.util.find_spec(p)
]
pytestmark = pytest.mark.skipif(bool(MISSING), reason=f"the dev extra's {MISSING} not installed")

UNSET = (
    "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy",
    "WANDB_MODE", "WANDB_DIR", "WANDB_PROJECT", "WANDB_API_KEY", "WANDB_BASE_URL",
    "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "TRACKIO_DIR", "TRACKIO_SPACE_ID",
    "TRACKIO_SERVER_URL",
)  # fmt: skip
"""What could point a tracker at a network: none of it set, W&B must stay offline by itself."""

LR, SEED = 0.002, 7
SMALL = ["--seq-len", "16", "--micro-batch", "2", "--accum-steps", "2", "--eval-every", "0"]


def argv(out, data, *extra) -> list[str]:
    settings = ["--lr", str(LR), "--seed", str(SEED)]
    return ["train", "--data", str(data), *SMALL, *settings, "--out", str(out), *extra]


@pytest.fixture(scope="module")
def environment():
    """The environment without UNSET, and as it was again afterwards (the trackers' own
    switches the run sets included)."""
    before = dict(os.environ)
    for name in UNSET:
        os.environ.pop(name, None)
    # trackio reads TRACKIO_DIR when first imported; an earlier test's import (trl's
    # GRPOTrainer imports it) would have fixed its folder: the run imports it anew, as the
    # process of a `gradaccum train` does
    earlier = _trackio_modules()
    for name in earlier:
        del sys.modules[name]
    yield
    for name in _trackio_modules():
        del sys.modules[name]
    sys.modules.update(earlier)
    os.environ.clear()
    os.environ.update(before)


def _trackio_modules() -> dict:
    return {n: m for n, m in sys.modules.items() if n == "trackio" or n.startswith("trackio.")}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "markov.npy"
    np.save(path, MarkovCorpus().generate(6_000, seed=3).astype(np.uint16))
    return path


@pytest.fixture(scope="module")
def run(tmp_path_factory, data, environment):
    """A run to step 3 reporting to every tracker, resumed from its step-2 checkpoint to
    step 4; (its folder, trackers.json after the first session)."""
    out = tmp_path_factory.mktemp("trackers") / "run"
    every = "tensorboard,wandb,mlflow,trackio"
    assert main(argv(out, data, "--max-steps", "3", "--save-every", "2", "--report-to", every)) == 0
    first = json.loads((out / "trackers.json").read_text())
    (out / "checkpoints" / "step-00000003" / "model.pt").write_bytes(b"")  # damaged: from 2
    assert main(["train", "--resume", "--out", str(out), "--max-steps", "4"]) == 0
    return out, first


def jsonl(out) -> tuple[dict[int, float], dict[int, float]]:
    """metrics.jsonl's training losses and held-out losses, by step."""
    records = read_metrics(os.path.join(out, "metrics.jsonl"))
    train = {r["step"]: r["loss"] for r in records if "loss" in r}
    evals = {r["step"]: r["eval_loss"] for r in records if "eval_loss" in r}
    return train, evals


def holds(logged: list[tuple[int, float]], lines: dict[int, float], f32=False) -> bool:
    """Every step of `lines` logged, and every value logged at a step is that step's value in
    metrics.jsonl (a step logged twice, before and after the resume, holds the same loss: the
    resume is exact); compared at float32 where the tracker keeps float32."""
    as_kept = np.float32 if f32 else float
    return {s for s, _ in logged} == set(lines) and all(
        as_kept(v) == as_kept(lines[s]) for s, v in logged
    )


# ---- readers: each tracker's own files, through its own library --------------------------


def wandb_records(path):
    """The records of a W&B .wandb file (LevelDB's log format: 32 KiB blocks of chunks, each
    with a 7-byte header, after a 7-byte file header), as wandb's own protobuf Records."""
    from wandb.proto import wandb_internal_pb2

    data, pos, payload, block = Path(path).read_bytes(), 7, b"", 32768
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        payload += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(payload)
            yield record
            payload = b""


def wandb_runs(out) -> list[Path]:
    return sorted((out / "wandb").glob("*run-*"))


def wandb_history(folder: Path, key: str) -> list[tuple[int, float]]:
    (path,) = folder.glob("*.wandb")
    got = []
    for record in wandb_records(path):
        if record.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): i.value_json for i in record.history.item}
            if key in items:
                got.append((record.history.step.num, json.loads(items[key])))
    return got


def wandb_config(folder: Path) -> dict:
    (path,) = folder.glob("*.wandb")
    config = {}
    for record in wandb_records(path):
        if record.WhichOneof("record_type") == "config":
            config.update({i.key: json.loads(i.value_json) for i in record.config.update})
    return config


def mlflow_client(out):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=(out / "mlruns").as_uri())


def trackio_logs(name: str, key: str) -> list[tuple[int, float]]:
    from trackio.sqlite_storage import SQLiteStorage

    logs = SQLiteStorage.get_logs(trackers.PROJECT, name)
    return [(r["step"], r[key]) for r in logs if key in r]


def tensorboard_scalars(out, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


# ---- what each tracker holds -----------------------------------------------------------


def test_every_tracker_holds_the_losses_of_metrics_jsonl_at_their_steps(run):
    out, _ = run
    train, evals = jsonl(out)
    assert sorted(train) == [1, 2, 3, 4] and sorted(evals) == [4]
    ids = json.loads((out / "trackers.json").read_text())
    history = [wandb_history(folder, "train/loss") for folder in wandb_runs(out)]
    assert [sorted(s for s, _ in h) for h in history] == [[1, 2, 3], [3, 4]]
    assert holds(history[0] + history[1], train)
    client, run_id = mlflow_client(out), ids["mlflow"]["run_id"]
    mlflow = [(m.step, m.value) for m in client.get_metric_history(run_id, "train/loss")]
    assert len(mlflow) == 5 and holds(mlflow, train)  # step 3 from both sessions
    eval_4 = [(m.step, m.value) for m in client.get_metric_history(run_id, "eval/eval_loss")]
    assert (4, evals[4]) in eval_4  # and the first session's end, step 3: not purged
    trackio = trackio_logs(ids["trackio"]["name"], "train/loss")
    assert len(trackio) == 5 and holds(trackio, train)
    assert (4, evals[4]) in trackio_logs(ids["trackio"]["name"], "eval/eval_loss")
    tensorboard = tensorboard_scalars(out, "train/loss")  # purged past the checkpoint
    assert holds(tensorboard, train, f32=True) and len(tensorboard) == 4
    assert holds(tensorboard_scalars(out, "eval/eval_loss"), evals, f32=True)


def test_the_settings_are_each_trackers_parameters(run):
    out, _ = run
    ids = json.loads((out / "trackers.json").read_text())
    for folder in wandb_runs(out):
        config = wandb_config(folder)
        assert config["lr"] == LR and config["seed"] == SEED and config["max_steps"] in (3, 4)
    params = mlflow_client(out).get_run(ids["mlflow"]["run_id"]).data.params
    assert params["lr"] == str(LR) and params["seed"] == str(SEED)
    assert params["max_steps"] == "3"  # MLflow keeps a parameter's first value
    import trackio

    (found,) = [r for r in trackio.Api().runs(trackers.PROJECT) if r.name == ids["trackio"]["name"]]
    assert found.config["lr"] == LR and found.config["seed"] == SEED


def test_a_resume_continues_the_same_tracker_runs_offline(run):
    out, first = run
    ids = json.loads((out / "trackers.json").read_text())
    assert ids == first  # the same W&B id, MLflow run and trackio run
    folders = wandb_runs(out)
    # W&B stayed offline by itself: each session an offline run folder of the same id
    assert len(folders) == 2 and all(f.name.startswith("offline-run-") for f in folders)
    assert all(f.name.endswith(f"-{first['wandb']['id']}") for f in folders)
    client = mlflow_client(out)
    experiment = client.get_experiment_by_name(trackers.PROJECT)
    (only,) = client.search_runs([experiment.experiment_id])
    assert only.info.run_id == first["mlflow"]["run_id"] and only.info.status == "FINISHED"
    assert ids["mlflow"]["tracking_uri"] == (out / "mlruns").as_uri()
    assert ids["trackio"]["dir"] == str(out / "trackio")


def test_the_plots_go_to_the_trackers_that_take_files(run):
    out, _ = run
    ids = json.loads((out / "trackers.json").read_text())
    assert (out / "loss.png").exists()
    artifacts = mlflow_client(out).list_artifacts(ids["mlflow"]["run_id"])
    assert "loss.png" in [a.path for a in artifacts]
    last = wandb_runs(out)[-1]
    assert list(last.glob("files/media/images/plots/loss_*.png"))
    image = trackio_logs(ids["trackio"]["name"], "plots/loss")
    assert image and image[0][1]["_type"] == "trackio.image"
    assert list((out / "trackio" / "media").rglob("*.png"))


# ---- failures ------------------------------------------------------------------------------


def test_a_tracker_that_raises_is_turned_off_in_one_line_and_the_run_finishes(
    tmp_path, data, environment, monkeypatch, capsys
):
    real = trackers.MlflowTracker.log

    def broken_from_step_2(self, record):
        if record["step"] >= 2:
            raise ConnectionError("tracking server went away")
        real(self, record)

    def no_login(self, start):
        raise PermissionError("no API key")

    monkeypatch.setattr(trackers.MlflowTracker, "log", broken_from_step_2)
    monkeypatch.setattr(trackers.WandbTracker, "open", no_login)
    out = tmp_path / "run"
    extra = ["--max-steps", "3", "--report-to", "mlflow,tensorboard,wandb"]
    assert main(argv(out, data, *extra)) == 0
    said = capsys.readouterr().out.splitlines()
    warned = [line for line in said if "MLflow" in line or "W&B" in line]
    assert warned == [
        "W&B failed (no API key); W&B is off from the start, "
        "metrics.jsonl goes on holding every field",
        "MLflow failed (tracking server went away); MLflow is off from step 2, "
        "metrics.jsonl goes on holding every field",
    ]
    train, evals = jsonl(out)
    assert sorted(train) == [1, 2, 3] and sorted(evals) == [3]
    assert len(tensorboard_scalars(out, "train/loss")) == 3  # the other tracker went on
    run_id = json.loads((out / "trackers.json").read_text())["mlflow"]["run_id"]
    client = mlflow_client(out)
    assert [m.step for m in client.get_metric_history(run_id, "train/loss")] == [1]
    assert client.get_run(run_id).info.status == "FAILED"
    assert "; mlruns/ not written (past step 1: tracking server went away)" in said[-1]


@pytest.mark.parametrize("name", ["wandb", "mlflow", "trackio"])
def test_a_tracker_not_installed_is_refused_before_anything_is_written(
    name, tmp_path, data, capsys, monkeypatch
):
    monkeypatch.setitem(sys.modules, name, None)  # import fails: not installed
    out = tmp_path / "run"
    line = one_line_error(capsys, argv(out, data, "--report-to", f"tensorboard,{name}"))
    assert line.endswith(
        f"--report-to tensorboard,{name}: {name} is not installed: "
        "pip install 'gradaccum[trackers]'"
    )
    assert not out.exists()


@pytest.mark.parametrize(
    "value, why",
    [
        ("wandb,comet", "unknown tracker 'comet'"),
        ("none,wandb", "a comma list of"),
        (",", "a comma list of"),
    ],
)
def test_an_unknown_tracker_is_one_line_listing_the_choices(value, why, tmp_path, data, capsys):
    out = tmp_path / "run"
    line = one_line_error(capsys, argv(out, data, "--report-to", value))
    assert f"--report-to {value}: {why}" in line
    assert line.endswith("a comma list of tensorboard, wandb, mlflow, trackio, or none")
    assert not out.exists()


def test_report_to_reads_as_transformers_report_to_and_tensorboard_joins_it():
    from gradaccum.train.config import TrainConfig

    config = TrainConfig(report_to=["wandb", " MLflow", "wandb"], tensorboard=True)  # a file's list
    assert config.report_to == "wandb,mlflow"
    assert config.trackers == ("tensorboard", "wandb", "mlflow")
    assert TrainConfig().report_to == "none" and TrainConfig().trackers == ()
    assert TrainConfig(report_to="tensorboard", tensorboard=True).trackers == ("tensorboard",)
