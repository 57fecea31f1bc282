"""A training window's SFT examples as micro-batches, per `--packing` mode.

`--packing none` is `SFTBatches`' own cut: the window sorted longest first, dealt round-robin to
the ranks, runs of `--micro-batch` examples each padded to its longest. The two other modes
(`gradaccum.data.sft.packing` builds their micro-batches) share one deal and differ in the cut:
- the deal: the window's examples, longest first (ties in stream order), each to the rank
  holding the fewest tokens so far (ties: the lowest rank). Round-robin hands rank 0 the
  longest of every round; by tokens the ranks' loads differ by at most one example's length;
- window: the rank's share cut by a token budget, longest first, each micro-batch filled while
  its examples x its longest (padding included) stay within `budget`, padded to its own longest
  (to the next of `buckets` when given, and with `fixed_rows` to budget // width rows by empty
  rows with no target, so that a compiled model sees one shape per bucket);
- padding-free: the share packed into rows of `row_tokens` positions (first-fit decreasing),
  the examples' positions restarting at 0 and attention kept inside each example
  (`document_ids`; a Hugging Face model reads the restarting `position_ids` alone),
  `budget // row_tokens` rows per micro-batch (at least one). With `fixed_rows` (--compile)
  empty rows fill a rank's last, so that a compiled model sees one shape, (rows, row_tokens);
  without, the last holds only the rows it needs (no compute on empty rows), and with
  `row_buckets` the rows are bucketed (`packing.pack_micro_batches`: a row as wide as the
  bucket of the example opening it, each micro-batch cut to its content's bucket), which
  computes less attention for the same tokens.
The number of micro-batches follows from the budget; every rank sees the whole window, and the
engine agrees on the largest count over the ranks (`Accumulator.begin_window`), a rank with fewer
repeating its last with weight 0. A rank left without an example gets one micro-batch of the
window's shortest example with no target. None of this changes the update: the engine divides
by the window's targets N, whichever micro-batch holds them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gradaccum.data.sft import packing as packer
from gradaccum.data.sft.examples import IGNORE_INDEX, Example
from gradaccum.data.sft.windows import SFTBatches, Window, collate

__all__ = ["Packing", "deal_by_tokens", "packed_window", "rank_micro_batches"]


@dataclass(frozen=True)
class Packing:
    """How a rank's share of a window becomes micro-batches."""

    mode: str
    """"window" or "padding-free" ("none" stays with `SFTBatches`)."""
    budget: int
    """Tokens per micro-batch, padding included (--micro-batch-tokens)."""
    row_tokens: int
    """Width of a padding-free row in tokens (--seq-len: the longest example fits one)."""
    buckets: tuple[int, ...] | None = None
    """window: widths a micro-batch is padded up to (None: its own longest)."""
    fixed_rows: bool = False
    """--compile: padding-free, every micro-batch `rows` rows, empty rows filling a rank's
    last; window, each micro-batch budget // width rows."""
    row_buckets: tuple[int, ...] | None = None
    """padding-free without `fixed_rows`: the widths of bucketed rows (None: rows of
    row_tokens)."""

    @property
    def rows(self) -> int:
        """Padding-free rows per micro-batch."""
        return max(1, self.budget // self.row_tokens)

    @classmethod
    def of_run(
        cls, mode: str, budget: int, seq_len: int, compile: bool = False, fill_rows: bool = True
    ) -> Packing:
        """The cut `gradaccum train` makes: with --compile few shapes (length buckets, full
        micro-batches of rows; `fill_rows` False leaves a window micro-batch's rows unfilled,
        as a mixture of experts' balance needs); otherwise the least padding, padding-free
        rows as narrow as their examples allow (a block mask computes each row's full
        width^2 attention)."""
        buckets = tuple(packer.bucket_lengths(seq_len))
        return cls(
            mode,
            budget,
            seq_len,
            buckets if compile else None,
            compile and (fill_rows or mode != "window"),
            None if compile else buckets,
        )


def deal_by_tokens(
    indices: Sequence[int], lengths: Sequence[int], world_size: int
) -> list[list[int]]:
    """The window's examples (positions `indices`, stream order) per rank: longest first
    (ties in stream order), each to the rank with the fewest tokens so far (ties: the lowest
    rank). Each share lists its examples in the order dealt."""
    order = sorted(range(len(indices)), key=lambda j: (-int(lengths[indices[j]]), j))
    shares: list[list[int]] = [[] for _ in range(world_size)]
    loads = [0] * world_size
    for j in order:
        r = min(range(world_size), key=lambda q: (loads[q], q))
        shares[r].append(indices[j])
        loads[r] += int(lengths[indices[j]])
    return shares


def rank_micro_batches(
    examples: Sequence[Example], share: list[int], packing: Packing, pad_id: int, layout: str
) -> tuple[list[list[int]], list[dict]]:
    """(the examples of each micro-batch as positions in `examples`, the micro-batches) of
    one rank's `share` (positions, longest first)."""
    local = [examples[i] for i in share]
    if packing.mode == "window":
        groups = packer.window_micro_batches(local, packing.budget, pad_id, layout, packing.buckets)
        batches = _window(local, groups, packing, pad_id, layout)
        return [[share[j] for j in g] for g in groups], batches
    if packing.mode != "padding-free":
        raise ValueError(f"packing {packing.mode!r}: SFTBatches cuts --packing none itself")
    buckets = None if packing.fixed_rows else packing.row_buckets
    runs = packer.pack_micro_batches(local, packing.row_tokens, packing.budget, layout, buckets)
    batches = [_packed(local, run, packing, pad_id, layout, width) for run, width in runs]
    return [[share[j] for row in run for j in row] for run, _ in runs], batches


def _window(local, groups, packing: Packing, pad_id: int, layout: str) -> list[dict]:
    """Window micro-batches (`packing.collate_window`), full to the budget with `fixed_rows`."""
    fill = packing.budget if packing.fixed_rows else None
    return packer.collate_window(local, groups, pad_id, layout, packing.buckets, fill)


def _packed(local, rows, packing: Packing, pad_id: int, layout: str, width: int) -> dict:
    """One padding-free micro-batch of `rows`, `width` positions wide
    (`packing.collate_packed`), `packing.rows` rows with `fixed_rows`."""
    count = packing.rows if packing.fixed_rows else len(rows)
    # document_ids stay whatever the model: the built-in GPT reads them, a Hugging Face model
    # is handed position_ids only (`models.loss.packed_inputs`), and a mixture of experts'
    # balance counts the tokens they mark as real (`models.router.routed_mask`)
    return packer.collate_packed(local, rows, width, pad_id, layout, count)


def _stand_in(example: Example, packing: Packing, pad_id: int, layout: str) -> dict:
    """A micro-batch of `example` with no target: it adds nothing to the gradient and lets a
    rank without an example join the window's collectives."""
    if packing.mode == "window":
        if not packing.fixed_rows:
            return collate([example], pad_id, layout, no_targets=True)
        batch = _window([example], [[0]], packing, pad_id, layout)[0]  # a compiled shape
        batch["labels"] = torch.full_like(batch["labels"], IGNORE_INDEX)
        return batch
    batch = _packed([example], [[0]], packing, pad_id, layout, packing.row_tokens)
    batch["labels"] = torch.full_like(batch["labels"], IGNORE_INDEX)
    return batch


def packed_window(batches: SFTBatches, packing: Packing) -> Window:
    """The next window of `batches` (its data order, rank and world size), this rank's share
    cut by `packing` (module docstring); `batches` moves on past it as `next(batches)` would."""
    indices = batches.next_indices()
    epoch = batches.epoch
    share = deal_by_tokens(indices, batches.lengths, batches.world_size)[batches.rank]
    if share:
        shares, micro = rank_micro_batches(
            batches.examples, share, packing, batches.pad_id, batches.layout
        )
    else:
        shortest = min(indices, key=lambda i: batches.lengths[i])
        example = batches.examples[shortest]
        shares, micro = [], [_stand_in(example, packing, batches.pad_id, batches.layout)]
    batches.position += len(indices)
    batches.windows += 1
    return Window(
        micro_batches=micro,
        shares=shares,
        indices=indices,
        targets=int(batches.targets[indices].sum()),
        tokens=int(batches.lengths[indices].sum()),
        padded_tokens=sum(int(b["input_ids"].numel()) for b in micro),
        epoch=epoch,
    )
