"""What a run evaluates on: the file of --eval-data (the run then trains on all of --data), or
a share of --data held out by --eval-fraction (default DEFAULT_FRACTION; 0: no evaluation).

--eval-data is read by the reader of --data for the task (`data.tokens.load_tokens` for
pretraining here, `data.sft.load.load_sft` for SFT in `train.sft`), so it takes the same forms
and is tokenized the same way; its bad input is said as --eval-data's (`reading_eval_data`).
What a resume checks (the data's fingerprint) covers the eval set: another one is other data.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

from gradaccum.data.tokens import DataInfo, TokenDataset, load_tokens
from gradaccum.utils.errors import BadInput, first_line

DEFAULT_FRACTION = 0.05
"""Share of --data held out for evaluation when neither --eval-data nor --eval-fraction is
given."""

_DATA_FLAG = re.compile(r"^--data(?=[ :])")


def fraction_of(config) -> float:
    """--eval-fraction, or DEFAULT_FRACTION when not given (0 with --eval-data: no split)."""
    if config.eval_data is not None:
        return 0.0
    return DEFAULT_FRACTION if config.eval_fraction is None else config.eval_fraction


def heldout_count(config, examples: int, most: int) -> int:
    """SFT examples held out of `examples`: the fraction's share, at least one (when there
    are two or more) and at least one left to train on; the default fraction's at most
    `most`, a given fraction's as asked. 0 with --eval-data or --eval-fraction 0."""
    fraction = fraction_of(config)
    if fraction == 0 or examples < 2:
        return 0
    count = max(1, round(fraction * examples))
    if config.eval_fraction is None:
        count = min(count, most)
    return min(count, examples - 1)


def with_split(fingerprint: str, config, held_out: int) -> str:
    """A fingerprint of --data that also covers where a given --eval-fraction splits it
    (`held_out` examples or tokens); the default split's is --data's own, as before the flag."""
    if config.eval_fraction is None or config.eval_fraction == DEFAULT_FRACTION:
        return fingerprint
    return joined(fingerprint, f"held out {held_out}")


def joined(*parts: str) -> str:
    """One fingerprint of several (the training data's and the eval set's)."""
    digest = hashlib.blake2b(digest_size=16)
    for part in parts:
        digest.update(part.encode("utf-8") + b"\0")
    return digest.hexdigest()


def renamed(err: BadInput) -> BadInput:
    """`err`, said of --data by the reader, as the same fault of --eval-data."""
    text = _DATA_FLAG.sub("--eval-data", str(err), count=1)
    return BadInput(text.replace("left to train on", "left to evaluate on"))


@contextmanager
def reading_eval_data() -> Iterator[None]:
    """Around a read of --eval-data by --data's reader: its BadInput names --eval-data."""
    try:
        yield
    except BadInput as err:
        raise renamed(err) from None


def pretrain_tokens(config) -> tuple[TokenDataset, TokenDataset, DataInfo]:
    """(train, eval, info) of a pretraining run: --data split by --eval-fraction, or all of
    --data and the tokens of --eval-data (its vocabulary the larger of the two). BadInput
    naming the flag of the file at fault."""
    if config.eval_data is None:
        fraction = fraction_of(config)
        train, val, info = load_tokens(config.data, config.seq_len, config.seed, fraction)
        return (
            train,
            val,
            replace(info, fingerprint=with_split(info.fingerprint, config, info.val_tokens)),
        )
    train, _, info = load_tokens(config.data, config.seq_len, config.seed, val_fraction=0.0)
    with reading_eval_data():
        try:
            val, _, held = load_tokens(config.eval_data, config.seq_len, val_fraction=0.0)
        except (ValueError, OSError, ImportError) as err:
            if isinstance(err, BadInput):
                raise
            raise BadInput("--eval-data", config.eval_data, first_line(err)) from None
    return (
        train,
        val,
        replace(
            info,
            vocab_size=max(info.vocab_size, held.vocab_size),
            num_tokens=info.num_tokens + held.num_tokens,
            val_tokens=held.num_tokens,
            fingerprint=joined(info.fingerprint, held.fingerprint),
        ),
    )
