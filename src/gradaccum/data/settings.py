"""The data a command reads: settings components (no torch)."""

from __future__ import annotations

from dataclasses import dataclass

from gradaccum.settings.field import setting

DATA_FORMATS = ("auto", "prompt-completion", "messages", "alpaca")
"""--data-format of --task sft (gradaccum.data.sft.rows.FORMATS)."""

DEFAULT_SPLIT = "train"
"""--data-split's default: the split read when neither it nor hf:NAME:SPLIT names one."""

SOURCES = {
    "pretrain": "a .txt, .bin or .npy file or hf:NAME[:SPLIT]",
    "sft": "a .jsonl, .json or .parquet file, a folder written by save_to_disk, or hf:NAME[:SPLIT]",
}
"""What --data may be for each task, in the words of the lines refusing it (--data's help
below says the same at length)."""


@dataclass
class DataSettings:
    """data"""

    data: str | None = setting(None, "path", default_text="the built-in corpus or instruction set")
    """Training data. --task pretrain: PATH.txt (bytes), PATH.bin or PATH.npy (token ids), or
    hf:NAME[:SPLIT] (the "text" column of a data set in the local datasets cache or of a
    folder written by save_to_disk). --task sft: rows of PATH.jsonl, PATH.json (a list, or
    one under "data" or "train"), PATH.parquet, a FOLDER written by save_to_disk (a Dataset,
    or a DatasetDict's --data-split) or hf:NAME[:SPLIT], each prompt/completion, messages or
    alpaca. The built-in Markov corpus has a known entropy, the loss floor."""
    data_split: str = setting(DEFAULT_SPLIT, "str", metavar="NAME")
    """--task sft: the split to read of a DatasetDict saved with save_to_disk, or of
    hf:NAME when it names none (hf:NAME:SPLIT's own split comes first)."""
    data_format: str = setting("auto", "choice", choices=DATA_FORMATS)
    """--task sft: the rows' format; auto detects it from the first row's fields."""
    skip_bad_rows: bool = setting(False, "bool")
    """--task sft: skip and count bad rows (a malformed line, a missing field, an empty
    completion) instead of stopping at the first."""
    drop_long: bool = setting(False, "bool")
    """--task sft: drop examples longer than --seq-len instead of cutting the end of their
    completion."""
    train_on_prompt: bool = setting(False, "bool")
    """--task sft: the loss over the prompt tokens too, not only the completion's."""
    document_mask: bool = setting(False, "bool")
    """--task pretrain: each --eod-id opens a document (position 0) and attention stays
    within documents."""
    eod_id: int | None = setting(None, default_text="the data's")
    """--document-mask: the end-of-document id, e.g. 50256 for GPT-2 (.bin, .npy and .txt
    data have none of their own)."""
