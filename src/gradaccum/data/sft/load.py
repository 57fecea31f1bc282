"""SFT data for `gradaccum train --task sft`: rows read, parsed and tokenized into examples.

    tokenizer = load_tokenizer(folder_or_None, flag="--init-from")
    data = load_sft("sft.jsonl", tokenizer, seq_len=2048)     # or tokenize_rows(rows, ...)
    data.examples        # list of sft_examples.Example (labels convention: sft_examples)
    data.summary_lines() # what the start-of-run print says: rows, bad, truncated, lengths

Sources and formats: `sft_rows`; what is a target, truncation: `sft_examples`.
A bad row (malformed JSON line, missing or non-string field, empty completion, no assistant
turn, unknown role, a conversation the chat template refuses) is a one-line BadInput naming the
file, the line or row, and the field; with `skip_bad_rows` it is skipped and counted instead.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from gradaccum.data.settings import DEFAULT_SPLIT
from gradaccum.data.sft.examples import (
    IGNORE_INDEX,
    Example,
    fit_to_length,
    make_example,
    tokenize_item,
)
from gradaccum.data.sft.rows import (
    BadRow,
    Chat,
    Row,
    detect_format,
    parse_row,
    read_rows,
    source_name,
)
from gradaccum.data.tokenizers import require_chat_template
from gradaccum.utils.errors import BadInput

__all__ = ["LengthSummary", "Quantiles", "SFTData", "load_sft", "quantiles", "tokenize_rows"]

KEPT_REASONS = 3
"""Bad rows whose reason is kept for the start-of-run print when they are skipped."""


@dataclass(frozen=True)
class Quantiles:
    """Order statistics of a list of counts, by nearest rank: the p-quantile of n sorted
    values is the ceil(p * n)-th smallest (an actual value, no interpolation)."""

    median: int
    p90: int
    p99: int
    max: int


def quantiles(values) -> Quantiles:
    """Median, p90, p99 and max of `values` (nearest rank); all 0 for no values."""
    ordered = sorted(int(v) for v in values)
    if not ordered:
        return Quantiles(0, 0, 0, 0)

    def at(p: float) -> int:
        return ordered[max(1, math.ceil(p * len(ordered))) - 1]

    return Quantiles(at(0.5), at(0.9), at(0.99), ordered[-1])


@dataclass(frozen=True)
class LengthSummary:
    """How long the examples are, in tokens."""

    examples: int
    tokens: Quantiles
    """Tokens per example (prompt and completion)."""
    targets: Quantiles
    """Target tokens per example (what the loss counts)."""

    @classmethod
    def of(cls, examples: list[Example]) -> LengthSummary:
        return cls(
            len(examples),
            quantiles(e.length for e in examples),
            quantiles(e.num_targets for e in examples),
        )


@dataclass
class SFTData:
    """Tokenized SFT examples and what happened on the way (every count in examples/rows)."""

    examples: list[Example]
    source: str
    """Where the rows came from: the --data value, or the built-in set's name."""
    data_format: str
    """The format used: detected, or forced by --data-format."""
    seq_len: int
    """Most tokens an example holds."""
    rows: int
    """Rows in the source, bad ones included."""
    bad_rows: int = 0
    """Rows skipped as bad (only with skip_bad_rows; otherwise the first one raises)."""
    bad_reasons: list[str] = field(default_factory=list)
    """The first few skipped rows' one-line reasons."""
    truncated: int = 0
    """Examples cut to seq_len (kept)."""
    dropped_long: int = 0
    """Examples longer than seq_len dropped (drop_long)."""
    dropped_no_target: int = 0
    """Examples dropped because their prompt alone fills seq_len."""

    def lengths(self) -> LengthSummary:
        return LengthSummary.of(self.examples)

    def to_dict(self) -> dict:
        """Counts and lengths (no examples), for --json and metrics."""
        out = {k: v for k, v in asdict(self).items() if k != "examples"}
        out["examples"] = len(self.examples)
        out["lengths"] = asdict(self.lengths())
        return out

    def summary_lines(self) -> list[str]:
        """The start-of-run print: what was read and kept, and the length distribution."""
        s = self.lengths()
        lines = [
            f"data: {self.source} ({self.data_format}): {self.rows} rows, "
            f"{len(self.examples)} examples, seq_len {self.seq_len}"
        ]
        if self.bad_rows:
            lines.append(f"  skipped {self.bad_rows} bad rows, e.g. {self.bad_reasons[0]}")
        if self.truncated or self.dropped_long or self.dropped_no_target:
            lines.append(
                f"  longer than {self.seq_len} tokens: {self.truncated} truncated, "
                f"{self.dropped_long} dropped, {self.dropped_no_target} dropped with no "
                "completion token left"
            )
        for name, q in (("tokens", s.tokens), ("targets", s.targets)):
            lines.append(
                f"  {name} per example: median {q.median}, p90 {q.p90}, p99 {q.p99}, max {q.max}"
            )
        return lines


def load_sft(
    spec: str, tokenizer, split: str = DEFAULT_SPLIT, task: str = "sft", **options
) -> SFTData:
    """Read `--data spec` (`split`: --data-split; `task`: the --task reading it, named in its
    refusals) and tokenize it: `tokenize_rows(read_rows(spec, split, task), ...)`."""
    rows = read_rows(spec, split, task)
    return tokenize_rows(rows, tokenizer, source=source_name(spec, split), **options)


def tokenize_rows(
    rows: list[Row],
    tokenizer,
    *,
    seq_len: int,
    source: str,
    data_format: str = "auto",
    train_on_prompt: bool = False,
    drop_long: bool = False,
    skip_bad_rows: bool = False,
) -> SFTData:
    """Examples of `rows` for `tokenizer` (sft_rows.Row, e.g. from `read_rows` or
    `rows_from_dicts`).

    seq_len: most tokens per example (prompt and completion), at least 2.
    data_format: "auto" (from the first row's fields) or a format of sft_rows.FORMATS.
    train_on_prompt: every token a target, not only the completion's.
    drop_long: drop examples longer than seq_len instead of cutting them.
    skip_bad_rows: skip and count bad rows instead of raising on the first.
    Raises BadInput: a bad row (one line: "--data WHERE: field 'x': why"), messages with a
    tokenizer without a chat template, a template that is not prefix-preserving, nothing
    left to train on.
    """
    if seq_len < 2:
        raise BadInput(f"--seq-len {seq_len}: an SFT example needs at least 2 tokens")
    fmt = detect_format(rows, data_format, source)
    data = SFTData([], source, fmt, seq_len, len(rows))
    if fmt == "messages":  # refused before any row, not as each row's fault
        require_chat_template(tokenizer)
    checked_template = fmt == "messages"
    # (prompt tokens, the --seq-len keeping it) of each example dropped whose prompt alone
    # fills seq_len: a prompt and one completion token, or under drop_long the whole example
    long_prompts = []
    for row in rows:
        try:
            item = parse_row(row, fmt)
            if isinstance(item, Chat) and not checked_template:
                require_chat_template(tokenizer)
                checked_template = True
            ids, labels = tokenize_item(item, tokenizer, train_on_prompt, row.where)
        except BadRow as err:
            line = f"--data {row.where}: {err}"
            if not skip_bad_rows:
                raise BadInput(line) from None
            data.bad_rows += 1
            if len(data.bad_reasons) < KEPT_REASONS:
                data.bad_reasons.append(line)
            continue
        if not _keep(data, ids, labels, row.index, drop_long):
            prompt = _prompt_tokens(labels)
            if prompt >= seq_len:
                long_prompts.append((prompt, len(ids) if drop_long else prompt + 1))
    if not data.examples and long_prompts and len(long_prompts) == len(rows) - data.bad_rows:
        raise BadInput(_prompts_too_long(data, long_prompts))
    if not data.examples:
        raise BadInput(
            f"--data {source}: no example left to train on ({data.bad_rows} bad rows skipped, "
            f"{data.dropped_long + data.dropped_no_target} longer than --seq-len {seq_len} "
            "dropped)"
        )
    return data


def _keep(data: SFTData, ids, labels, index: int, drop_long: bool) -> bool:
    """Add the example of (ids, labels), cut to seq_len, or count it dropped; whether kept."""
    ids, labels, status = fit_to_length(ids, labels, data.seq_len, drop_long)
    if status == "long":
        data.dropped_long += 1
    elif status == "no_target":
        data.dropped_no_target += 1
    else:
        data.truncated += status == "truncated"
        data.examples.append(make_example(ids, labels, index, status == "truncated"))
    return ids is not None


def _prompt_tokens(labels) -> int:
    """Tokens before the first target: the prompt's (its template included)."""
    return next((i for i, label in enumerate(labels) if label != IGNORE_INDEX), len(labels))


def _prompts_too_long(data: SFTData, long_prompts: list[tuple[int, int]]) -> str:
    """Why no example is left when each one's prompt alone is longer than seq_len
    (`long_prompts`: each one's prompt tokens and the --seq-len that keeps it), and the
    --seq-len that keeps them all."""
    whose = "the Alpaca template's prompt" if data.data_format == "alpaca" else "the prompt"
    q = quantiles(prompt for prompt, _ in long_prompts)
    keeps = max(need for _, need in long_prompts)
    skipped = f" ({data.bad_rows} bad rows skipped)" if data.bad_rows else ""
    return (
        f"--data {data.source}: no example left to train on{skipped}: {whose} alone is longer "
        f"than --seq-len {data.seq_len} in all {len(long_prompts)} examples (median "
        f"{q.median}, max {q.max} tokens); --seq-len {keeps} or more keeps them"
    )
