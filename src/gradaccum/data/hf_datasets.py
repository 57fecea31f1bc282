"""`--data hf:NAME[:SPLIT]`: a `datasets` dataset (an optional extra) from the local cache only,
never the network (NAME may also be a local folder). Pretraining text (`tokens`) and SFT rows
(`sft_rows`) both load it here."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from gradaccum.utils.errors import BadInput, first_line


def load_hf_dataset(spec: str):
    """The split SPLIT (default "train") of the dataset NAME of `spec` ("hf:NAME[:SPLIT]"),
    offline. BadInput naming `--data spec` when the name is missing, datasets is not
    installed, or the local cache cannot give it."""
    name, _, split = spec[3:].partition(":")
    flag = f"--data {spec}"
    if not name:
        raise BadInput(f"{flag}: expected hf:NAME[:SPLIT]")
    try:
        import datasets
    except ImportError:
        raise BadInput(
            f"{flag}: needs the datasets package (pip install 'gradaccum[hf]')"
        ) from None
    try:
        with offline():
            return datasets.load_dataset(name, split=split or "train")
    except Exception as err:  # datasets raises many kinds (missing, offline, bad split)
        raise BadInput(
            f"{flag}: cannot load from the local datasets cache ({first_line(err)})"
        ) from None


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
