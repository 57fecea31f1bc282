"""The data of a `gradaccum train --task sft` (or grpo) run: the rows of --data (.jsonl, .json,
.parquet, a save_to_disk folder, hf:NAME) or the built-in instruction set
(`gradaccum.data.sft.builtin`), tokenized by the model's tokenizer (the built-in byte tokenizer
for the built-in GPT, the --init-from folder's own with its chat template for a Hugging Face
folder) into examples whose targets are the completion tokens (`gradaccum.data.sft.load`);
the eval set, a held-out split (`split_heldout`, --eval-fraction) or the examples of
--eval-data (`gradaccum.train.eval_set`); and how --packing cuts them for this model
(`packing_of`)."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import dataclass

import numpy as np

from gradaccum.data.sft.builtin import SOURCE, builtin_rows, solve
from gradaccum.data.sft.examples import IGNORE_INDEX, Example
from gradaccum.data.sft.load import SFTData, load_sft, tokenize_rows
from gradaccum.data.sft.rows import rows_from_dicts
from gradaccum.data.sft.windows import split_heldout
from gradaccum.data.tokenizers import ByteTokenizer, load_tokenizer
from gradaccum.data.tokens import DataInfo
from gradaccum.models.gpt import GPT_MODEL_TYPE
from gradaccum.train import eval_set
from gradaccum.train.config import TrainConfig
from gradaccum.utils.errors import BadInput

HELDOUT_MAX = 500
"""Most examples held out by the default --eval-fraction (`eval_set.DEFAULT_FRACTION`):
enough for an exact-match rate to two decimals, quick to generate."""


@dataclass
class SFTParts:
    """A fine-tuning run's data: the examples to train on and to evaluate on, and what they
    are. `train`, `val` and `info` are what the loop reads of any run's data."""

    train: list[Example]
    val: list[Example]
    """The examples to evaluate on: --eval-data's, or those held out of --data (none when it
    holds a single example, or with --eval-fraction 0)."""
    info: DataInfo
    """Source, vocabulary (the tokenizer's), token counts and the fingerprint a resume checks."""
    tokenizer: object
    """The `gradaccum.data.tokenizers.Tokenizer` the examples were made with."""
    tokenizer_dir: str | None
    """The folder the tokenizer was read from (its files go beside an export); None: bytes."""
    sft: SFTData
    """What was read: rows, bad rows, truncated and dropped examples, lengths."""
    builtin: bool
    """Whether this is the built-in instruction set (whose answers a program checks)."""
    eval_sft: SFTData | None = None
    """What was read of --eval-data; None: the eval set is held out of --data."""

    def summary_lines(self) -> list[str]:
        """The start-of-run lines about the data (`SFTData.summary_lines`), the eval data's
        and the split."""
        lines, held = self.sft.summary_lines(), "held out"
        if self.eval_sft is not None:
            lines += ["eval " + line if i == 0 else line
                      for i, line in enumerate(self.eval_sft.summary_lines())]  # fmt: skip
            held = "to evaluate on (--eval-data)"
        return lines + [
            f"  {len(self.train)} examples to train on, {len(self.val)} {held}; "
            f"tokenizer {self.tokenizer.origin}"
        ]


def tokenizer_for(config: TrainConfig):
    """The tokenizer of the run's model: bytes for the built-in GPT (a preset or this
    project's checkpoint of one), else the tokenizer in the --init-from folder, or in the
    folder of --model-config. BadInput when that folder holds none."""
    if config.init_from is not None:
        if _model_type(config.init_from) == GPT_MODEL_TYPE:
            return ByteTokenizer(), None
        return load_tokenizer(config.init_from, flag="--init-from"), config.init_from
    if config.model_config is not None:
        path = config.model_config
        folder = path if os.path.isdir(path) else os.path.dirname(path) or "."
        return load_tokenizer(folder, flag="--model-config"), folder
    return ByteTokenizer(), None


def _model_type(folder: str) -> str | None:
    try:
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
            saved = json.load(f)
    except (OSError, ValueError):
        return None  # build_model says what is wrong with the folder, naming the flag
    return saved.get("model_type", GPT_MODEL_TYPE) if isinstance(saved, dict) else None


def load_data(config: TrainConfig) -> SFTParts:
    """The run's examples: read, tokenized, split by --eval-fraction, or all of --data to
    train on and --eval-data's to evaluate on. BadInput (one line naming --data or
    --eval-data and the row, or the folder of the tokenizer) on bad input."""
    tokenizer, tokenizer_dir = tokenizer_for(config)
    options = dict(
        seq_len=config.seq_len,
        data_format=config.data_format,
        train_on_prompt=config.train_on_prompt,
        drop_long=config.drop_long,
        skip_bad_rows=config.skip_bad_rows,
    )
    if config.data is None:
        rows = rows_from_dicts(builtin_rows(config.seed), SOURCE)
        data = tokenize_rows(rows, tokenizer, source=SOURCE, **options)
    else:
        data = load_sft(config.data, tokenizer, config.data_split, config.task, **options)
    held = None  # --eval-data's examples: read and tokenized as --data's
    if config.eval_data is not None:
        with eval_set.reading_eval_data():
            held = load_sft(config.eval_data, tokenizer, config.data_split, config.task, **options)
        train, val = data.examples, held.examples
    else:
        count = eval_set.heldout_count(config, len(data.examples), HELDOUT_MAX)
        train, val = split_heldout(data.examples, count, seed=config.seed, flag="--data")
    if config.save_best and not val:
        raise BadInput(
            "--save-best",
            None,
            f"needs an eval set: --data {config.data} holds a single example, none held "
            "out; give --eval-data",
        )
    info = DataInfo(
        source=data.source,
        vocab_size=tokenizer.vocab_size,
        entropy_floor=None,
        num_tokens=sum(e.length for e in train + val),
        train_tokens=sum(e.length for e in train),
        val_tokens=sum(e.length for e in val),
        eod_token=tokenizer.eos_id,
        fingerprint=fingerprint(train, val),
    )
    # answers a program can check: the built-in set, or --data of its tasks' rows
    builtin = held is None and (config.data is None or builtin_tasks(data.examples, tokenizer))
    return SFTParts(train, val, info, tokenizer, tokenizer_dir, data, builtin, held)


def builtin_tasks(examples: list[Example], tokenizer) -> bool:
    """Whether every example is a built-in task's prompt with its right answer (a subset of
    the built-in set written to a file): exact match can be measured on them too."""
    for e in examples:
        first = int(np.argmax(e.labels != IGNORE_INDEX))
        answer = [int(i) for i in e.input_ids[first:] if int(i) != tokenizer.eos_id]
        try:
            if solve(tokenizer.decode(e.input_ids[:first].tolist())) != tokenizer.decode(answer):
                return False
        except (ValueError, ZeroDivisionError):
            return False
    return bool(examples)


def fingerprint(train: list[Example], val: list[Example]) -> str:
    """A hash of every example's ids and labels, both splits in order: equal for the same
    examples however they were read."""
    digest = hashlib.sha256()
    for part in (train, val):
        digest.update(len(part).to_bytes(8, "little"))
        for e in part:
            digest.update(len(e.input_ids).to_bytes(8, "little"))
            digest.update(e.input_ids.tobytes())
            digest.update(e.labels.tobytes())
    return digest.hexdigest()


def builtin_gpt(config: TrainConfig) -> bool:
    """Whether the run trains the built-in GPT (a preset, or this project's checkpoint of one)."""
    if config.init_from is not None:
        return _model_type(config.init_from) == GPT_MODEL_TYPE
    return config.model_config is None


def hf_masks_packed(path: str) -> bool:
    """Whether the Hugging Face causal LM of `path` (a folder or its config.json) keeps the
    examples of a padding-free row apart: its attention mask comes from transformers' masking
    utilities, which read position ids restarting at 0 as packed sequences (sdpa, eager and
    flex; flash attention takes them as its varlen boundaries) when no attention mask is given."""
    try:
        from transformers import CONFIG_MAPPING, masking_utils
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
    except ImportError:
        return False
    if not hasattr(masking_utils, "find_packed_sequence_indices"):
        return False  # older transformers: restarting position ids do not mask
    file = path if os.path.isfile(path) else os.path.join(path, "config.json")
    try:
        with open(file, encoding="utf-8") as f:
            model_type = json.load(f)["model_type"]
        cls = MODEL_FOR_CAUSAL_LM_MAPPING[CONFIG_MAPPING[model_type]]
    except (OSError, ValueError, KeyError, TypeError):
        return False  # build_model says what is wrong with the folder
    module = sys.modules.get(cls.__module__)
    return getattr(module, "create_causal_mask", None) is masking_utils.create_causal_mask


def packing_of(config: TrainConfig) -> str:
    """--packing, or where not given: padding-free when the run's model keeps packed examples
    apart (the built-in GPT; a Hugging Face model, `hf_masks_packed`), else window."""
    if config.packing is not None:
        return config.packing
    if builtin_gpt(config) or hf_masks_packed(config.init_from or config.model_config):
        return "padding-free"
    return "window"


def check_packing(config: TrainConfig) -> str:
    """The run's packing (`packing_of`); BadInput for a budget it cannot take."""
    mode, budget = packing_of(config), config.micro_batch_tokens
    if mode == "padding-free" and budget is not None and budget < config.seq_len:
        given = "" if config.packing else " (the default for this model)"
        raise BadInput(
            "--micro-batch-tokens",
            budget,
            f"below --seq-len {config.seq_len}: a padding-free row{given} is --seq-len "
            f"positions, the longest example's; give at least {config.seq_len} or --packing "
            "window",
        )
    return mode
