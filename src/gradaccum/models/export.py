"""Exporting a trained model into a folder that transformers loads back, written whole or not
at all.

`export_hf_model(model, "out/hf", tokenizer=...)` writes what `save_pretrained` writes
(config.json, generation_config.json, model.safetensors or its shards with their index) and the
tokenizer's files, so `AutoModelForCausalLM.from_pretrained("out/hf")` and
`AutoTokenizer.from_pretrained("out/hf")` load them.

Every export goes through `write_folder_atomic`: the folder is filled aside (a hidden
`.tmp-<name>.XXXXXXXX` beside it), each file and folder fsynced, then swapped into place. On
Linux the swap is one renameat2(RENAME_EXCHANGE) of the new folder with the previous one, so
`<name>` is at every instant either the previous export whole or the new one whole. Where that
call is missing (other systems, file systems without it) the previous folder is renamed aside
to `.old-<name>.XXXXXXXX` and the new one renamed into place: a kill between the two renames
leaves the previous export whole under that name. The previous folder is removed after the
swap; the leftovers of an export killed part-way are removed by the next export to the same
name.
"""

from __future__ import annotations

import ctypes
import os
import re
import secrets
import shutil
import tempfile
from collections.abc import Callable

import torch.nn as nn

from gradaccum.models.hf_folder import quiet_transformers
from gradaccum.utils.atomic import fsync_dir, umask, writing

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
)
"""Files a Hugging Face tokenizer folder may hold (fast, slow and sentencepiece tokenizers,
the chat template in either of its forms)."""

TOKENIZER_FOLDERS = ("additional_chat_templates",)
"""Folders of a tokenizer: named chat templates beside the default one."""

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside DDP (`.module`) and torch.compile (`._orig_mod`) wrappers."""
    while True:
        inner = getattr(model, "_orig_mod", None) or getattr(model, "module", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner


def _exchange(a: str, b: str) -> bool:
    """Swap two paths in one atomic step (Linux renameat2 RENAME_EXCHANGE); False where the
    system or the file system does not offer it."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    done = renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    return done == 0


def _fsync_tree(root: str) -> None:
    for folder, _, files in os.walk(root, topdown=False):
        for name in files:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(folder)


def _leftovers(parent: str, name: str) -> list[str]:
    """Folders aside of an earlier export to `name` that did not finish."""
    pattern = re.compile(rf"^\.(tmp|old)-{re.escape(name)}\.[A-Za-z0-9_]{{8}}$")
    return [os.path.join(parent, n) for n in os.listdir(parent) if pattern.match(n)]


def write_folder_atomic(folder: str, fill: Callable[[str], object]) -> str:
    """Call `fill(tmp)` on a new empty folder beside `folder`, fsync everything in it, and swap
    it into place of `folder` (which may not exist yet). A failure or a kill leaves the previous
    `folder` whole; no room on the disk is DiskFull naming `folder`. Returns `folder`."""
    folder = os.path.abspath(folder)
    parent, name = os.path.split(folder)
    os.makedirs(parent, exist_ok=True)
    for stale in _leftovers(parent, name):
        shutil.rmtree(stale, ignore_errors=True)
    with writing(folder):
        tmp = tempfile.mkdtemp(prefix=f".tmp-{name}.", dir=parent)
        try:
            os.chmod(tmp, 0o777 & ~umask())  # mkdtemp makes it owner-only
            fill(tmp)
            _fsync_tree(tmp)
            if not os.path.exists(folder):
                os.replace(tmp, folder)
            elif _exchange(tmp, folder):
                pass  # tmp now holds the previous export
            else:
                old = os.path.join(parent, f".old-{name}.{secrets.token_hex(4)}")
                os.replace(folder, old)
                os.replace(tmp, folder)
                tmp = old
            fsync_dir(parent)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # the new folder on failure, else the old one
    return folder


def copy_tokenizer_files(source: str, destination: str) -> list[str]:
    """Copy the tokenizer files of folder `source` into `destination`; returns their names."""
    copied = []
    for name in TOKENIZER_FILES:
        path = os.path.join(source, name)
        if os.path.isfile(path):
            shutil.copyfile(path, os.path.join(destination, name))
            copied.append(name)
    for name in TOKENIZER_FOLDERS:
        path = os.path.join(source, name)
        if os.path.isdir(path):
            shutil.copytree(path, os.path.join(destination, name), dirs_exist_ok=True)
            copied.append(name)
    return copied


def save_tokenizer(tokenizer, destination: str) -> None:
    """`tokenizer` (a folder path: its files are copied; or an object with save_pretrained,
    such as a transformers tokenizer: saved) into `destination`. None writes nothing."""
    if tokenizer is None:
        return
    if isinstance(tokenizer, (str, os.PathLike)):
        copy_tokenizer_files(os.fspath(tokenizer), destination)
    elif hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(destination)
    else:
        raise TypeError(
            f"tokenizer: expected a folder or an object with save_pretrained, "
            f"got {type(tokenizer).__name__}"
        )


def has_lora(model: nn.Module) -> bool:
    """Whether LoRA adapters were injected into the model (peft's lora_A/lora_B modules)."""
    return any(hasattr(m, "lora_A") and hasattr(m, "base_layer") for m in model.modules())


def export_hf_model(
    model: nn.Module,
    folder: str,
    tokenizer=None,
    max_shard_size: int | str = "5GB",
    state_dict: dict | None = None,
) -> str:
    """Save a transformers model with `save_pretrained` (safetensors, sharded past
    `max_shard_size` bytes, "5GB" by default) and the tokenizer (a folder to copy the files of,
    or a tokenizer object) into `folder`, atomically (`write_folder_atomic`). DDP and compiled
    wrappers are looked through. `state_dict`, when given, is saved instead of the model's own.
    A model with LoRA adapters goes through gradaccum.models.lora's export_adapter or
    export_merged instead. Returns `folder`."""
    model = unwrap(model)
    if not hasattr(model, "save_pretrained"):
        raise TypeError(
            f"export_hf_model: {type(model).__name__} is not a transformers model; the "
            "built-in GPT is saved with gradaccum.train.rundir.checkpoint.save_model"
        )
    if has_lora(model):
        raise ValueError(
            "export_hf_model: the model holds LoRA adapters; export it with "
            "gradaccum.models.lora.export_adapter or export_merged"
        )

    def fill(tmp: str) -> None:
        with quiet_transformers():
            model.save_pretrained(tmp, max_shard_size=max_shard_size, state_dict=state_dict)
        save_tokenizer(tokenizer, tmp)

    return write_folder_atomic(folder, fill)
