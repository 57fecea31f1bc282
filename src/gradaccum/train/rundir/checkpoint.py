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

A run whose model is sharded (--sync micro, hsdp) writes no model.pt: its model's and
AdamW's state, keyed by parameter name, go through torch.distributed.checkpoint into
step-*/sharded/ (`save_sharded`), every rank writing its own shards into the temporary folder
(`sharding.save_sharded`: __<rank>_0.distcp, and .metadata), so that no process holds the
whole state; rank 0 writes the rest (trainer.pt without the optimizer's tensors), the
manifest over every file, the shards included, and renames the folder into place. Such a
checkpoint resumes on any number of ranks under any sync policy (`sharding.load_sharded`
reshards it), and `read_model_state` reads its model whole. trainer.pt's "format" is
`FORMAT`; a checkpoint without it (format 1) has model.pt and the optimizer whole in
trainer.pt, and resumes as before.

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

from gradaccum.models.sharded_state import read_sharded_model
from gradaccum.parallel import collectives, sharding
from gradaccum.utils.atomic import (
    fsync_dir,
    no_room,
    umask,
    write_atomic,
    write_text_atomic,
    writing,
)
from gradaccum.utils.errors import first_line

CHECKPOINTS = "checkpoints"
LATEST = "latest"
MANIFEST = "manifest.json"
_NAME = re.compile(r"^step-(\d+)$")
SHARDED = "sharded"
"""The sub-folder of a sharded run's checkpoint that dcp's files are in."""
FORMAT_KEY, FORMAT = "format", 2
"""trainer.pt's checkpoint format: 2 writes model.pt or sharded/ and the task's own state
(`task`); a checkpoint without the key is format 1 (model.pt, the optimizer whole in
trainer.pt, no task state), and resumes as it is; a newer one is refused."""


@dataclass
class Checkpoint:
    """A checkpoint read back from disk."""

    path: str
    """The checkpoint's folder."""
    step: int
    """Optimizer steps taken when it was saved."""
    model_state: dict | None
    """The model's state_dict (unwrapped: no DDP `module.` prefix); None for a sharded
    checkpoint, whose weights are read into the run's model (`sharding.load_sharded`) or
    whole by `read_model_state`."""
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
    _save_config(folder, model_config, write)


def _save_config(folder: str, model_config: dict, write) -> None:
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
    root, name = os.path.join(out, CHECKPOINTS), f"step-{step:08d}"
    with writing(os.path.join(root, name)):
        os.makedirs(root, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=root)
        _write_folder(root, name, tmp, model_state, model_config, trainer_state, run_config)
        _make_latest(root, name)
    _prune(root, keep, step, best)
    return os.path.join(root, name)


def save_sharded(
    out: str,
    step: int,
    shards: dict,
    model_config: dict,
    trainer_state: dict | None,
    run_config: dict | None = None,
    keep: int = 1,
    best: int | None = None,
    is_main: bool = True,
) -> str:
    """`save` for a sharded model, called by every rank: `shards` (this rank's, of
    `sharding.sharded_state`) written by each rank into sharded/ of the temporary folder,
    then on rank 0 (`is_main`) `trainer_state`, the manifest, the rename and `latest`, as
    `save` does. The folder is the checkpoint's; a failure on any rank before the shards
    are all written raises on every rank (the error of the rank it happened on), one after
    it on rank 0 alone."""
    root, name = os.path.join(out, CHECKPOINTS), f"step-{step:08d}"
    tmp = os.path.join(root, f".tmp-{name}-{SHARDED}")  # one name every rank knows
    with writing(os.path.join(root, name)):
        made = None
        if is_main:
            made = _fresh_folder(root, tmp)
        if collectives.max_over_ranks(int(made is not None)):  # the folder is there, or none
            raise made or OSError(f"{tmp}: not made on rank 0")
        try:
            _write_shards(shards, os.path.join(tmp, SHARDED))
        except BaseException:
            if is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        if not is_main:
            return os.path.join(root, name)
        fsync_dir(os.path.join(tmp, SHARDED))
        _write_folder(root, name, tmp, None, model_config, trainer_state, run_config)
        _make_latest(root, name)
    _prune(root, keep, step, best)
    return os.path.join(root, name)


def _fresh_folder(root: str, tmp: str) -> OSError | None:
    """An empty folder `tmp` in `root` (one a killed save left is cleared first); the error
    that stopped it, None once made."""
    try:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.mkdir(tmp)
    except OSError as err:
        return err
    return None


def _write_shards(shards: dict, folder: str) -> None:
    """`sharding.save_sharded`, a failure on any rank raised as that rank's own error (dcp
    raises every rank's failures together, as a BaseException)."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        sharding.save_sharded(shards, folder)
    except CheckpointException as err:
        failures = [failure[0] for failure in err.failures.values()]
        raise next((f for f in failures if no_room(f)), failures[0]) from None


def _make_latest(root: str, name: str) -> None:
    """`latest` moved to checkpoint `name`, the folder renamed into place."""
    try:
        write_text_atomic(os.path.join(root, LATEST), name + "\n")
    except BaseException:
        # Where `latest` still names the previous checkpoint, the new one was never made
        # current: it goes, and the folder is as it was before this save.
        if _latest_text(root) != name:
            _remove(root, name)
        raise


def _write_folder(root, name, tmp, model_state, model_config, trainer_state, run_config):
    """Every file of checkpoint `name` into folder `tmp` aside (beside what is in it: a
    sharded checkpoint's shards), fsynced, renamed to root/name. Without `model_state` (a
    sharded checkpoint) no model.pt, config.json alone."""
    final = os.path.join(root, name)
    trainer_state = {**trainer_state, FORMAT_KEY: FORMAT}
    try:
        os.chmod(tmp, 0o777 & ~umask())  # mkdtemp makes it owner-only
        if model_state is not None:
            save_model(tmp, model_state, model_config, write=_write_synced)
        else:
            _save_config(tmp, model_config, _write_synced)
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
    """Size and sha256 of every file under `folder` (a sub-folder's as "sharded/name")."""
    files = {}
    for top, dirs, names in os.walk(folder):
        dirs.sort()
        for name in sorted(names):
            path = os.path.join(top, name)
            key = os.path.relpath(path, folder).replace(os.sep, "/")
            if key != MANIFEST:
                files[key] = {"bytes": os.path.getsize(path), "sha256": _sha256(path)}
    return {"files": dict(sorted(files.items()))}


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


def is_sharded(path: str) -> bool:
    """Whether checkpoint folder `path` holds a sharded run's state (sharded/, no model.pt)."""
    return os.path.isdir(os.path.join(path, SHARDED))


def folder_of(out: str, step: int) -> str:
    """The folder of the checkpoint of `step` under `out`."""
    return os.path.join(out, CHECKPOINTS, f"step-{step:08d}")


def read_model_state(path: str) -> dict:
    """The model's state_dict of checkpoint folder `path`, whole, on the CPU: model.pt, or
    for a sharded checkpoint its shards read by this process alone."""
    if is_sharded(path):
        return read_sharded_model(os.path.join(path, SHARDED))
    return torch.load(os.path.join(path, "model.pt"), map_location="cpu", weights_only=True)


def load(path: str, map_location="cpu") -> Checkpoint:
    """Read a checkpoint folder (as returned by find_latest) with weights_only=True; a
    sharded one's weights are left where they are (`model_state` None)."""
    model_state = None
    if not is_sharded(path):
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
