"""Sequences of a `TokenDataset` in micro-batches: `Batches`, the endless deterministic
training stream split over ranks and resumable under another batch layout, and
`eval_batches`, the same held-out sequences every time. Given an end-of-document id
(`--document-mask`), each micro-batch also carries the position_ids and document_ids of
`packing.document_positions`, so attention stays within each document of a row."""

from __future__ import annotations

import numpy as np
import torch

from gradaccum.data.sft.packing import document_positions
from gradaccum.data.tokens import TokenDataset
from gradaccum.utils.errors import BadInput


def as_batch(rows: torch.Tensor, eod_id: int | None = None) -> dict:
    """Sequences of T + 1 tokens as a batch: inputs the first T, labels the last T (already
    shifted: label t is the token after input t). With `eod_id`, also "position_ids" and
    "document_ids" (b, T) long: positions restart and attention is cut at each
    end-of-document input (`document_positions`); every label is kept."""
    batch = {"input_ids": rows[:, :-1].contiguous(), "labels": rows[:, 1:].contiguous()}
    if eod_id is not None:
        batch["position_ids"], batch["document_ids"] = document_positions(
            batch["input_ids"], eod_id
        )
    return batch


class Batches:
    """An endless, deterministic iterator of micro-batches of `micro_batch` sequences.

    The data order is one stream of sequences, the same whatever the batch layout: epoch e is
    a permutation of the training sequences seeded by (seed, e), and epochs follow each other
    with nothing skipped. Each micro-step all `world_size` ranks together take the next
    world_size * micro_batch sequences of the stream, rank r its own slice: at this rank's
    position p it takes stream[(p * world_size + rank) * micro_batch + i], i < micro_batch.
    So b x k on one process and b x k / W on each of W ranks read the same windows, epoch
    boundaries included (a window may straddle two epochs). Yields {"input_ids": (b, T) long,
    "labels": (b, T) long}, with `eod_id` also "position_ids" and "document_ids" (`as_batch`).
    """

    def __init__(
        self,
        ds: TokenDataset,
        micro_batch: int,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        start: int = 0,
        eod_id: int | None = None,
    ):
        if micro_batch < 1:
            raise ValueError(f"micro_batch must be >= 1, got {micro_batch}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} not in [0, world_size {world_size})")
        if len(ds) == 0:
            raise BadInput("--data: the training split holds no sequence")
        self.ds, self.micro_batch, self.seed = ds, micro_batch, seed
        self.rank, self.world_size, self.eod_id = rank, world_size, eod_id
        self.position = start
        """Micro-batches this rank has consumed since the start (over all epochs)."""
        self._perms: dict[int, np.ndarray] = {}

    @property
    def epoch(self) -> int:
        """The epoch of the next sequence this rank reads."""
        return self._first(self.position) // len(self.ds)

    def _first(self, position: int) -> int:
        return (position * self.world_size + self.rank) * self.micro_batch

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            self._perms = {e: p for e, p in self._perms.items() if e >= epoch - 1}
            rng = np.random.default_rng((self.seed, epoch))
            self._perms[epoch] = rng.permutation(len(self.ds))
        return self._perms[epoch]

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        n, first = len(self.ds), self._first(self.position)
        ids = [int(self._perm(g // n)[g % n]) for g in range(first, first + self.micro_batch)]
        self.position += 1
        return as_batch(self.ds.batch(ids), self.eod_id)

    def set_micro_batch(self, micro_batch: int) -> None:
        """Read on in micro-batches of `micro_batch` sequences from the same place in the
        stream; it must divide the sequences read so far per rank and micro-step."""
        read = self.position * self.micro_batch
        if micro_batch < 1 or read % micro_batch:
            raise ValueError(f"micro_batch {micro_batch} does not divide the {read} read so far")
        self.micro_batch, self.position = micro_batch, read // micro_batch

    def state_dict(self) -> dict:
        return {
            "position": self.position,
            "sequences": self.position * self.world_size * self.micro_batch,
            "seed": self.seed,
            "micro_batch": self.micro_batch,
            "world_size": self.world_size,
            "num_sequences": len(self.ds),
        }

    def load_state_dict(self, state: dict, other_data: bool = False) -> None:
        """Continue where `state` stopped in the stream, whatever its micro-batch and world
        size were: the position is the number of sequences all ranks read together, so it
        carries over to any layout that divides it. other_data: the stream is another one
        (more or fewer sequences), read from the same position on."""
        if state["seed"] != self.seed:
            raise ValueError(
                f"cannot resume data position: seed was {state['seed']}, now {self.seed}"
            )
        if state["num_sequences"] != len(self.ds) and not other_data:
            raise ValueError(
                f"cannot resume data position: num_sequences was {state['num_sequences']}, "
                f"now {len(self.ds)}"
            )
        read = int(
            state.get("sequences", state["position"] * state["world_size"] * state["micro_batch"])
        )
        per_step = self.world_size * self.micro_batch
        if read % per_step:
            raise ValueError(
                f"cannot resume data position: {read} sequences read is not a whole number of "
                f"micro-steps of {self.micro_batch} sequences x {self.world_size} rank(s)"
            )
        self.position = read // per_step


def eval_batches(
    ds: TokenDataset,
    micro_batch: int,
    max_sequences: int | None = None,
    rank: int = 0,
    world_size: int = 1,
    eod_id: int | None = None,
):
    """The first `max_sequences` sequences of `ds` in order, in micro-batches, rank r taking
    every world_size-th micro-batch: the same evaluation set every time. `eod_id`: document
    masked as `Batches` (`as_batch`)."""
    n = len(ds) if max_sequences is None else min(len(ds), max_sequences)
    for k, first in enumerate(range(0, n, micro_batch)):
        if k % world_size == rank:
            yield as_batch(ds.batch(range(first, min(n, first + micro_batch))), eod_id)
