"""`--config FILE`: settings from a YAML, TOML or JSON file, and the resolved settings of a run
written back as YAML (`RUN/config.yaml`, which `--config` takes as it is).

Keys are flag names, with - or _, either flat or under a section per component (`model:`,
`batch:`, ...: the sections `config.yaml` is written with). A key the command does not take
is refused, every one named.
"""

from __future__ import annotations

import json
import os

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

import yaml

from gradaccum.utils.errors import BadInput, first_line

KINDS = {".yaml": "YAML", ".yml": "YAML", ".toml": "TOML", ".json": "JSON"}


def read_config(
    path: str, known, sections: dict[str, tuple[str, ...]]
) -> tuple[dict, dict[str, str]]:
    """The settings a file sets, by field name (flat keys or a section per component), and
    the key each was written under ("batch.micro_batch", "lr"): a bad value is named by it."""
    data = _load(path)
    values, keys, unknown = {}, {}, []
    for key, value in data.items():
        name = key.replace("-", "_")
        if name in sections and isinstance(value, dict):  # a component's section
            for inner, inner_value in value.items():
                inner_name = inner.replace("-", "_")
                if inner_name in known:
                    values[inner_name], keys[inner_name] = inner_value, f"{key}.{inner}"
                else:
                    unknown.append(f"{key}.{inner}")
        elif name in known:
            values[name], keys[name] = value, key
        else:
            unknown.append(key)
    if unknown:
        s = "s" if len(unknown) > 1 else ""
        raise BadInput("--config", path, f"unknown key{s} {', '.join(sorted(unknown))}")
    return values, keys


def from_file(err: BadInput, path: str, keys: dict[str, str]) -> BadInput:
    """`err` with the file and key it came from in front when the flag it names took its
    value from the config file at `path` (`keys`: field name -> key), else `err` itself."""
    name = (err.flag or "").removeprefix("--").replace("-", "_")
    if name not in keys:
        return err
    return BadInput(f"--config {path}, key {keys[name]}: {err}")


def _load(path: str) -> dict:
    kind = KINDS.get(os.path.splitext(path)[1].lower(), "TOML")
    try:
        with open(path, "rb") as f:
            raw = f.read()
        text = raw.decode("utf-8")
    except FileNotFoundError:
        raise BadInput("--config", path, "no such file") from None
    except IsADirectoryError:
        raise BadInput(
            "--config", path, "is a folder, expected a YAML, TOML or JSON file"
        ) from None
    except UnicodeDecodeError:
        raise BadInput("--config", path, f"not UTF-8 text, expected a {kind} file") from None
    except OSError as err:
        raise BadInput("--config", path, f"not readable ({first_line(err)})") from None
    try:
        if kind == "YAML":
            data = yaml.safe_load(text)
        elif kind == "JSON":
            data = json.loads(text)
        else:
            data = tomllib.loads(text)
    except (yaml.YAMLError, json.JSONDecodeError, tomllib.TOMLDecodeError) as err:
        why = " ".join(first_line(err).split())
        raise BadInput("--config", path, f"not a readable {kind} file ({why})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise BadInput("--config", path, f"expected keys and values, got a {type(data).__name__}")
    return data


def to_yaml(
    sections: dict[str, dict], header: str = "", comments: dict[str, str] | None = None
) -> str:
    """YAML of settings by section (None values left out), with `header` as comment lines
    and `comments` (field name -> text) at the end of their fields' lines: words for a reader
    that do not change what the file sets."""
    body = {k: {n: v for n, v in d.items() if v is not None} for k, d in sections.items()}
    body = {k: d for k, d in body.items() if d}
    lines = [f"# {line}".rstrip() for line in header.splitlines()]
    text = yaml.safe_dump(body, sort_keys=False, default_flow_style=False, allow_unicode=True)
    text = "".join(_commented(line, comments or {}) for line in text.splitlines(keepends=True))
    return "\n".join([*lines, text]) if lines else text


def _commented(line: str, comments: dict[str, str]) -> str:
    """`line` ("  micro_batch: auto\\n"), its field's comment added where it has one."""
    name = line.strip().split(":", 1)[0]
    if line.startswith("  ") and name in comments:
        return f"{line.rstrip()}  # {comments[name]}\n"
    return line
