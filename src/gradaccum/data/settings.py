"""The data a command reads: settings components (no torch)."""

from __future__ import annotations

from dataclasses import dataclass

from gradaccum.settings.field import setting

DATA_FORMATS = ("auto", "prompt-completion", "messages", "alpaca")
"""--data-format of --task sft (gradaccum.data.sft.rows.FORMATS)."""


@dataclass
class DataSettings:
    """data"""

    data: str | None = setting(None, "path", default_text="the built-in corpus or instruction set")
    """Training text or tokens: PATH.txt (bytes), PATH.bin or PATH.npy (token ids) or
    hf:NAME[:SPLIT]; with --task sft, PATH.jsonl, PATH.json, PATH.parquet or hf:NAME[:SPLIT]
    rows. The built-in Markov corpus has a known entropy, the loss floor."""
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
