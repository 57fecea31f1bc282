"""The CLI reference (docs/cli.md), generated from the settings components: every command, a
table per component of its flags, defaults and descriptions.

    python -m gradaccum.cli.reference > docs/cli.md

A test fails when the committed page differs from what this prints.
"""

from __future__ import annotations

import importlib

from gradaccum.settings.command import Command, section_name
from gradaccum.settings.docs import field_docs, title
from gradaccum.settings.field import flag_of
from gradaccum.utils.errors import flag_name

HEADER = """# CLI reference

Generated from the settings components by `python -m gradaccum.cli.reference`; do not
edit by hand. Every command also takes `--config FILE` (YAML, TOML or JSON: the flag names
as keys, flat or under the section named beside each group; the command line wins) and
`--help`. Sizes take 4M = 4,000,000, 4Mi = 4,194,304, 262k, 7B; memory 80GB or 80GiB;
times 300ms, 1.5s.
"""


def render() -> str:
    from gradaccum.cli import COMMANDS

    parts = [HEADER]
    for module in COMMANDS.values():
        parts.append(_command(importlib.import_module(f"gradaccum.cli.{module}").COMMAND))
    return "\n".join(parts)


def _command(command: Command) -> str:
    lines = [
        f"## gradaccum {command.name}",
        "",
        command.help[0].upper() + command.help[1:] + ".",
        "",
    ]
    groups: dict[type, list[str]] = {}
    for name, (component, f) in command.fields().items():
        spec = flag_of(f)
        flag = ", ".join(f"`{n}`" for n in [flag_name(name), *spec.aliases])
        metavar = "" if spec.kind == "bool" else f" {spec.metavar}".replace("|", "\\|")
        if spec.bare is not None:  # the value may be left out: `--resume [auto]`
            metavar = f" [{metavar.strip()}]"
        default = command.default_text(name, spec).removeprefix("default ").replace("|", "\\|")
        doc = " ".join([field_docs(component).get(name, ""), command.notes.get(name, "")])
        doc = doc.strip().replace("|", "\\|")
        groups.setdefault(component, []).append(f"| {flag}{metavar} | {default} | {doc} |")
    for component, rows in groups.items():
        lines += [f"### {title(component)} (`{section_name(component)}:`)", ""]
        lines += ["| flag | default | what it is |", "| --- | --- | --- |", *rows, ""]
    return "\n".join(lines)


if __name__ == "__main__":
    print(render(), end="")
