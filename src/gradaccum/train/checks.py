"""What the run's build step checks before it reads data or writes anything (`prepare`): the
output folder, the paths, the device, the run folder's lock. Each failure is a BadInput naming
the flag and the value."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace

import yaml

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

from gradaccum.data.hf_datasets import folder_problem
from gradaccum.grpo.rewards import portable
from gradaccum.models.build import is_hf_folder
from gradaccum.parallel import devices
from gradaccum.train.config import FLAGS, TrainConfig
from gradaccum.train.rundir import checkpoint, trackers
from gradaccum.train.rundir.lock import LOCK_FILE, refuse_if_held
from gradaccum.train.rundir.settings import LEGACY_SETTINGS_FILE, RESUME_AUTO, SETTINGS_FILE
from gradaccum.train.tasks import rules_of
from gradaccum.utils.choices import check_builtin_model
from gradaccum.utils.errors import BadInput


def prepare(config: TrainConfig) -> TrainConfig:
    """`config` with its default --out chosen and its paths absolute (a resume from another
    folder finds them), after every check that needs no data: nothing read, nothing written."""
    config = replace(
        config,
        out=config.out or default_out(),
        **{
            name: os.path.abspath(getattr(config, name))
            for name in ("data", "eval_data", "model_config", "init_from")
            if getattr(config, name) is not None and not getattr(config, name).startswith("hf:")
        },
    )
    # a module of the working directory by its file, which --config finds from anywhere
    config = replace(config, reward=portable(config.reward), task=portable(config.task))
    if config.resume == RESUME_AUTO:  # from Python; the command line's is settled before
        config = replace(config, resume=bool(checkpoint.step_folders(config.out)))
    check_out_folder(config.out)
    if not config.resume:  # a resume's model comes from its checkpoint, not from these paths
        check_paths(config)
    elif config.data is not None:
        check_paths(replace(config, model_config=None, init_from=None, model=None))
    if config.init_from is not None and None in (config.lr, config.weight_decay):
        # not given (a resume has its checkpoint's): a pretrained model's, or the task's
        config = config.with_model_defaults(is_hf_folder(config.init_from))
    check_device(config.device)
    check_run_folder(config.out, config.resume)
    trackers.check_installed(config)  # --report-to, --tensorboard
    return config


def default_out() -> str:
    """runs/<date>-<time> under the current folder: where a run without --out writes; with
    -2, -3, ... added when a run started in the same second already has that folder."""
    base = os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))
    path, n = base, 1
    while os.path.exists(path):
        n += 1
        path = f"{base}-{n}"
    return path


def check_out_folder(out: str) -> None:
    """--out must be a folder, or creatable as one, that this process can write in, and,
    when it exists and holds anything, one of our runs (`is_run_folder`): a folder of the
    user's is refused before anything in it is touched. The nearest existing folder is probed
    with a folder made and removed at once: permission bits say nothing for root or on a
    read-only mount."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise BadInput("--out", out, "exists and is not a folder")
    if os.path.isdir(out) and not is_run_folder(out):
        entries = sorted(os.listdir(out))
        shown = ", ".join(entries[:3]) + (
            f" and {len(entries) - 3} more" if len(entries) > 3 else ""
        )
        raise BadInput(
            "--out",
            out,
            f"holds files that are not a gradaccum run ({shown}); choose an empty or new folder",
        )
    path = os.path.abspath(out)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    if not os.path.isdir(path):
        raise BadInput("--out", out, f"{path} is a file, not a folder")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".gradaccum-probe-", dir=path))
    except OSError as err:
        raise BadInput("--out", out, f"{path} is not writable ({err.strerror})") from None


WARM_START = "sft"
"""The folder of a --task grpo run's SFT stage, in --out (`gradaccum.train.tasks.grpo`'s `first_stage`)."""
START_ENTRIES = (".lock",)
"""What a run writes before its config.yaml: a folder holding only these (and .tmp- files,
atomic writes cut short) is a run whose start was cut short."""


def is_run_folder(out: str) -> bool:
    """Whether existing folder `out` is empty or one of our runs: it holds a config.yaml (or
    an earlier version's train.toml) whose keys are all train settings, a metrics.jsonl whose
    first line is one of our records (or no complete line yet), or a checkpoints/ folder
    holding only checkpoints (step-NNNNNNNN, `latest`, .tmp- leftovers); or nothing but what
    a run writes first (the lock). A run stopped by a double Ctrl-C before its first
    checkpoint is one (config.yaml, metrics.jsonl); so is a run folder the user added files
    to (notes), since it still holds these."""
    entries = os.listdir(out)
    if all(e in START_ENTRIES or e.startswith(".tmp-") for e in entries):
        return True
    warm = os.path.join(out, WARM_START)
    if set(entries) - set(START_ENTRIES) == {WARM_START} and os.path.isdir(warm):
        return is_run_folder(warm)  # a --task grpo run stopped in its SFT stage
    return (
        _our_settings(os.path.join(out, SETTINGS_FILE))
        or _our_train_toml(os.path.join(out, LEGACY_SETTINGS_FILE))
        or _our_metrics(os.path.join(out, "metrics.jsonl"))
        or _our_checkpoints(os.path.join(out, checkpoint.CHECKPOINTS))
    )


def undo_start(out: str) -> Callable[[], None]:
    """For a new run's start: a function that removes what the start made in `out` from now
    on, when it fails (a full disk): the folders made down to `out` when it does not exist
    yet, else those of the files a start writes (lock, config.yaml, metrics.jsonl,
    the trackers' folders) that are not there now. What was there is left."""
    path, top = os.path.abspath(out), None
    while not os.path.exists(path):
        top, path = path, os.path.dirname(path)
    before = set(os.listdir(out)) if top is None else set()

    def undo() -> None:
        if top is not None:
            shutil.rmtree(top, ignore_errors=True)
            return
        for name in (LOCK_FILE, SETTINGS_FILE, "metrics.jsonl", *trackers.FOLDERS):
            entry = os.path.join(out, name)
            if name in before or not os.path.lexists(entry):
                continue
            shutil.rmtree(entry, ignore_errors=True) if os.path.isdir(entry) else os.unlink(entry)

    return undo


def _our_settings(path: str) -> bool:
    if not os.path.isfile(path):
        return False
    try:
        with open(path, "rb") as f:
            values = yaml.safe_load(f)
    except (OSError, ValueError, yaml.YAMLError):
        return False
    if not isinstance(values, dict):
        return False
    flat = {}
    for key, value in values.items():  # a section per component, as written
        flat.update(value if isinstance(value, dict) else {key: value})
    return _all_settings(flat)


def _all_settings(values: dict) -> bool:
    return all(
        key.replace("-", "_") in FLAGS and isinstance(value, (str, int, float, bool))
        for key, value in values.items()
    )


def _our_train_toml(path: str) -> bool:
    if not os.path.isfile(path):
        return False
    try:
        with open(path, "rb") as f:
            values = tomllib.load(f)
    except (OSError, ValueError):  # TOMLDecodeError and UnicodeDecodeError are ValueErrors
        return False
    return _all_settings(values)  # flat: a setting's name = its value


def _our_metrics(path: str) -> bool:
    if not os.path.isfile(path):
        return False
    try:
        with open(path, "rb") as f:
            head = f.read(1 << 16)
    except OSError:
        return False
    if b"\n" not in head:  # not one complete line yet: a run cut short at its first
        return head.strip() == b"" or head.startswith(b'{"step": ')
    try:
        first = json.loads(head.split(b"\n", 1)[0])
    except ValueError:
        return False
    return isinstance(first, dict) and isinstance(first.get("step"), int)


def _our_checkpoints(path: str) -> bool:
    if not os.path.isdir(path):
        return False
    return all(
        checkpoint.is_step_name(e) or e == checkpoint.LATEST or e.startswith(".tmp-")
        for e in os.listdir(path)
    )


def check_paths(config) -> None:
    """The files and folders the flags name exist and are of the right kind, and --model
    names a built-in preset."""
    data = config.data
    if data is not None and not data.startswith("hf:"):
        if os.path.isdir(data):
            problem = folder_problem(data, config.task, rules_of(config.task).reads_rows)
            if problem is not None:
                raise BadInput(problem)
        elif not os.path.isfile(data):
            raise BadInput("--data", data, "no such file")
    if config.model_config is not None and not os.path.exists(config.model_config):
        raise BadInput("--model-config", config.model_config, "no such file")
    if config.init_from is not None and not os.path.isdir(config.init_from):
        raise BadInput("--init-from", config.init_from, "no such folder")
    if config.model is not None:
        check_builtin_model(config.model, "--model")


def check_device(device: str) -> None:
    """--device names a device this machine has (or is auto): `devices.check_device`, the
    check every command with --device shares."""
    devices.check_device(device)


def holds_sft_stage(out: str) -> bool:
    """Whether --out holds a --task grpo run's SFT stage (`WARM_START`): a run to continue
    with --resume, also before the GRPO stage's first checkpoint (`first_stage` goes on)."""
    return os.path.isdir(os.path.join(out, WARM_START))


def check_run_folder(out: str, resume: bool) -> None:
    """--out is not in use by a running run; it holds a run exactly when --resume is given.

    A folder whose run stopped before its first checkpoint (a double Ctrl-C at the start)
    holds nothing to resume: a new run may start over in it."""
    refuse_if_held(out)
    has_checkpoint = bool(checkpoint.step_folders(out))
    finished = os.path.exists(os.path.join(out, "model.pt"))
    if holds_sft_stage(out):
        has_checkpoint = finished = True
    if resume and not has_checkpoint:
        raise BadInput("--resume", out, "no checkpoint in this folder to resume from")
    if not resume and (has_checkpoint or finished):
        raise BadInput(
            "--out",
            out,
            "holds a previous run; add --resume to continue it or choose another folder",
        )
