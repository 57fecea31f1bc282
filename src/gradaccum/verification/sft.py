"""The window `gradaccum verify --task sft` checks: SFT examples read as `gradaccum train --task
sft` reads them, cut into micro-batches as it cuts them.

The rows are the built-in instruction set (`gradaccum.data.sft.builtin.builtin_rows`, drawn from
the seed) or `--data` (.jsonl, .json, .parquet, hf:NAME[:SPLIT]); they are tokenized by the
byte tokenizer through `gradaccum.data.sft.load.tokenize_rows` (the loss on the completion and its
EOS only), and `gradaccum.data.sft.windows.SFTBatches` takes the first window of
k x micro_batch examples of its seeded order, sorted longest first and cut into k micro-batches
each padded to its own longest. Their target counts differ (a long answer next to a short
one), which is where dividing each micro-batch's mean loss by k goes wrong.

`packing` "window" or "padding-free" cuts the same examples as `train --packing` does
(`gradaccum.data.sft.packed`, one rank): by a budget of `micro_batch_tokens` positions
(default micro-batch x seq-len), each micro-batch padded to its longest, or packed into rows of
seq-len positions with attention kept inside each example; the number of micro-batches then
follows from the budget. `big_batch` is every example of the window padded into one batch,
unpacked: the reference the check compares the packed window with.
"""

from __future__ import annotations

from dataclasses import dataclass

from gradaccum.data.sft.builtin import SOURCE, builtin_rows
from gradaccum.data.sft.load import tokenize_rows
from gradaccum.data.sft.packed import Packing, packed_window
from gradaccum.data.sft.rows import read_rows, rows_from_dicts
from gradaccum.data.sft.windows import SFTBatches, collate
from gradaccum.data.tokenizers import ByteTokenizer
from gradaccum.utils.errors import BadInput

__all__ = ["SFTWindow", "sft_window"]

BUILTIN = f"the {SOURCE}"
"""The built-in rows' source, in words."""


@dataclass
class SFTWindow:
    """One window of SFT examples and what it holds."""

    micro_batches: list[dict]
    """The k micro-batches: input_ids, labels (-100 off target), attention_mask; each as wide
    as its longest example."""
    source: str
    """Where the rows came from: the --data value or the built-in set's name."""
    data_format: str
    """prompt-completion, messages or alpaca, as detected."""
    examples: int
    """Examples in the window."""
    targets: list[int]
    """Target tokens (completion and EOS) of each micro-batch."""
    widths: list[int]
    """Positions of each micro-batch's rows, in tokens (its longest example)."""
    tokens: int
    """Tokens of the window's examples, padding not counted."""
    truncated: int
    """Examples of the data cut to --seq-len."""
    packing: str = "none"
    """How the examples were cut into micro-batches (--packing)."""
    big_batch: dict | None = None
    """Every example of the window in one batch, padded, unpacked (None: --packing none,
    where the micro-batches stacked are that batch)."""

    def describe(self) -> str:
        """The window in one line, for the verify table."""
        t = self.targets
        cut = "padded to" if self.packing != "padding-free" else "of padding-free rows of"
        return (
            f"{self.examples} SFT examples from {self.source} ({self.data_format}), --packing "
            f"{self.packing}, k = {len(t)} micro-batches {cut} {_some(self.widths)} tokens holding "
            f"{_some(t)} targets ({sum(t):,} target tokens of {self.tokens:,})"
        )


def _some(values: list[int]) -> str:
    """Up to 8 values in full, else their range."""
    if len(values) <= 8:
        return ", ".join(map(str, values))
    return f"{min(values)}..{max(values)}"


def sft_window(
    data: str | None,
    k: int,
    micro_batch: int,
    seq_len: int,
    seed: int,
    layout: str,
    packing: str = "none",
    micro_batch_tokens: int | None = None,
) -> SFTWindow:
    """The first window of k x micro_batch examples (module docstring). data: --data, or
    None for the built-in set. layout: "shifted" for the built-in GPT's loss, "unshifted" for a
    Hugging Face model's (whose padding-free rows carry position ids only). Raises BadInput for
    data that cannot be read or is too small."""
    tok = ByteTokenizer()
    wanted = k * micro_batch
    if data is None:
        rows = rows_from_dicts(builtin_rows(seed=seed, n=wanted), SOURCE)
        sft = tokenize_rows(rows, tok, seq_len=seq_len, source=BUILTIN)
    else:
        sft = tokenize_rows(read_rows(data), tok, seq_len=seq_len, source=data)
    if len(sft.examples) < wanted:
        raise BadInput(
            "--data",
            data,
            f"{len(sft.examples)} examples, fewer than the window's --k {k} x --micro-batch "
            f"{micro_batch} = {wanted}",
        )
    order = SFTBatches(
        sft.examples,
        micro_batch=micro_batch,
        examples_per_step=wanted,
        pad_id=tok.pad_id,
        layout=layout,
        seed=seed,
    )
    big = None
    if packing == "none":
        window = next(order)
    else:
        budget = micro_batch_tokens or micro_batch * seq_len
        cut = Packing(packing, budget, seq_len)
        window = packed_window(order, cut)
        big = collate([sft.examples[i] for i in window.indices], tok.pad_id, layout)
    batches = window.micro_batches
    return SFTWindow(
        micro_batches=batches,
        source=sft.source,
        data_format=sft.data_format,
        examples=window.examples,
        targets=[int((b["labels"] != -100).sum()) for b in batches],
        widths=[int(b["input_ids"].shape[1]) for b in batches],
        tokens=window.tokens,
        truncated=sft.truncated,
        packing=packing,
        big_batch=big,
    )
