"""SFT rows: read from a file or the local datasets cache, and what each one asks to learn.

Sources (`read_rows(spec)`, `--data spec`):
- `PATH.jsonl`: one JSON object per line; blank lines are skipped; a row is named by its
  line, from 1 ("sft.jsonl line 7");
- `PATH.json`: a list of objects, or an object holding that list under "data" or "train"
  (the two wrappers data sets are commonly published in); a row is named by its index in
  the list, from 0 ("sft.json row 6", as `rows[6]`);
- `PATH.parquet`: read with pyarrow (or pandas when pyarrow is missing); rows from 0;
- `FOLDER` written by `datasets`' `save_to_disk`: a `Dataset`'s rows, or those of the split
  `split` (--data-split) of a `DatasetDict`; rows from 0 ("sft_dd/test row 6" for a split,
  the split's own subfolder);
- `hf:NAME[:SPLIT]`: a save_to_disk folder NAME as above (SPLIT, else `split`), or
  `datasets.load_dataset(NAME, split=SPLIT or split)` from the local cache only (offline,
  never the network; `gradaccum.data.hf_datasets`); rows from 0.
`.txt`, `.bin` and `.npy` hold text or tokens for pretraining and are refused; so is a folder
that save_to_disk did not write. Every command that reads SFT rows (train, verify) reads them
here, so each takes every source.

Formats (`detect_format`, or forced by `--data-format`), from the first readable row's fields:
- `messages`: {"messages": [{"role": ..., "content": ...}, ...]}, roles system, user,
  assistant, tool; every assistant turn is learned, rendered with the chat template;
- `prompt-completion`: {"prompt": str, "completion": str}, or both lists of messages (TRL's
  conversational prompt-completion: the prompt's turns are context, the completion's
  assistant turns are learned);
- `alpaca`: {"instruction": str, "input": str (optional, may be empty or null),
  "output": str}: the prompt is Alpaca's own text (`alpaca_prompt`), the output is learned.
`parse_row` turns a row into a `TextPair` or a `Chat`, or raises `BadRow` naming the field.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np

from gradaccum.data.hf_datasets import folder_problem, load_hf_dataset, load_saved, saved_kind
from gradaccum.data.settings import DEFAULT_SPLIT, SOURCES
from gradaccum.utils.errors import BadInput, first_line

__all__ = [
    "FORMATS",
    "ROLES",
    "BadRow",
    "Chat",
    "Row",
    "TextPair",
    "alpaca_prompt",
    "detect_format",
    "parse_row",
    "read_rows",
    "rows_from_dicts",
    "source_name",
]

FORMATS = ("auto", "prompt-completion", "messages", "alpaca")
"""Values of --data-format; "auto" detects the format from the first row's fields."""
ROLES = ("system", "user", "assistant", "tool")
"""Roles a message may have."""
SFT_SUFFIXES = (".jsonl", ".json", ".parquet")
PRETRAINING_SUFFIXES = (".txt", ".bin", ".npy")

ALPACA_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further "
    "context. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
ALPACA_NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately "
    "completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n"
)


@dataclass(frozen=True)
class Row:
    """One row of a source, readable or not."""

    where: str
    """The row in words for error lines: "sft.jsonl line 7", "sft.json row 6"."""
    index: int
    """Its position among the source's rows, from 0 (blank lines of a .jsonl not counted)."""
    fields: object
    """The row's value (a dict when it is a JSON object); None when it could not be read."""
    error: str | None = None
    """Why the row could not be read (a malformed JSON line), else None."""


@dataclass(frozen=True)
class TextPair:
    """A prompt and the completion to learn after it, both text."""

    prompt: str
    completion: str


@dataclass(frozen=True)
class Chat:
    """A conversation; its assistant turns at index >= first_target are learned."""

    messages: tuple
    first_target: int = 0


class BadRow(ValueError):
    """A row that cannot be used; str() is "field 'x': why" (the row is named by the caller)."""


def alpaca_prompt(instruction: str, input_text: str = "") -> str:
    """The Alpaca prompt (Stanford Alpaca's two templates, with and without an input)."""
    if input_text:
        return ALPACA_WITH_INPUT.format(instruction=instruction, input=input_text)
    return ALPACA_NO_INPUT.format(instruction=instruction)


# ---- reading ------------------------------------------------------------------------------


def read_rows(spec: str, split: str = DEFAULT_SPLIT, task: str = "sft") -> list[Row]:
    """The rows of `--data spec` (see the module docstring); `split`: --data-split, the split
    of a DatasetDict (a save_to_disk folder, or hf:NAME naming none); `task`: the --task
    reading them (sft, or grpo for its prompts), named in the refusals. Raises BadInput for a
    source that cannot be read at all (no such file, pretraining data, not JSON, a missing
    split, no rows); a row that cannot be read (a malformed .jsonl line) comes back with
    `error` set."""
    flag = f"--data {spec}"
    if spec.startswith("hf:"):
        rows = _read_hf(spec, split)
    elif os.path.isdir(spec):
        rows = _read_saved(spec, split, task)
    else:
        ext = os.path.splitext(spec)[1].lower()
        if ext in PRETRAINING_SUFFIXES:
            raise BadInput(
                f"{flag}: a {ext} file is text or tokens for pretraining; --task {task} reads "
                f"{SOURCES['sft']}"
            )
        if ext not in SFT_SUFFIXES:
            raise BadInput(f"{flag}: unknown format for --task {task}; expected {SOURCES['sft']}")
        if not os.path.isfile(spec):
            raise BadInput(f"{flag}: no such file")
        read = {".jsonl": _read_jsonl, ".json": _read_json, ".parquet": _read_parquet}[ext]
        rows = read(spec)
    if not rows:
        raise BadInput(f"{flag}: no rows")
    return rows


def rows_from_dicts(items, source: str) -> list[Row]:
    """Rows made from dicts in memory (the built-in task set), named "SOURCE row i"."""
    return [Row(f"{source} row {i}", i, item) for i, item in enumerate(items)]


def _read_jsonl(path: str) -> list[Row]:
    rows = []
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            where = f"{path} line {number}"
            try:
                fields = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as err:
                rows.append(Row(where, len(rows), None, f"not UTF-8 text ({err.reason})"))
                continue
            except json.JSONDecodeError as err:
                rows.append(
                    Row(where, len(rows), None, f"malformed JSON ({err.msg} at column {err.colno})")
                )
                continue
            rows.append(Row(where, len(rows), fields))
    return rows


def _read_json(path: str) -> list[Row]:
    flag = f"--data {path}"
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except UnicodeDecodeError as err:
        raise BadInput(f"{flag}: not UTF-8 text ({err.reason})") from None
    except json.JSONDecodeError as err:
        raise BadInput(
            f"{flag}: not valid JSON ({err.msg} at line {err.lineno} column {err.colno})"
        ) from None
    if isinstance(data, dict):
        key = next((k for k in ("data", "train") if isinstance(data.get(k), list)), None)
        if key is None:
            raise BadInput(
                f"{flag}: a .json file must hold a list of rows, or an object with the list "
                f'under "data" or "train" (keys: {", ".join(map(str, data)) or "none"})'
            )
        data = data[key]
    if not isinstance(data, list):
        raise BadInput(f"{flag}: a .json file must hold a list of rows, not {_a_kind(data)}")
    return [Row(f"{path} row {i}", i, item) for i, item in enumerate(data)]


def _read_parquet(path: str) -> list[Row]:
    flag = f"--data {path}"
    try:
        import pyarrow.parquet as pq
    except ImportError:
        pq = None
    try:
        if pq is not None:
            items = pq.read_table(path).to_pylist()
        else:
            import pandas

            items = [_plain(r) for r in pandas.read_parquet(path).to_dict("records")]
    except ImportError:
        raise BadInput(f"{flag}: reading .parquet needs pyarrow (pip install pyarrow)") from None
    except Exception as err:  # pyarrow and pandas raise many kinds for a bad file
        raise BadInput(f"{flag}: not a readable parquet file ({first_line(err)})") from None
    return [Row(f"{path} row {i}", i, item) for i, item in enumerate(items)]


def _plain(value):
    """pandas' numpy arrays (list columns) as lists, recursively."""
    if isinstance(value, np.ndarray):
        return [_plain(v) for v in value.tolist()]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def source_name(spec: str, split: str = DEFAULT_SPLIT) -> str:
    """`--data spec` in words, with the split read where the spec does not name it (its rows
    are "NAME row i"): "hf:owner/set:train", "sft_dd/test" (a DatasetDict's split is its
    subfolder); a file or a single Dataset is `spec` itself."""
    if spec.startswith("hf:"):
        name = spec[3:]
        names_split = ":" in name and not os.path.isdir(name)
        return spec if names_split or saved_kind(name) == "dataset" else f"{spec}:{split}"
    return os.path.join(spec, split) if saved_kind(spec) == "dataset_dict" else spec


def _read_hf(spec: str, split: str) -> list[Row]:
    ds = load_hf_dataset(spec, split)
    where = source_name(spec, split)
    return [Row(f"{where} row {i}", i, item) for i, item in enumerate(ds)]


def _read_saved(folder: str, split: str, task: str) -> list[Row]:
    """A save_to_disk folder's rows: a Dataset's, or split `split` of a DatasetDict's."""
    problem = folder_problem(folder, task, reads_rows=True)
    if problem is not None:
        raise BadInput(problem)
    ds = load_saved(folder, split, f"--data {folder}")
    where = source_name(folder, split)
    return [Row(f"{where} row {i}", i, item) for i, item in enumerate(ds)]


# ---- formats ------------------------------------------------------------------------------


def detect_format(rows: list[Row], data_format: str, spec: str) -> str:
    """The format of `rows`: `data_format` when forced, else from the fields of the first
    row that could be read. Raises BadInput when it cannot tell."""
    if data_format not in FORMATS:
        raise BadInput(f"--data-format {data_format}: expected {', '.join(FORMATS)}")
    if data_format != "auto":
        return data_format
    first = next((r for r in rows if r.error is None and isinstance(r.fields, dict)), None)
    if first is None and rows and rows[0].error is not None:  # the line itself, not its format
        raise BadInput(f"--data {rows[0].where}: {rows[0].error}")
    if first is None:
        raise BadInput(f"--data {spec}: no row is a JSON object, so its format cannot be told")
    keys = first.fields
    if "messages" in keys:
        return "messages"
    if "prompt" in keys and "completion" in keys:
        return "prompt-completion"
    if "instruction" in keys and "output" in keys:
        return "alpaca"
    found = ", ".join(map(str, keys)) or "none"
    raise BadInput(
        f"--data {spec}: cannot tell the format from the fields of {first.where} ({found}); "
        "expected 'messages', 'prompt' and 'completion', or 'instruction' and 'output' "
        "(--data-format forces one)"
    )


def parse_row(row: Row, data_format: str) -> TextPair | Chat:
    """What `row` asks to learn in `data_format` (not "auto"). Raises BadRow."""
    if row.error is not None:
        raise BadRow(row.error)
    if not isinstance(row.fields, dict):
        raise BadRow(f"not a JSON object but {_a_kind(row.fields)}")
    fields = row.fields
    if data_format == "messages":
        messages = _messages(fields, "messages")
        _need_assistant(messages, "messages")
        return Chat(messages, 0)
    if data_format == "alpaca":
        instruction = _string(fields, "instruction")
        input_text = _string(fields, "input", optional=True)
        output = _string(fields, "output", nonempty=True)
        return TextPair(alpaca_prompt(instruction, input_text), output)
    if data_format == "prompt-completion":
        if isinstance(fields.get("prompt"), list) or isinstance(fields.get("completion"), list):
            prompt = _messages(fields, "prompt", allow_empty=True)
            completion = _messages(fields, "completion")
            _need_assistant(completion, "completion")
            return Chat(prompt + completion, len(prompt))
        return TextPair(_string(fields, "prompt"), _string(fields, "completion", nonempty=True))
    raise ValueError(f"unknown data format {data_format!r}")


def _a_kind(value) -> str:
    """What a JSON value is, in the words of its file, with its article: "an integer",
    "a number", "a list", "null"."""
    names = {
        dict: "an object",
        list: "a list",
        str: "a string",
        bool: "true or false",
        int: "an integer",
        float: "a number",
        type(None): "null",
    }
    return names.get(type(value), f"a {type(value).__name__}")


def _string(
    fields: dict, name: str, optional: bool = False, nonempty: bool = False, at: str = ""
) -> str:
    """fields[name] as a string; `at` prefixes the field's name in errors ("messages[2].")."""
    value, label = fields.get(name), at + name
    if value is None:
        if optional:
            return ""
        raise BadRow(f"field '{label}': " + ("missing" if name not in fields else "null"))
    if not isinstance(value, str):
        raise BadRow(f"field '{label}': expected a string, got {_a_kind(value)}")
    if nonempty and not value:
        raise BadRow(f"field '{label}': empty")
    return value


def _messages(fields: dict, name: str, allow_empty: bool = False) -> tuple:
    value = fields.get(name)
    if value is None:
        raise BadRow(f"field '{name}': " + ("missing" if name not in fields else "null"))
    if not isinstance(value, list):
        raise BadRow(f"field '{name}': expected a list of messages, got {_a_kind(value)}")
    if not value and not allow_empty:
        raise BadRow(f"field '{name}': no messages")
    messages = []
    for i, message in enumerate(value):
        at = f"{name}[{i}]"
        if not isinstance(message, dict):
            raise BadRow(f"field '{at}': expected an object with role and content")
        role = _string(message, "role", at=at + ".")
        if role not in ROLES:
            raise BadRow(f"field '{at}.role': unknown role {role!r} (expected {', '.join(ROLES)})")
        content = _string(message, "content", nonempty=role == "assistant", at=at + ".")
        messages.append({**message, "role": role, "content": content})
    return tuple(messages)


def _need_assistant(messages: tuple, name: str) -> None:
    if not any(m["role"] == "assistant" for m in messages):
        raise BadRow(f"field '{name}': no assistant turn")
