"""Checkpoints that a kill at any moment cannot break.

Layout under --out:

    checkpoints/step-00000200/   model.pt      the model's state_dict (tensors only)
                                 config.json   what train/model.py's build_model(init_from=)
                                               reads to rebuild the model
                                 trainer.pt    optimizer, scheduler, accumulator, data position,
                                               RNG states, config, progress counters
                                 train_config.json   the run's settings as given (for --resume)
                                 manifest.json size and sha256 of each file above, written last
    checkpoints/latest           the name of the newest complete checkpoint

A checkpoint is written into a temporary folder next to the others, every file fsynced, then
renamed into place (a rename is atomic); only then does `latest` move to it (written aside and
renamed too), and only then are older checkpoints removed (all but the newest
--keep-checkpoints and the best one of --save-best, `best.Best`). A kill at any point leaves
the previous checkpoint and a `latest` that names a complete folder. Everything is saved as
tensors and plain containers, so both files load with torch.load(weights_only=True).

What a rename cannot protect against (a file truncated, deleted or overwritten later, a disk
that returns other bytes) the manifest catches: `newest_intact` checks sizes and checksums
and falls back to the newest checkpoint that passes, naming what it skipped.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import tempfile
from dataclasses import dataclass

import numpy as np
import torch

from gradaccum.utils.atomic import fsync_dir, umask, write_atomic, write_text_atomic, writing
from gradaccum.utils.errors import first_line

CHECKPOINTS = "checkpoints"
LATEST = "latest"
MANIFEST = "manifest.json"
_NAME = re.compile(r"^step-(\d+)$")


@dataclass
class Checkpoint:
    """A checkpoint read back from disk."""

    path: str
    """The checkpoint's folder."""
    step: int
    """Optimizer steps taken when it was saved."""
    model_state: dict
    """The model's state_dict (unwrapped: no DDP `module.` prefix)."""
    model_config: dict
    """The model's config.json."""
    trainer_state: dict
    """Everything else the run needs to continue exactly (see save())."""


def _write_synced(path: str, write) -> None:
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def save_model(folder: str, model_state: dict, model_config: dict, write=None) -> None:
    """model.pt (state_dict) and config.json into `folder`. By default each is written
    atomically, so a kill mid-export or a full disk leaves the previous export whole (DiskFull
    names the file); a checkpoint, whose whole folder is renamed into place, writes them
    plainly (`write=_write_synced`)."""
    write = write or write_atomic
    write(os.path.join(folder, "model.pt"), lambda f: torch.save(model_state, f))
    text = json.dumps(model_config, indent=2, sort_keys=True).encode("utf-8")
    write(os.path.join(folder, "config.json"), lambda f: f.write(text))


def save(
    out: str,
    step: int,
    model_state: dict,
    model_config: dict,
    trainer_state: dict,
    run_config: dict | None = None,
    keep: int = 1,
    best: int | None = None,
) -> str:
    """Write checkpoint `step` under out/checkpoints atomically; keep the newest `keep`, and
    the checkpoint of step `best` (--save-best's, not counted in `keep`) beside them.

    Returns the checkpoint's folder. If writing fails (or the process dies), the previous
    checkpoint and `latest` are untouched and nothing half-written is left: no room on the
    disk raises DiskFull naming the checkpoint's folder, a Ctrl-C KeyboardInterrupt.
    """
    root = os.path.join(out, CHECKPOINTS)
    name = f"step-{step:08d}"
    final = os.path.join(root, name)
    with writing(final):
        os.makedirs(root, exist_ok=True)
        _write_folder(root, name, model_state, model_config, trainer_state, run_config)
        try:
            write_text_atomic(os.path.join(root, LATEST), name + "\n")
        except BaseException:
            # Where `latest` still names the previous checkpoint, the new one was never made
            # current: it goes, and the folder is as it was before this save.
            if _latest_text(root) != name:
                _remove(root, name)
            raise
    _prune(root, keep, step, best)
    return final


def _write_folder(root, name, model_state, model_config, trainer_state, run_config) -> None:
    """Every file of checkpoint `name` into a folder aside, fsynced, renamed to root/name."""
    final = os.path.join(root, name)
    tmp = tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=root)
    try:
        os.chmod(tmp, 0o777 & ~umask())  # mkdtemp makes it owner-only
        save_model(tmp, model_state, model_config, write=_write_synced)
        _write_synced(os.path.join(tmp, "trainer.pt"), lambda f: torch.save(trainer_state, f))
        if run_config is not None:
            text = json.dumps(run_config, indent=2, sort_keys=True).encode("utf-8")
            _write_synced(os.path.join(tmp, "train_config.json"), lambda f: f.write(text))
        manifest = json.dumps(_manifest(tmp), indent=2, sort_keys=True).encode("utf-8")
        _write_synced(os.path.join(tmp, MANIFEST), lambda f: f.write(manifest))
        fsync_dir(tmp)
        if os.path.exists(final):
            # A folder of this step left by a run that died before moving `latest` to it:
            # `latest` does not name it, so it can go.
            _remove(root, name)
        os.replace(tmp, final)
        fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _remove(root: str, name: str) -> None:
    """Remove folder root/name, first renamed aside (.tmp-gone-*, a rename needs no room on
    a full disk): a kill part-way leaves a .tmp- folder that the next save clears, never a
    step-* folder with some of its files gone."""
    aside = os.path.join(root, f".tmp-gone-{name}")
    shutil.rmtree(aside, ignore_errors=True)
    try:
        os.replace(os.path.join(root, name), aside)
    except OSError:
        aside = os.path.join(root, name)
    shutil.rmtree(aside, ignore_errors=True)


def is_step_name(name: str) -> bool:
    """Whether `name` is a checkpoint folder's name (step-00000200)."""
    return _NAME.match(name) is not None


def _steps(root: str) -> list[tuple[int, str]]:
    found = []
    for entry in os.listdir(root):
        match = _NAME.match(entry)
        if match and os.path.isdir(os.path.join(root, entry)):
            found.append((int(match.group(1)), entry))
    return sorted(found)


def _prune(root: str, keep: int, step: int, best: int | None = None) -> None:
    # Folders past `step` are from before a resume that fell back to an older checkpoint.
    kept = {read_latest_name(root), None if best is None else f"step-{best:08d}"}
    complete = [name for s, name in _steps(root) if s <= step]
    for name in [name for s, name in _steps(root) if s > step]:
        _remove(root, name)
    for name in complete[: max(0, len(complete) - keep)]:
        if name not in kept:
            _remove(root, name)
    for entry in os.listdir(root):  # half-written folders of runs that died mid-save
        if entry.startswith(".tmp-"):
            path = os.path.join(root, entry)
            shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.unlink(path)


def _latest_text(root: str) -> str | None:
    """What `latest` says, whether or not the folder it names is there."""
    try:
        with open(os.path.join(root, LATEST), encoding="utf-8") as f:
            return f.read().strip()
    except (OSError, ValueError):
        return None


def read_latest_name(root: str) -> str | None:
    name = _latest_text(root)
    if name is None:
        return None
    return name if _NAME.match(name) and os.path.isdir(os.path.join(root, name)) else None


def step_folders(out: str) -> list[str]:
    """The complete checkpoint folders under `out`, oldest first (none when there are none)."""
    root = os.path.join(out, CHECKPOINTS)
    return [os.path.join(root, name) for _, name in _steps(root)] if os.path.isdir(root) else []


def find_latest(out: str) -> str | None:
    """The folder of the newest complete checkpoint under `out`, or None.

    `latest` decides; without it (a run killed between its first rename and writing
    `latest`), the highest complete step-* folder: a folder only gets that name once whole.
    """
    root = os.path.join(out, CHECKPOINTS)
    if not os.path.isdir(root):
        return None
    name = read_latest_name(root)
    if name is None:
        steps = _steps(root)
        if not steps:
            return None
        name = steps[-1][1]
    return os.path.join(root, name)


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _manifest(folder: str) -> dict:
    files = {}
    for name in sorted(os.listdir(folder)):
        if name != MANIFEST:
            path = os.path.join(folder, name)
            files[name] = {"bytes": os.path.getsize(path), "sha256": _sha256(path)}
    return {"files": files}


def damage(path: str) -> str | None:
    """What is wrong with checkpoint folder `path` by its manifest, in words; None if every
    file it lists is there with its size and checksum. A folder without a manifest (written
    by an older version) is judged by whether its files load."""
    manifest_path = os.path.join(path, MANIFEST)
    if not os.path.exists(manifest_path):
        try:
            load(path)
            read_run_config(path)
        except Exception as err:  # any failure to read back is damage, named in one line
            return f"does not load ({first_line(err)})"
        return None
    try:
        with open(manifest_path, encoding="utf-8") as f:
            files = json.load(f)["files"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"{MANIFEST} unreadable ({first_line(err)})"
    for name, want in files.items():
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            return f"{name} is missing"
        size = os.path.getsize(file)
        if size != want["bytes"]:
            return f"{name} holds {size} bytes, the manifest says {want['bytes']}"
        if _sha256(file) != want["sha256"]:
            return f"{name} does not match its checksum"
    return None


def verifiable(path: str) -> bool:
    """Whether checkpoint folder `path` has the manifest its files can be checked against."""
    return os.path.isfile(os.path.join(path, MANIFEST))


def newest_intact(out: str) -> tuple[str | None, list[str]]:
    """The newest checkpoint folder under `out` that passes `damage`, and one line per newer
    one that did not ("step-00000004: model.pt is missing").

    A folder without its manifest (deleted, or written by an older version) cannot be
    verified: an older folder that passes its manifest is preferred to it, the unverified one
    named among the skipped ("step-00000004: no manifest.json, so it cannot be verified").
    Only when no verified folder is left is the newest unverified one that loads returned
    (`verifiable(path)` then says False)."""
    root = os.path.join(out, CHECKPOINTS)
    skipped: list[str] = []
    unverified: tuple[str, int] | None = None  # its folder, and the lines skipped before it
    for _, name in reversed(_steps(root) if os.path.isdir(root) else []):
        folder = os.path.join(root, name)
        why = damage(folder)
        if why is None and verifiable(folder):
            return folder, skipped
        if why is None:
            unverified = unverified or (folder, len(skipped))
            why = f"no {MANIFEST}, so it cannot be verified"
        skipped.append(f"{name}: {why}")
    if unverified is not None:
        return unverified[0], skipped[: unverified[1]]
    return None, skipped


def load(path: str, map_location="cpu") -> Checkpoint:
    """Read a checkpoint folder (as returned by find_latest) with weights_only=True."""
    model_state = torch.load(
        os.path.join(path, "model.pt"), map_location=map_location, weights_only=True
    )
    trainer_state = torch.load(
        os.path.join(path, "trainer.pt"), map_location=map_location, weights_only=True
    )
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        model_config = json.load(f)
    return Checkpoint(
        path=path,
        step=int(trainer_state["step"]),
        model_state=model_state,
        model_config=model_config,
        trainer_state=trainer_state,
    )


def read_run_config(path: str) -> dict:
    """The run settings saved with a checkpoint folder (train_config.json)."""
    with open(os.path.join(path, "train_config.json"), encoding="utf-8") as f:
        return json.load(f)


def rng_state() -> dict:
    """Python, numpy and torch (CPU) RNG states, as tensors and numbers."""
    py_version, py_state, py_gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    return {
        "python": {
            "version": py_version,
            "state": torch.tensor(py_state, dtype=torch.int64),
            "gauss": py_gauss,
        },
        "numpy": {
            "name": np_name,
            "keys": torch.from_numpy(np_keys.astype(np.int64)),
            "pos": int(np_pos),
            "has_gauss": int(np_has_gauss),
            "gauss": float(np_gauss),
        },
        "torch": torch.get_rng_state(),
    }


def set_rng_state(state: dict) -> None:
    """Restore what rng_state() returned."""
    py = state["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss"]))
    nps = state["numpy"]
    np.random.set_state(
        (
            nps["name"],
            nps["keys"].numpy().astype(np.uint32),
            nps["pos"],
            nps["has_gauss"],
            nps["gauss"],
        )
    )
    torch.set_rng_state(state["torch"])
