"""SFT examples into windows for the engine: one window per optimizer step, split over ranks
into micro-batches padded to their own longest; and the held-out split.

The data order is one stream of examples fixed by the seed: epoch e is a permutation of the
training examples seeded by (seed, e), and epochs follow each other (a window may straddle two).
A window is the next examples of the stream:
- `examples_per_step=E`: the next E examples (the global batch of HF/TRL: per-device batch
  x accumulation x devices);
- `tokens_per_step=B`: whole examples, in stream order, while their total stays within B
  (a single example over B makes a window of its own). `budget="targets"` (the default)
  counts target tokens, the N the engine divides by: every step then averages the gradient
  over about the same number of targets, whatever the prompts' lengths, so the learning rate
  means the same thing every step. `budget="tokens"` counts every token (prompt and
  completion, no padding), a bound on the step's compute.
With `stop` (a run of --epochs), the stream ends after its first `stop` examples: the window
that reaches that place is cut short there (its own N), so E whole epochs train each example
exactly E times.
So the windows, and the gradient of each, do not depend on the micro-batch or the number of
ranks. Within a window the examples are sorted longest first (ties in stream order) and dealt
round-robin to the ranks, rank r taking the r-th, (r+W)-th, ... (the ranks' loads stay close),
and each rank cuts its share into micro-batches of `micro_batch` consecutive examples (similar
lengths together: less padding). This changes only the cost, never the update: the engine
weighs every target by 1/N over the window. A rank may hold fewer micro-batches than another
(the engine repeats a batch with weight 0); a rank with no example at all in a window gets
one micro-batch with no target (the window's shortest example, every label -100), which adds
nothing to the gradient and lets it join the window's collectives.

Micro-batches are dicts of (b, T) int64 tensors, T the micro-batch's own longest row:
"input_ids" (padded with pad_id), "labels" (-100 on padding and non-targets), "attention_mask"
(1 on real tokens). The layout follows the loss (sft_examples): "shifted" for
gradaccum.models.loss.causal_lm_loss, "unshifted" for gradaccum.hf.loss_fn.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from gradaccum.data.sft.examples import IGNORE_INDEX, Example
from gradaccum.utils.errors import BadInput

__all__ = ["BUDGETS", "LAYOUTS", "SFTBatches", "Window", "collate", "split_heldout", "split_window"]

LAYOUTS = ("shifted", "unshifted")
BUDGETS = ("targets", "tokens")
HELDOUT_STREAM = 1 << 40
"""Second seed word of the held-out choice; epochs use (seed, epoch), epochs stay far below."""


def collate(
    examples: Sequence[Example], pad_id: int, layout: str = "shifted", no_targets: bool = False
) -> dict[str, torch.Tensor]:
    """One micro-batch of `examples`, padded on the right to its longest row (see the module
    docstring). no_targets: every label -100 (a rank's stand-in micro-batch)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r} not in {LAYOUTS}")
    if layout == "shifted":
        rows = [(e.input_ids[:-1], e.labels[1:]) for e in examples]
    else:
        rows = [(e.input_ids, e.labels) for e in examples]
    width = max(len(ids) for ids, _ in rows)
    input_ids = np.full((len(rows), width), pad_id, dtype=np.int64)
    labels = np.full((len(rows), width), IGNORE_INDEX, dtype=np.int64)
    mask = np.zeros((len(rows), width), dtype=np.int64)
    for r, (ids, lab) in enumerate(rows):
        input_ids[r, : len(ids)] = ids
        mask[r, : len(ids)] = 1
        if not no_targets:
            labels[r, : len(lab)] = lab
    return {
        "input_ids": torch.from_numpy(input_ids),
        "labels": torch.from_numpy(labels),
        "attention_mask": torch.from_numpy(mask),
    }


def split_window(
    indices: Sequence[int],
    lengths: Sequence[int],
    micro_batch: int,
    world_size: int,
    sort_by_length: bool = True,
) -> list[list[list[int]]]:
    """The window's examples (positions `indices`, stream order) per rank, per micro-batch:
    sorted longest first by `lengths[i]` (ties in stream order) when sort_by_length, dealt
    round-robin to the ranks, each rank's share cut into runs of micro_batch."""
    order = list(range(len(indices)))
    if sort_by_length:
        order.sort(key=lambda j: (-int(lengths[indices[j]]), j))
    shares = [[indices[j] for j in order[r::world_size]] for r in range(world_size)]
    return [[s[i : i + micro_batch] for i in range(0, len(s), micro_batch)] for s in shares]


@dataclass
class Window:
    """One optimizer step's data: this rank's micro-batches and the whole window's counts."""

    micro_batches: list[dict]
    """This rank's micro-batches (at least one)."""
    shares: list[list[int]]
    """This rank's micro-batches as example positions (empty for a no-target stand-in)."""
    indices: list[int]
    """Every example of the window on all ranks, as positions in `examples`, stream order."""
    targets: int
    """Target tokens of the window over all ranks: the engine's N."""
    tokens: int
    """Tokens of the window's examples over all ranks, padding not counted."""
    padded_tokens: int
    """Tokens this rank's micro-batches hold, padding included (its compute)."""
    epoch: int
    """Epoch of the window's first example."""

    @property
    def examples(self) -> int:
        """Examples in the window over all ranks."""
        return len(self.indices)


class SFTBatches:
    """An endless iterator of `Window`s over `examples` (see the module docstring).

    micro_batch: examples per micro-batch. examples_per_step / tokens_per_step: the window's
    size (exactly one of them); budget: what tokens_per_step counts ("targets" or "tokens").
    pad_id: the input id of padding. layout: "shifted" or "unshifted" (the loss's).
    seed: the data order. rank, world_size: this process among the data-parallel ranks.
    stop: examples of the stream the run trains on (the last window ends there); None: endless.
    """

    def __init__(
        self,
        examples: Sequence[Example],
        *,
        micro_batch: int,
        pad_id: int,
        examples_per_step: int | None = None,
        tokens_per_step: int | None = None,
        budget: str = "targets",
        layout: str = "shifted",
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        sort_by_length: bool = True,
        stop: int | None = None,
    ):
        self.examples = examples
        self.lengths = np.array([e.length for e in examples], dtype=np.int64)
        self.targets = np.array([e.num_targets for e in examples], dtype=np.int64)
        _check(len(examples), micro_batch, examples_per_step, tokens_per_step, budget, layout)
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} not in [0, world_size {world_size})")
        self.counts = self.targets if budget == "targets" else self.lengths
        if tokens_per_step is not None and tokens_per_step > int(self.counts.sum()):
            raise BadInput(
                f"--tokens-per-step {tokens_per_step}: the {len(examples)} training examples "
                f"hold {int(self.counts.sum())} {budget} in all; use a smaller budget"
            )
        self.micro_batch, self.pad_id, self.layout = micro_batch, pad_id, layout
        self.examples_per_step, self.tokens_per_step = examples_per_step, tokens_per_step
        self.budget, self.seed, self.sort_by_length = budget, seed, sort_by_length
        self.rank, self.world_size, self.stop = rank, world_size, stop
        self.position = 0
        """Examples of the stream all ranks have taken together (over all epochs)."""
        self.windows = 0
        """Windows taken."""
        self._perms: dict[int, np.ndarray] = {}

    @property
    def epoch(self) -> int:
        """The epoch of the next example of the stream."""
        return self.position // len(self.examples)

    def _at(self, g: int) -> int:
        """The example at position g of the stream."""
        n = len(self.examples)
        epoch = g // n
        if epoch not in self._perms:
            self._perms = {e: p for e, p in self._perms.items() if e >= epoch - 1}
            self._perms[epoch] = np.random.default_rng([self.seed, epoch]).permutation(n)
        return int(self._perms[epoch][g % n])

    def next_indices(self) -> list[int]:
        """The next window's examples (positions, stream order), without taking them."""
        g = self.position
        left = None if self.stop is None else self.stop - g
        if left is not None and left < 1:
            raise StopIteration  # past the run's last window
        if self.examples_per_step is not None:
            count = self.examples_per_step if left is None else min(left, self.examples_per_step)
            return [self._at(g + j) for j in range(count)]
        taken, total = [], 0
        while True:
            if len(taken) == left:
                return taken
            i = self._at(g + len(taken))
            if taken and total + self.counts[i] > self.tokens_per_step:
                return taken
            taken.append(i)
            total += int(self.counts[i])

    def __iter__(self):
        return self

    def __next__(self) -> Window:
        indices = self.next_indices()
        epoch = self.epoch
        shares = split_window(
            indices, self.lengths, self.micro_batch, self.world_size, self.sort_by_length
        )[self.rank]
        if shares:
            batches = [
                collate([self.examples[i] for i in s], self.pad_id, self.layout) for s in shares
            ]
        else:
            shortest = min(indices, key=lambda i: self.lengths[i])
            ex = [self.examples[shortest]]
            batches = [collate(ex, self.pad_id, self.layout, no_targets=True)]
        self.position += len(indices)
        self.windows += 1
        return Window(
            micro_batches=batches,
            shares=shares,
            indices=indices,
            targets=int(self.targets[indices].sum()),
            tokens=int(self.lengths[indices].sum()),
            padded_tokens=sum(int(b["input_ids"].numel()) for b in batches),
            epoch=epoch,
        )

    def state_dict(self) -> dict:
        return {
            "position": self.position,
            "windows": self.windows,
            "epoch": self.epoch,
            "seed": self.seed,
            "num_examples": len(self.examples),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue after the last window `state` saw. The position counts examples of the
        stream over all ranks, so it carries over to any micro-batch and world size."""
        for key, now in (("seed", self.seed), ("num_examples", len(self.examples))):
            if state[key] != now:
                raise ValueError(f"cannot resume the SFT data: {key} was {state[key]}, now {now}")
        self.position, self.windows = int(state["position"]), int(state["windows"])


def _check(n, micro_batch, examples_per_step, tokens_per_step, budget, layout) -> None:
    if n == 0:
        raise BadInput("--data: no training example")
    if micro_batch < 1:
        raise BadInput(f"--micro-batch {micro_batch}: must be >= 1")
    if (examples_per_step is None) == (tokens_per_step is None):
        raise BadInput("--examples-per-step / --tokens-per-step: give exactly one")
    if examples_per_step is not None and not 1 <= examples_per_step <= n:
        raise BadInput(
            f"--examples-per-step {examples_per_step}: must be in [1, {n}] (the training examples)"
        )
    if tokens_per_step is not None and tokens_per_step < 1:
        raise BadInput(f"--tokens-per-step {tokens_per_step}: must be >= 1")
    if budget not in BUDGETS:
        raise ValueError(f"budget {budget!r} not in {BUDGETS}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r} not in {LAYOUTS}")


def split_heldout(
    examples: Sequence, heldout: float | int, seed: int = 0, flag: str = "--val-fraction"
):
    """(train, held_out): `heldout` examples set aside, chosen by a permutation seeded by
    (seed, HELDOUT_STREAM); both keep the input order. heldout: a float in [0, 1) is a
    fraction (at least one example when above 0), an int a count. Raises BadInput (naming
    `flag`) when nothing would be left to train on."""
    n = len(examples)
    if isinstance(heldout, bool) or not isinstance(heldout, (int, float)):
        raise TypeError(f"heldout must be a float fraction or an int count, got {heldout!r}")
    if isinstance(heldout, float):
        if not 0.0 <= heldout < 1.0:
            raise BadInput(f"{flag} {heldout}: must be in [0, 1)")
        count = 0 if heldout == 0 else max(1, round(heldout * n))
    else:
        if heldout < 0:
            raise BadInput(f"{flag} {heldout}: must be >= 0")
        count = heldout
    if n - count < 1:
        raise BadInput(
            f"{flag} {heldout}: holds out {count} of the {n} examples, none left to train on"
        )
    chosen = set(np.random.default_rng([seed, HELDOUT_STREAM]).permutation(n)[:count].tolist())
    train = [e for i, e in enumerate(examples) if i not in chosen]
    held = [e for i, e in enumerate(examples) if i in chosen]
    return train, held
