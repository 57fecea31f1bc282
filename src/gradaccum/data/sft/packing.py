"""A window's examples rearranged into micro-batches, exactly: the three `--packing` modes.

The engine divides the window's summed loss by the window's target count once, so its
gradient is the same however the window's examples are split into micro-batches, as long as
every target is computed exactly as it would be alone. Each mode keeps that:

- "none": runs of `micro_batch` examples, longest first, each padded to its own longest
  (`sft_batches.collate`, as SFTBatches cuts them);
- "window": micro-batches by a token budget: longest first, each micro-batch filled while
  (its examples x its longest, padding included) <= micro_batch_tokens; with `buckets`, the
  width is rounded up to the next bucket length, so a compiled model sees a few shapes only.
  Right padding under a causal mask changes no real position's logits;
- "padding-free": the examples concatenated into rows of exactly `row_tokens` positions
  (first-fit decreasing), `position_ids` restarting at 0 at each example and `document_ids`
  (0, 1, 2 ... per example in the row, -1 on the tail padding) so attention stays within each
  example: the built-in GPT reads both (a block-causal SDPA mask); Hugging Face models read the
  restarting `position_ids` (transformers builds the same block mask when no attention_mask
  is given: `gradaccum.hf.loss_fn` hands it so). Without `buckets` every micro-batch has the
  same shape (rows_per_micro_batch, row_tokens), empty rows filling the last one: `--compile`
  compiles once. With `buckets` ("bucketed rows") a row is only as wide as the bucket that
  fits the example opening it (the longest first, so the long tail gets wide rows and the
  rest narrow ones), micro-batches hold rows of one width, budget // width of them, each cut
  to its longest row's content rounded up to a bucket: a block-masked SDPA computes each
  row's full width^2 attention, so narrow rows compute less for the same tokens; the shapes
  are bounded by the buckets (widths) and the budget (rows).

Layouts follow the loss (`sft_examples`): "shifted" (the built-in GPT's
`models.loss.causal_lm_loss`: example inputs ids[:-1], labels labels[1:], one position fewer
per example) and "unshifted" (`gradaccum.hf.loss_fn`, which shifts over the whole row: an
example's first label is -100, so the last token of one example never learns the next
example's first token). Either way no target crosses examples and the targets counted are
those of the examples.

Pretraining on documents: `document_positions` turns token-stream rows with end-of-document
ids into the same position_ids / document_ids.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from gradaccum.data.sft.examples import IGNORE_INDEX, Example
from gradaccum.data.sft.windows import LAYOUTS, collate
from gradaccum.models.document_mask import positions_from_documents
from gradaccum.utils.choices import PACKINGS
from gradaccum.utils.errors import BadInput

__all__ = [
    "PACKINGS",
    "bucket_lengths",
    "collate_packed",
    "collate_window",
    "document_positions",
    "micro_batches",
    "pack_micro_batches",
    "pack_rows",
    "padded_width",
    "window_micro_batches",
]

PAD_DOCUMENT = -1
"""document_ids of a row's tail padding (and of empty rows)."""


def _width(example: Example, layout: str | None) -> int:
    """Positions the example takes in a micro-batch: its tokens, one fewer when shifted."""
    return example.length - 1 if layout == "shifted" else example.length


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r} not in {LAYOUTS}")


def _longest_first(examples: Sequence[Example]) -> list[int]:
    """Positions of `examples`, longest first, ties in the given order."""
    return sorted(range(len(examples)), key=lambda i: (-examples[i].length, i))


def bucket_lengths(longest: int, count: int = 4) -> list[int]:
    """`count` widths (tokens) up to `longest`, each about twice the one before: the last is
    `longest` itself, so at most `count` shapes and at most 2x padding over the group's own
    longest (less near the top)."""
    if longest < 1 or count < 1:
        raise ValueError(f"bucket_lengths({longest}, {count}): both must be >= 1")
    widths = {max(1, -(-longest // (1 << j))) for j in range(count)}
    return sorted(widths)


def padded_width(longest: int, buckets: Sequence[int] | None) -> int:
    """The width (tokens) a micro-batch whose longest row is `longest` is padded to: the
    smallest bucket >= longest, or `longest` itself without buckets or above every bucket."""
    if not buckets:
        return longest
    fitting = [b for b in buckets if b >= longest]
    return min(fitting) if fitting else longest


def window_micro_batches(
    examples: Sequence[Example],
    micro_batch_tokens: int,
    pad_id: int,
    layout: str = "shifted",
    buckets: Sequence[int] | None = None,
) -> list[list[int]]:
    """Positions of `examples` per micro-batch, by a token budget (mode "window").

    Longest first (ties in the given order); a micro-batch opens with the longest example
    left, its width that example's positions (one fewer when `layout` is "shifted"), rounded
    up to a bucket when `buckets` are given, and takes the next examples while
    (count x width) <= micro_batch_tokens. An example wider than the budget is a micro-batch
    alone. `pad_id` is unused here (the signature matches `collate_window`'s)."""
    del pad_id
    _check_layout(layout)
    if micro_batch_tokens < 1:
        raise BadInput(f"--micro-batch-tokens {micro_batch_tokens}: must be >= 1")
    groups: list[list[int]] = []
    width = 0
    for i in _longest_first(examples):
        if groups and (len(groups[-1]) + 1) * width <= micro_batch_tokens:
            groups[-1].append(i)
            continue
        groups.append([i])
        width = padded_width(_width(examples[i], layout), buckets)
    return groups


def collate_window(
    examples: Sequence[Example],
    groups: Sequence[Sequence[int]],
    pad_id: int,
    layout: str = "shifted",
    buckets: Sequence[int] | None = None,
    fill_budget: int | None = None,
) -> list[dict[str, torch.Tensor]]:
    """One micro-batch per group (positions in `examples`): `sft_batches.collate` (input_ids,
    labels, attention_mask; (b, T) int64), T the group's longest, or the next bucket.

    `fill_budget` (tokens, the budget the groups were cut by): empty rows pad each micro-batch
    to max(b, fill_budget // T) rows, so that with buckets the shapes are bounded by the
    buckets, one row count per width (`--compile`). An empty row has no target, so it weighs
    nothing; its attention_mask is 1 (a causal row of pad tokens), because a row attending to
    nothing can make SDPA's softmax NaN, and NaN x 0 is not 0."""
    fill = {"input_ids": pad_id, "labels": IGNORE_INDEX, "attention_mask": 0}
    out = []
    for group in groups:
        batch = collate([examples[i] for i in group], pad_id, layout)
        b, t = batch["input_ids"].shape
        extra = padded_width(t, buckets) - t
        if extra:
            batch = {
                key: torch.nn.functional.pad(value, (0, extra), value=fill[key])
                for key, value in batch.items()
            }
        rows = max(b, fill_budget // (t + extra)) - b if fill_budget else 0
        if rows:
            empty = {"input_ids": pad_id, "labels": IGNORE_INDEX, "attention_mask": 1}
            batch = {
                key: torch.cat([value, value.new_full((rows, t + extra), empty[key])])
                for key, value in batch.items()
            }
        out.append(batch)
    return out


def row_capacity(width: int, row_tokens: int, buckets: Sequence[int] | None) -> int:
    """Positions of a padding-free row opened by an example of `width` positions: row_tokens,
    or with `buckets` the smallest bucket that fits it (at most row_tokens)."""
    return row_tokens if not buckets else min(row_tokens, padded_width(width, buckets))


def pack_rows(
    examples: Sequence[Example],
    row_tokens: int,
    layout: str | None = None,
    buckets: Sequence[int] | None = None,
) -> list[list[int]]:
    """Positions of `examples` per padding-free row: first-fit decreasing (longest first, ties
    in the given order, each into the first row with room), each row's positions <=
    row_tokens, or with `buckets` <= the capacity its first example opened it with
    (`row_capacity`): rows come out widest first. `layout`: None counts every token of an
    example (the rows fit either layout); "shifted" counts one fewer per example (its inputs
    are ids[:-1]). Raises BadInput when an example alone is longer than a row."""
    if row_tokens < 1:
        raise BadInput(f"--micro-batch-tokens {row_tokens}: a row must hold >= 1 token")
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(examples)), key=lambda j: (-_width(examples[j], layout), j)):
        width = _width(examples[i], layout)
        if width > row_tokens:
            raise BadInput(
                f"--micro-batch-tokens {row_tokens}: an example of {examples[i].length} tokens "
                f"does not fit a padding-free row of {row_tokens} tokens; raise the budget"
            )
        for r, left in enumerate(room):
            if width <= left:
                rows[r].append(i)
                room[r] -= width
                break
        else:
            rows.append([i])
            room.append(row_capacity(width, row_tokens, buckets) - width)
    return rows


def pack_micro_batches(
    examples: Sequence[Example],
    row_tokens: int,
    budget: int,
    layout: str | None = None,
    buckets: Sequence[int] | None = None,
) -> list[tuple[list[list[int]], int]]:
    """Padding-free micro-batches of `examples`: (its rows, as `pack_rows` gives them, and its
    width in positions) for each. Without `buckets`: max(1, budget // row_tokens) rows of
    row_tokens each. With: rows of one capacity together, max(1, budget // capacity) per
    micro-batch, its width the longest row's content rounded up to a bucket (<= capacity)."""
    rows = pack_rows(examples, row_tokens, layout, buckets)
    if not buckets:
        per = max(1, budget // row_tokens)
        return [(rows[i : i + per], row_tokens) for i in range(0, len(rows), per)]
    widths = [sum(_width(examples[i], layout) for i in row) for row in rows]
    caps = [row_capacity(_width(examples[row[0]], layout), row_tokens, buckets) for row in rows]
    out: list[tuple[list[list[int]], int]] = []
    start = 0
    for r in range(1, len(rows) + 1):
        if r == len(rows) or caps[r] != caps[start] or r - start == max(1, budget // caps[start]):
            content = max(widths[start:r])
            out.append((rows[start:r], min(caps[start], padded_width(content, buckets))))
            start = r
    return out


def collate_packed(
    examples: Sequence[Example],
    rows: Sequence[Sequence[int]],
    row_tokens: int,
    pad_id: int,
    layout: str = "shifted",
    num_rows: int | None = None,
) -> dict[str, torch.Tensor]:
    """One padding-free micro-batch: each row of `rows` (positions in `examples`, in order)
    concatenated and padded on the right to `row_tokens`. `num_rows`: rows of the batch
    (at least len(rows)); the extra rows are all padding, so every micro-batch can have one
    shape.

    Keys, each (num_rows, row_tokens) int64: "input_ids" (pad_id on padding); "labels"
    (-100 on padding, on non-targets and at each example's first position, so no target
    crosses examples); "position_ids" (0, 1, ... within each example, 0 on padding);
    "document_ids" (0, 1, 2 ... per example within its row, -1 on padding)."""
    _check_layout(layout)
    num_rows = len(rows) if num_rows is None else num_rows
    if num_rows < len(rows):
        raise ValueError(f"num_rows {num_rows} < the {len(rows)} rows given")
    shape = (num_rows, row_tokens)
    input_ids = np.full(shape, pad_id, dtype=np.int64)
    labels = np.full(shape, IGNORE_INDEX, dtype=np.int64)
    positions = np.zeros(shape, dtype=np.int64)
    documents = np.full(shape, PAD_DOCUMENT, dtype=np.int64)
    for r, row in enumerate(rows):
        at = 0
        for doc, i in enumerate(row):
            e = examples[i]
            ids, lab = (
                (e.input_ids[:-1], e.labels[1:]) if layout == "shifted" else (e.input_ids, e.labels)
            )
            n = len(ids)
            if at + n > row_tokens:
                raise ValueError(
                    f"row {r} holds {at + n} positions in layout {layout!r}, more than "
                    f"row_tokens {row_tokens} (pack_rows with layout=None fits both layouts)"
                )
            input_ids[r, at : at + n] = ids
            labels[r, at : at + n] = lab
            if layout == "unshifted":
                labels[r, at] = IGNORE_INDEX
            positions[r, at : at + n] = np.arange(n)
            documents[r, at : at + n] = doc
            at += n
    return {
        "input_ids": torch.from_numpy(input_ids),
        "labels": torch.from_numpy(labels),
        "position_ids": torch.from_numpy(positions),
        "document_ids": torch.from_numpy(documents),
    }


def micro_batches(
    examples: Sequence[Example],
    packing: str,
    *,
    micro_batch: int | None = None,
    micro_batch_tokens: int | None = None,
    pad_id: int,
    layout: str = "shifted",
    row_tokens: int | None = None,
    buckets: Sequence[int] | None = None,
) -> list[dict[str, torch.Tensor]]:
    """`examples` (one rank's share of a window) as micro-batches for `Accumulator.step`, in
    `packing` mode (see the module docstring); an empty list when there is no example.

    "none": runs of `micro_batch` examples, longest first. "window": `micro_batch_tokens`
    per micro-batch, padding included; with `buckets` the width rounded up to a bucket and
    the rows filled to budget // width (few shapes; an empty row's attention_mask is 1, so a
    mixture of experts' balance would route its tokens: leave `buckets` out there).
    "padding-free": rows of at most
    `row_tokens` positions (default: micro_batch_tokens // micro_batch when micro_batch is
    given, the sequence length with the default budget, else micro_batch_tokens); without
    `buckets` max(1, micro_batch_tokens // row_tokens) rows per micro-batch, all of one
    shape; with `buckets`, bucketed rows (`pack_micro_batches`)."""
    _check_layout(layout)
    if packing not in PACKINGS:
        raise BadInput(f"--packing {packing}: choose one of {', '.join(PACKINGS)}")
    if not examples:
        return []
    if packing == "none":
        if micro_batch is None or micro_batch < 1:
            raise BadInput(f"--micro-batch {micro_batch}: must be >= 1")
        order = _longest_first(examples)
        runs = [order[i : i + micro_batch] for i in range(0, len(order), micro_batch)]
        return [collate([examples[i] for i in run], pad_id, layout) for run in runs]
    if micro_batch_tokens is None or micro_batch_tokens < 1:
        raise BadInput(f"--micro-batch-tokens {micro_batch_tokens}: must be >= 1")
    if packing == "window":
        groups = window_micro_batches(examples, micro_batch_tokens, pad_id, layout, buckets)
        fill = micro_batch_tokens if buckets else None
        return collate_window(examples, groups, pad_id, layout, buckets, fill)
    if row_tokens is None:
        row_tokens = micro_batch_tokens // micro_batch if micro_batch else micro_batch_tokens
    per_batch = max(1, micro_batch_tokens // row_tokens)
    runs = pack_micro_batches(examples, row_tokens, micro_batch_tokens, layout, buckets)
    return [
        collate_packed(examples, rows, width, pad_id, layout, None if buckets else per_batch)
        for rows, width in runs
    ]


def document_positions(input_ids: torch.Tensor, eod_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(position_ids, document_ids) of token-stream rows (b, T) (or one row (T,)) whose
    documents are separated by the end-of-document id `eod_id`, both int64 of the same shape.

    An end-of-document *input* opens the next document (it plays the part of that document's
    BOS): the target it predicts, the next document's first token, is then predicted from it
    alone, and the target before it (the EOD, predicted from the end of its document) stays
    within that document. So every target of the stream is kept, and no position attends
    across documents. The row's first tokens (a document cut by the row's start) are
    document 0, at positions 0, 1, ..."""
    row = input_ids if input_ids.dim() == 2 else input_ids[None]
    document_ids = (row == eod_id).long().cumsum(dim=1)
    position_ids = positions_from_documents(document_ids)
    if input_ids.dim() == 1:
        return position_ids[0], document_ids[0]
    return position_ids, document_ids
