"""The window `gradaccum verify --task sft` checks: SFT examples read as `gradaccum train --task
sft` reads them, cut into micro-batches as it cuts them.

The rows are the built-in instruction set (`gradaccum.data.sft.builtin.builtin_rows`, drawn from
the seed) or `--data` (`gradaccum.data.sft.load.load_sft`, the trainer's reader: .jsonl,
.json, .parquet, a save_to_disk folder's --data-split, hf:NAME[:SPLIT]); they are tokenized by
the model's tokenizer (`Reading.tokenizer`: the byte tokenizer for the built-in GPT, the
--init-from folder's own with its chat template for a Hugging Face folder) through
`gradaccum.data.sft.load.tokenize_rows` with the trainer's options (--data-format,
--train-on-prompt, --drop-long, --skip-bad-rows, --seq-len): the loss on the completion (the
assistant turns) only unless --train-on-prompt. `gradaccum.data.sft.windows.SFTBatches` takes
the first window of k x micro_batch examples of its seeded order, sorted longest first and cut
into k micro-batches each padded to its own longest. Their target counts differ (a long
answer next to a short one), which is where dividing each micro-batch's mean loss by k goes
wrong.

`packing` "window" or "padding-free" cuts the same examples as `train --packing` does without
--compile (`gradaccum.data.sft.packed`, one rank; padding-free rows bucketed by length as
`gradaccum.train.sft.SFTStream` buckets them): by a budget of `micro_batch_tokens` positions
(default micro-batch x seq-len), each micro-batch padded to its longest, or packed into rows of
at most seq-len positions with attention kept inside each example; the number of
micro-batches then follows from the budget. `big_batch` is every example of the window padded
into one batch, unpacked: the reference the check compares the packed window with.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gradaccum.data.settings import DEFAULT_SPLIT
from gradaccum.data.sft.builtin import SOURCE, builtin_rows
from gradaccum.data.sft.load import SFTData, load_sft, tokenize_rows
from gradaccum.data.sft.packed import Packing, packed_window
from gradaccum.data.sft.rows import rows_from_dicts
from gradaccum.data.sft.windows import SFTBatches, collate
from gradaccum.data.tokenizers import ByteTokenizer
from gradaccum.utils.errors import BadInput

__all__ = ["Reading", "SFTWindow", "read_examples", "sft_window"]

BUILTIN = f"the {SOURCE}"
"""The built-in rows' source, in words."""
SHOWN = 8
"""Micro-batches the verify table describes one by one; more are given as ranges."""


@dataclass(frozen=True)
class Reading:
    """How rows become examples: the tokenizer and the trainer's reading options."""

    seq_len: int
    """Most tokens an example holds (--seq-len); longer ones are cut or dropped."""
    tokenizer: object = field(default_factory=ByteTokenizer)
    """The model's `gradaccum.data.tokenizers.Tokenizer`."""
    data_split: str = DEFAULT_SPLIT
    """--data-split."""
    data_format: str = "auto"
    """--data-format."""
    train_on_prompt: bool = False
    """--train-on-prompt: every token a target, not only the completion's."""
    drop_long: bool = False
    """--drop-long."""
    skip_bad_rows: bool = False
    """--skip-bad-rows."""

    def options(self) -> dict:
        """The keywords `tokenize_rows` and `load_sft` take, as the trainer passes them."""
        return dict(
            seq_len=self.seq_len,
            data_format=self.data_format,
            train_on_prompt=self.train_on_prompt,
            drop_long=self.drop_long,
            skip_bad_rows=self.skip_bad_rows,
        )


@dataclass
class SFTWindow:
    """One window of SFT examples and what it holds."""

    micro_batches: list[dict]
    """The k micro-batches: input_ids, labels (-100 off target), attention_mask (padded), or
    position_ids (padding-free rows); each as wide as its longest row."""
    source: str
    """Where the rows came from: the --data value or the built-in set's name."""
    data_format: str
    """prompt-completion, messages or alpaca, as detected."""
    tokenizer: str
    """The tokenizer, in words: "built-in byte tokenizer" or "--init-from FOLDER"."""
    examples: int
    """Examples in the window."""
    targets: list[int]
    """Target tokens (completion and EOS) of each micro-batch."""
    widths: list[int]
    """Positions of each micro-batch's rows, in tokens (its longest row)."""
    rows: list[int]
    """Rows of each micro-batch: examples (--packing none, window) or padding-free rows."""
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
        """The window in one line, for the verify table: each micro-batch's rows, width and
        targets (`micro_batch_words`)."""
        t = self.targets
        tok = (
            self.tokenizer
            if "tokenizer" in self.tokenizer
            else f"the tokenizer of {self.tokenizer}"
        )
        return (
            f"{self.examples} SFT examples from {self.source} ({self.data_format}; {tok}), "
            f"--packing {self.packing}, {micro_batch_words(self.rows, self.widths, t, self.packing)}"
            f" ({sum(t):,} target tokens of {self.tokens:,})"
        )


def micro_batch_words(rows: list[int], widths: list[int], targets: list[int], packing: str) -> str:
    """The micro-batches in words: "k = 2 micro-batches: " and each one as "4 examples padded
    to 37 tokens holding 20 targets" ("2 padding-free rows of 64 tokens holding 73 targets"),
    joined by ", "; beyond SHOWN micro-batches, "k = 12 micro-batches of" the range of each
    count."""
    if packing == "padding-free":
        noun, cut = "padding-free row", "of"
    else:
        noun, cut = "example", "padded to"
    k = f"k = {len(targets)} micro-batches"
    if len(targets) > SHOWN:
        return (
            f"{k} of {_span(rows)} {noun}s {cut} {_span(widths)} tokens holding "
            f"{_span(targets)} targets each"
        )
    return f"{k}: " + ", ".join(
        f"{r} {noun}{'s' * (r != 1)} {cut} {w} tokens holding {t} target{'s' * (t != 1)}"
        for r, w, t in zip(rows, widths, targets, strict=True)
    )


def _span(values: list[int]) -> str:
    low, high = min(values), max(values)
    return str(low) if low == high else f"{low}..{high}"


def read_examples(data: str | None, reading: Reading, seed: int, wanted: int) -> SFTData:
    """The examples as `train --task sft` reads them: --data through the trainer's
    `load_sft`, or (data None) `wanted` built-in rows drawn from `seed`, tokenized by
    `reading.tokenizer` with the trainer's options. BadInput for data that cannot be read."""
    tok, options = reading.tokenizer, reading.options()
    if data is None:
        rows = rows_from_dicts(builtin_rows(seed=seed, n=wanted), SOURCE)
        return tokenize_rows(rows, tok, source=BUILTIN, **options)
    return load_sft(data, tok, split=reading.data_split, **options)


def sft_window(
    sft: SFTData,
    pad_id: int,
    sizes: dict,
    seed: int,
    layout: str,
    packing: str = "none",
    micro_batch_tokens: int | None = None,
    tokenizer: str = ByteTokenizer.origin,
) -> SFTWindow:
    """The first window of k x micro_batch examples of `sft` (module docstring). sizes: the
    window's k, micro_batch and seq_len (`cli/verify.parse_sizes`). pad_id: the tokenizer's.
    layout: "shifted" for the built-in GPT's loss, "unshifted" for a Hugging Face model's
    (whose padding-free rows carry position ids only). tokenizer: its origin, in words.
    Raises BadInput when the data holds fewer examples than the window."""
    k, micro_batch, seq_len = sizes["k"], sizes["micro_batch"], sizes["seq_len"]
    wanted = k * micro_batch
    if len(sft.examples) < wanted:
        raise BadInput(
            "--data",
            sft.source,
            f"{len(sft.examples)} examples, fewer than the window's --k {k} x --micro-batch "
            f"{micro_batch} = {wanted}",
        )
    order = SFTBatches(
        sft.examples,
        micro_batch=micro_batch,
        examples_per_step=wanted,
        pad_id=pad_id,
        layout=layout,
        seed=seed,
    )
    big = None
    if packing == "none":
        window = next(order)
    else:
        budget = micro_batch_tokens or micro_batch * seq_len
        cut = Packing.of_run(packing, budget, seq_len)  # the trainer's, without --compile
        window = packed_window(order, cut)
        big = collate([sft.examples[i] for i in window.indices], pad_id, layout)
    batches = window.micro_batches
    return SFTWindow(
        micro_batches=batches,
        source=sft.source,
        data_format=sft.data_format,
        tokenizer=tokenizer,
        examples=window.examples,
        targets=[int((b["labels"] != -100).sum()) for b in batches],
        widths=[int(b["input_ids"].shape[1]) for b in batches],
        rows=[int(b["input_ids"].shape[0]) for b in batches],
        tokens=window.tokens,
        truncated=sft.truncated,
        packing=packing,
        big_batch=big,
    )
