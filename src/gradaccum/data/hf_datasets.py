"""`datasets` data (an optional extra), read offline: pretraining text (`tokens`) and SFT rows
(`sft.rows`) both load it here.

- `hf:NAME[:SPLIT]`: `datasets.load_dataset(NAME, split=...)` from the local cache only, never
  the network (NAME may also be a local folder of data files);
- a folder written by `save_to_disk` (as `--data FOLDER` or `hf:FOLDER[:SPLIT]`):
  `datasets.load_from_disk`. A `Dataset`'s folder holds dataset_info.json and state.json and is
  its rows; a `DatasetDict`'s holds dataset_dict.json (its split names) and a subfolder per
  split, of which one is read.

The split read: the SPLIT of `hf:NAME:SPLIT`, else `split` (--data-split, default "train").
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager

from gradaccum.data.settings import DEFAULT_SPLIT, SOURCES
from gradaccum.utils.errors import BadInput, first_line

__all__ = ["folder_problem", "load_hf_dataset", "load_saved", "offline", "saved_kind"]

DATASET_FILES = ("dataset_info.json", "state.json")
"""What `Dataset.save_to_disk` writes beside its .arrow files."""
DATASET_DICT_FILE = "dataset_dict.json"
"""What `DatasetDict.save_to_disk` writes: {"splits": [...]}, a subfolder per split."""


def saved_kind(path: str) -> str | None:
    """What `save_to_disk` wrote into the folder `path`: "dataset_dict" (a `DatasetDict`) or
    "dataset" (a `Dataset`); None for any other folder, or a path that is not a folder."""
    if not os.path.isdir(path):
        return None
    if os.path.isfile(os.path.join(path, DATASET_DICT_FILE)):
        return "dataset_dict"
    if all(os.path.isfile(os.path.join(path, name)) for name in DATASET_FILES):
        return "dataset"
    return None


def folder_problem(path: str, task: str, reads_rows: bool) -> str | None:
    """Why the folder `path` cannot be `--data` of --task `task` (which `reads_rows`, as sft
    and grpo do, or text and tokens, as pretrain does), in one line; None when it can (a
    save_to_disk folder of rows)."""
    kind = saved_kind(path)
    if reads_rows:
        if kind is not None:
            return None
        return (
            f"--data {path}: is a folder, but not one written by save_to_disk (it holds "
            f"neither {DATASET_DICT_FILE} nor {' and '.join(DATASET_FILES)}); --task {task} "
            f"reads {SOURCES['sft']}"
        )
    if kind is not None:  # the pretraining reader takes it by name: its "text" column
        return (
            f"--data {path}: is a folder written by save_to_disk; pretraining reads its "
            f"'text' column as --data hf:{path}"
        )
    return f"--data {path}: is a folder; expected {SOURCES['pretrain']}"


def load_hf_dataset(spec: str, split: str = DEFAULT_SPLIT):
    """The rows of `spec` ("hf:NAME[:SPLIT]"), offline: `load_saved` when NAME is a
    save_to_disk folder, else the split (SPLIT, or `split`) of `datasets.load_dataset(NAME)`
    from the local cache. BadInput naming `--data spec` when the name is missing, datasets
    is not installed, or neither the folder nor the cache can give it."""
    flag = f"--data {spec}"
    name, named = _name_and_split(spec[3:])
    if not name:
        raise BadInput(f"{flag}: expected hf:NAME[:SPLIT]")
    datasets = _datasets(flag)
    if saved_kind(name) is not None:
        return load_saved(name, named or split, flag, split_in_spec=named is not None)
    try:
        with offline():
            return datasets.load_dataset(name, split=named or split)
    except Exception as err:  # datasets raises many kinds (missing, offline, bad split)
        raise BadInput(
            f"{flag}: cannot load from the local datasets cache ({first_line(err)})"
        ) from None


def load_saved(folder: str, split: str, flag: str, split_in_spec: bool = False):
    """The `Dataset` saved in `folder` by `save_to_disk`; for a `DatasetDict`, its split
    `split` (only that split is opened). `flag`: "--data VALUE", named by the lines;
    `split_in_spec`: the split came from hf:FOLDER:SPLIT, not --data-split. BadInput for a
    split the folder does not hold (one line listing those it holds), a split named for a
    single Dataset, or a folder datasets cannot read."""
    datasets = _datasets(flag)
    kind = saved_kind(folder)
    if kind == "dataset_dict":
        splits = _splits(folder, flag)
        if split not in splits:
            where = flag if split_in_spec else f"--data-split {split}"
            raise BadInput(
                f"{where}: no split {split!r} in the DatasetDict {folder}; its splits: "
                f"{', '.join(splits)}"
            )
        folder = os.path.join(folder, split)
    elif kind == "dataset" and split_in_spec:
        raise BadInput(
            f"{flag}: a single Dataset saved with save_to_disk has no splits; drop ':{split}'"
        )
    elif kind is None:
        raise BadInput(f"{flag}: not a folder written by save_to_disk")
    try:
        return datasets.load_from_disk(folder)
    except Exception as err:  # a damaged folder: missing shards, bad JSON, bad arrow
        raise BadInput(
            f"{flag}: cannot read this save_to_disk folder ({first_line(err)})"
        ) from None


def _name_and_split(rest: str) -> tuple[str, str | None]:
    """(NAME, SPLIT or None) of "NAME[:SPLIT]"; a local folder whose path holds ':' is
    NAME whole."""
    if os.path.isdir(rest):
        return rest, None
    folder, _, last = rest.rpartition(":")
    if folder and os.path.isdir(folder):
        return folder, last or None
    name, _, split = rest.partition(":")  # a split may hold ':' itself ("train[:10%]")
    return name, split or None


def _splits(folder: str, flag: str) -> list[str]:
    try:
        with open(os.path.join(folder, DATASET_DICT_FILE), encoding="utf-8") as f:
            splits = json.load(f)["splits"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise BadInput(f"{flag}: a damaged {DATASET_DICT_FILE} ({first_line(err)})") from None
    return [str(s) for s in splits]


def _datasets(flag: str):
    try:
        import datasets
    except ImportError:
        raise BadInput(
            f"{flag}: needs the datasets package (pip install 'gradaccum[hf]')"
        ) from None
    return datasets


@contextmanager
def offline() -> Iterator[None]:
    """datasets kept to its local cache: the environment for a first import, its config flag
    for an import already made; both put back afterwards."""
    names = ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")
    saved = {name: os.environ.get(name) for name in names}
    os.environ.update({name: "1" for name in names})
    import datasets

    was = datasets.config.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE = was
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
