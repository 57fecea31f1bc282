"""What the run's build step checks before it reads data or writes anything: the output
folder, the paths, the device. Each failure is a BadInput naming the flag and the value."""

from __future__ import annotations

import os
import tempfile
import time

from ..errors import BadInput
from . import checkpoint
from .lock import RunLock


def default_out() -> str:
    """runs/<date>-<time> under the current folder: where a run without --out writes."""
    return os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))


def check_out_folder(out: str) -> None:
    """--out must be a folder, or creatable as one, that this process can write in. The
    nearest existing folder is probed with a folder made and removed at once: permission
    bits say nothing for root or on a read-only mount."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise BadInput("--out", out, "exists and is not a folder")
    path = os.path.abspath(out)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    if not os.path.isdir(path):
        raise BadInput("--out", out, f"{path} is a file, not a folder")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".gradaccum-probe-", dir=path))
    except OSError as err:
        raise BadInput("--out", out, f"{path} is not writable ({err.strerror})") from None


def check_paths(config) -> None:
    """The files and folders the flags name exist and are of the right kind."""
    from .model import PRESETS

    data = config.data
    if data is not None and not data.startswith("hf:"):
        if os.path.isdir(data):
            raise BadInput("--data", data, "is a folder; expected a .txt, .bin or .npy file")
        if not os.path.isfile(data):
            raise BadInput("--data", data, "no such file")
    if config.model_config is not None and not os.path.exists(config.model_config):
        raise BadInput("--model-config", config.model_config, "no such file")
    if config.init_from is not None and not os.path.isdir(config.init_from):
        raise BadInput("--init-from", config.init_from, "no such folder")
    if config.model is not None and config.model not in PRESETS:
        raise BadInput(
            "--model", config.model, f"unknown preset; choose one of {', '.join(PRESETS)}"
        )


def check_device(device: str) -> None:
    """--device names a device kind this machine has (or is auto)."""
    import torch

    from ..devices import available

    if device == "auto":
        return
    try:
        kind = torch.device(device).type
    except (RuntimeError, ValueError):
        raise BadInput(
            "--device", device, "not a device (cpu, cuda, cuda:1, npu, mps, xpu, auto)"
        ) from None
    try:
        ok = available(kind)
    except ValueError:
        ok = False
    if not ok:
        raise BadInput("--device", device, "not available on this machine")


def check_run_folder(out: str, resume: bool) -> None:
    """--out is not in use by a running run; it holds a run exactly when --resume is given.

    A folder whose run stopped before its first checkpoint (a double Ctrl-C at the start)
    holds nothing to resume: a new run may start over in it."""
    holder = RunLock(out).holder()
    if holder is not None:
        raise BadInput(
            "--out",
            out,
            f"in use by a running run ({holder}); wait for it or choose another folder",
        )
    has_checkpoint = bool(checkpoint.step_folders(out))
    finished = os.path.exists(os.path.join(out, "model.pt"))
    if resume and not has_checkpoint:
        raise BadInput("--resume", out, "no checkpoint in this folder to resume from")
    if not resume and (has_checkpoint or finished):
        raise BadInput(
            "--out",
            out,
            "holds a previous run; add --resume to continue it or choose another folder",
        )
