"""Local Hugging Face causal-LM folders: what one holds, and loading it with nothing downloaded.

A folder as `save_pretrained` writes it holds config.json and its weights in one of these forms
(looked for in this order):

    model-00001-of-0000N.safetensors ...   shards, each named in the "weight_map" of
        model.safetensors.index.json
    model.safetensors                      one file
    pytorch_model-00001-of-0000N.bin ...   shards, named in pytorch_model.bin.index.json
    pytorch_model.bin                      `torch.save` of the state_dict

`.bin` files are read with `torch.load(weights_only=True)`: tensors and plain containers only,
so a pickle that would run code is refused, never executed. transformers 5 passes
weights_only=True by default; it is passed here explicitly so that no change of default can turn
it off. Everything is read with `local_files_only=True` and `trust_remote_code=False`.

dtype "auto" keeps the dtype the weights are stored in (a bf16 checkpoint stays bf16, half the
bytes of fp32, and the engine accumulates its gradients in fp32); "fp32" upcasts every floating
tensor, for fp32 master weights.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from gradaccum.utils.errors import BadInput, first_line

WEIGHT_LAYOUTS: tuple[tuple[str, str], ...] = (
    ("model.safetensors.index.json", "sharded safetensors"),
    ("model.safetensors", "safetensors"),
    ("pytorch_model.bin.index.json", "sharded pytorch_model.bin"),
    ("pytorch_model.bin", "pytorch_model.bin"),
)
"""(file to look for, layout name), in the order transformers itself prefers them."""

DTYPES = ("auto", "fp32")

_NO_WEIGHTS = (
    "holds no weights (expected model.safetensors, model-00001-of-0000N.safetensors with "
    "model.safetensors.index.json, or pytorch_model.bin)"
)


@dataclass(frozen=True)
class HFFolder:
    """A Hugging Face folder checked on disk, before any tensor is read."""

    path: str
    """The folder."""
    config: Any
    """Its config.json as a transformers `PretrainedConfig`."""
    layout: str
    """How the weights are stored: a layout name of WEIGHT_LAYOUTS."""
    weight_files: tuple[str, ...]
    """The weight files, names relative to `path` (every shard, for a sharded layout)."""
    flag: str = "--init-from"
    """The command-line flag that named the folder, for error messages."""

    @property
    def model_type(self) -> str:
        return str(getattr(self.config, "model_type", "unknown"))

    def describe(self) -> str:
        """`llama, sharded safetensors (3 files)`."""
        n = len(self.weight_files)
        return f"{self.model_type}, {self.layout}" + (f" ({n} files)" if n > 1 else "")


def short_error(err: BaseException, limit: int = 160) -> str:
    """A library's message cut to its first sentence: some list every model type there is."""
    text = first_line(err).split(". ")[0]
    return text if len(text) <= limit else text[: limit - 3] + "..."


def weights_in(path: str, flag: str = "--init-from") -> tuple[str, tuple[str, ...]]:
    """(layout name, weight file names) of the folder; every shard of an index must exist.
    Raises BadInput naming `flag` and the folder."""
    for name, layout in WEIGHT_LAYOUTS:
        if os.path.isfile(os.path.join(path, name)):
            files = _shards(path, name, flag) if name.endswith(".index.json") else (name,)
            return layout, files
    raise BadInput(flag, path, _NO_WEIGHTS)


def _shards(path: str, index_name: str, flag: str) -> tuple[str, ...]:
    try:
        with open(os.path.join(path, index_name), encoding="utf-8") as f:
            index = json.load(f)
    except (OSError, ValueError) as err:  # malformed JSON, not UTF-8
        raise BadInput(
            flag, path, f"{index_name} is not readable JSON ({short_error(err)})"
        ) from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise BadInput(flag, path, f"{index_name} has no weight_map of tensor names to files")
    shards = sorted({str(v) for v in weight_map.values()})
    for shard in shards:
        # A shard is a file of this folder; a name with a path in it would read elsewhere.
        if os.path.basename(shard) != shard or shard in ("", ".", ".."):
            raise BadInput(flag, path, f"{index_name} names {shard!r}, not a file of the folder")
    missing = [s for s in shards if not os.path.isfile(os.path.join(path, s))]
    if missing:
        more = (
            f" (and {len(missing) - 1} more of its {len(shards)} files)" if len(missing) > 1 else ""
        )
        raise BadInput(flag, path, f"{missing[0]}, named in {index_name}, is missing{more}")
    return tuple(shards)


def _transformers(flag: str, path: str):
    try:
        import transformers
    except ImportError:
        raise BadInput(f"{flag} {path}: needs transformers (pip install 'gradaccum[hf]')") from None
    return transformers


def read_folder(path: str, flag: str = "--init-from") -> HFFolder:
    """Check a Hugging Face folder without reading a tensor: it exists, holds a readable
    config.json of a model with a vocabulary, and weights in a known layout with every shard.
    Raises BadInput (one line, naming `flag` and `path`)."""
    if not os.path.isdir(path):
        raise BadInput(flag, path, "no such folder")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise BadInput(flag, path, "no config.json in it")
    transformers = _transformers(flag, path)
    with quiet_transformers():
        try:
            config = transformers.AutoConfig.from_pretrained(
                path, local_files_only=True, trust_remote_code=False
            )
        except (OSError, ValueError, KeyError) as err:
            raise BadInput(
                flag, path, f"not a readable model config ({short_error(err)})"
            ) from None
    if not isinstance(getattr(config, "vocab_size", None), int):
        raise BadInput(
            flag, path, f"not a causal LM config (model_type {config.model_type} has no vocabulary)"
        )
    layout, files = weights_in(path, flag)
    return HFFolder(path=path, config=config, layout=layout, weight_files=files, flag=flag)


@contextlib.contextmanager
def quiet_transformers():
    """transformers' warnings, load reports and progress bars off inside the block (a bad
    folder must give one line), its previous settings back after it."""
    try:
        from transformers.utils import logging
    except ImportError:
        yield
        return
    verbosity, bars = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        logging.set_verbosity(verbosity)
        if bars:
            logging.enable_progress_bar()


def load_model(folder: HFFolder | str, dtype: str = "auto", quant=None, device="cpu") -> nn.Module:
    """The causal LM of a Hugging Face folder with its weights, in training mode.

    dtype: "auto" keeps the stored dtype (bf16 stays bf16), "fp32" upcasts. A folder given as a
    path is checked with `read_folder` first. Raises BadInput for weights that cannot be read
    or do not match config.json (a tensor missing or of another shape), and for a model that
    is not a causal decoder (an encoder such as BERT). quant: a `QuantSpec` (--base-bits):
    the blocks' linear layers loaded in 4 or 8 bits by transformers' BitsAndBytesConfig, on
    `device`.
    """
    if dtype not in DTYPES:
        raise ValueError(f"load_model: dtype {dtype!r}, expected one of {DTYPES}")
    folder = read_folder(folder) if isinstance(folder, str) else folder
    flag, path = folder.flag, folder.path
    transformers = _transformers(flag, path)
    with quiet_transformers():
        try:
            model, info = transformers.AutoModelForCausalLM.from_pretrained(
                path,
                config=folder.config,
                local_files_only=True,
                trust_remote_code=False,
                weights_only=True,
                dtype="auto" if dtype == "auto" else torch.float32,
                output_loading_info=True,
                **_quantized_loading(quant, device),
            )
        except ValueError as err:  # a config class with no causal-LM model (an image model)
            raise BadInput(flag, path, f"not a causal LM ({short_error(err)})") from None
        except RuntimeError as err:  # a tensor of another shape than config.json gives
            raise BadInput(
                flag, path, f"weights do not match config.json ({short_error(err)})"
            ) from None
        except Exception as err:  # noqa: BLE001  torch, pickle and safetensors raise many kinds
            raise BadInput(
                flag,
                path,
                f"{folder.layout} weights are not readable ({type(err).__name__}: "
                f"{short_error(err)})",
            ) from None
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        names = ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else "")
        raise BadInput(
            flag, path, f"weights do not match config.json: {len(missing)} missing ({names})"
        )
    if quant is not None:  # before any forward: the causality check runs in eval mode
        from gradaccum.models.quantized import keep_training_layout

        keep_training_layout(model)
    refuse_non_causal(model, flag, path)
    return model.train()


def _quantized_loading(quant, device) -> dict:
    """from_pretrained's arguments for a base loaded in 4 or 8 bits (none without `quant`)."""
    if quant is None:
        return {}
    from gradaccum.models.quantized import quantization_config

    return {"quantization_config": quantization_config(quant), "device_map": {"": str(device)}}


def refuse_non_causal(model: nn.Module, flag: str, path: str) -> None:
    """BadInput unless the model's logits at each position ignore the tokens after it."""
    config = model.config
    if not sees_only_the_past(model, config.vocab_size):
        raise BadInput(
            flag,
            path,
            f"model_type {config.model_type} builds {type(model).__name__}, which reads later "
            "tokens to predict earlier ones (an encoder, not a causal decoder); only causal "
            "language models can be trained here",
        )


@torch.no_grad()
def sees_only_the_past(model: nn.Module, vocab_size: int, length: int = 8) -> bool:
    """Whether the logits at each position are independent of the tokens after it: change
    the last token of a fixed sequence and compare the logits before it. Uses no RNG."""
    was_training = model.training
    model.eval()
    try:
        device = next(model.parameters()).device
        ids = (torch.arange(length, device=device) * 7 % vocab_size).unsqueeze(0)
        changed = ids.clone()
        changed[0, -1] = (changed[0, -1] + 1) % vocab_size
        before, after = (model(x).logits[0, :-1].float() for x in (ids, changed))
    finally:
        model.train(was_training)
    return torch.allclose(before, after, rtol=1e-4, atol=1e-5)
