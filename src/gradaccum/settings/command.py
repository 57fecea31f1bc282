"""A command's settings: the components it takes (`Command`), its parser generated from them
(`add_command`, the only place flags are added), and the values a run is given (`given`,
`namespace`).

Each flag is a field of one component; a command that takes a field takes that field, so a
flag shared by several commands is defined once. --help shows a heading per component, each
field's docstring, and its default, from the field or the command's per-task table.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable, Iterable
from dataclasses import MISSING, Field, dataclass, field, fields

from gradaccum.settings.docs import field_docs, title
from gradaccum.settings.field import Flag, flag_of, read_value
from gradaccum.settings.files import from_file, read_config
from gradaccum.utils.errors import BadInput, flag_name

CONFIG_HELP = (
    "a YAML, TOML or JSON file of these settings: the flag names as keys (with - or _), flat "
    "or under each group's name; the command line wins. A run folder's config.yaml is one"
)


@dataclass(frozen=True)
class Part:
    """One component of a command: its class and the fields the command takes (all that the
    class itself declares when `names` is None)."""

    component: type
    names: tuple[str, ...] | None = None

    def fields(self) -> list[Field]:
        own = self.component.__dict__.get("__annotations__", {})
        chosen = self.names if self.names is not None else tuple(own)
        by_name = {f.name: f for f in fields(self.component)}
        return [by_name[name] for name in chosen]


def part(component: type, *names: str) -> Part:
    return Part(component, names or None)


@dataclass(frozen=True)
class Command:
    """A command: its words, its components, how it runs and its defaults."""

    name: str
    help: str
    description: str
    parts: tuple[Part, ...]
    run: str
    """The module under gradaccum.cli whose run(args) runs it, imported only then."""
    epilog: str = ""
    defaults: dict = field(default_factory=dict)
    """This command's own default of a field, where it is not the field's (None: the command
    has none to state, it leaves the field unset)."""
    task_defaults: dict = field(default_factory=dict)
    """{task: {field: default}}: defaults that depend on --task, the first task's the
    default's default."""
    notes: dict = field(default_factory=dict)
    """{field: a sentence its help adds in this command}: a limit of the command's own."""
    exclusive: tuple[tuple[str, ...], ...] = ()
    """Groups of fields of which a run takes at most one: the upper layer (the command line
    over a config file) replaces the lower layer's whole group."""

    def fields(self) -> dict[str, tuple[type, Field]]:
        """{name: (its component, its Field)} in the order of the parts."""
        return {f.name: (p.component, f) for p in self.parts for f in p.fields()}

    def default(self, name: str, task: str | None = None):
        """The default of field `name` here, for `task` when it has one of its own."""
        if task is not None and name in self.task_defaults.get(task, {}):
            return self.task_defaults[task][name]
        if name in self.defaults:
            return self.defaults[name]
        f = self.fields()[name][1]
        return None if f.default is MISSING else f.default

    def help_of(self, name: str) -> str:
        component, f = self.fields()[name]
        doc = " ".join([field_docs(component).get(name, ""), self.notes.get(name, "")]).strip()
        said = self.default_text(name, flag_of(f))
        return (doc + (f" ({said})" if said else "")).replace("%", "%%")

    def default_text(self, name: str, spec: Flag) -> str:
        if spec.kind == "bool" or spec.bare is not None or self.defaults.get(name, 0) is None:
            return ""
        tasks = list(self.task_defaults)
        first = self.default(name, tasks[0] if tasks else None)
        if first is None and spec.default_text is None:
            per_task = [
                f"--task {t} {_shown(self.default(name, t))}"
                for t in tasks[1:]
                if self.default(name, t) is not None
            ]
            return "; ".join(per_task)
        words = [f"default {_shown(first) if first is not None else spec.default_text}"]
        for task in tasks[1:]:
            value = self.default(name, task)
            if value != first and value is not None:
                words.append(f"--task {task} {_shown(value)}")
        return "; ".join(words)


def _shown(value) -> str:
    return format(value, "g") if isinstance(value, float) else str(value)


def add_command(sub, command: Command) -> argparse.ArgumentParser:
    """The command's parser: a group per component, a flag per field, and --config."""
    p = sub.add_parser(
        command.name,
        help=command.help,
        description=command.description,
        epilog=command.epilog or None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    groups: dict[type, argparse._ArgumentGroup] = {}
    for name, (component, f) in command.fields().items():
        if component not in groups:
            groups[component] = p.add_argument_group(title(component))
        spec = flag_of(f)
        names = [flag_name(name), *spec.aliases]
        kw = {"dest": name, "default": argparse.SUPPRESS, "help": command.help_of(name)}
        if spec.kind == "bool":
            groups[component].add_argument(*names, action="store_true", **kw)
        elif spec.bare is not None:  # `--resume` alone or `--resume auto`
            groups[component].add_argument(
                *names, metavar=spec.metavar, nargs="?", const=spec.bare, **kw
            )
        else:
            groups[component].add_argument(*names, metavar=spec.metavar, **kw)
    p.add_argument_group("settings file").add_argument(
        "--config", dest="config_file", metavar="FILE", default=None, help=CONFIG_HELP
    )
    p.set_defaults(run=run_of(command.run), command_spec=command)
    return p


def run_of(module: str) -> Callable[[argparse.Namespace], int]:
    """A command's `run(args)`, from `gradaccum.cli.<module>` imported only when it runs:
    building the parsers imports no torch, so `gradaccum plan` starts without it."""

    def run(args: argparse.Namespace) -> int:
        namespace(args, fill=False)  # every value given read, a bad one refused, before torch
        return importlib.import_module(f"gradaccum.cli.{module}").run(args)

    return run


def merge(lower: dict, upper: dict, exclusive: Iterable[tuple[str, ...]] = ()) -> dict:
    """`upper` over `lower`, where a field `upper` gives also replaces the fields of its
    exclusive group in `lower` (`--max-tokens` on the command line over a file's max_steps)."""
    lower = dict(lower)
    for group in exclusive:
        if any(upper.get(name) is not None for name in group):
            for name in group:
                lower.pop(name, None)
    return {**lower, **upper}


def given(args: argparse.Namespace) -> dict:
    """What this invocation asks, by field name, untyped: the --config file under the command
    line. Nothing here fills a default."""
    command: Command = args.command_spec
    known = command.fields()
    from_file, keys = {}, {}
    if args.config_file:
        from_file, keys = read_config(args.config_file, known, _sections(command))
    on_line = {k: v for k, v in vars(args).items() if k in known}
    values = merge(from_file, on_line, command.exclusive)
    # What still comes from the file, for `in_config_file` to name its key.
    args.config_keys = {n: k for n, k in keys.items() if n not in on_line and n in values}
    return values


def in_config_file(err: BadInput, args: argparse.Namespace | None) -> BadInput:
    """`err`, naming the --config file and key when its flag's value came from there."""
    keys = getattr(args, "config_keys", None)
    return from_file(err, args.config_file, keys) if keys else err


def _sections(command: Command) -> dict[str, tuple[str, ...]]:
    """{a component's section name in a config file: its fields here}."""
    sections: dict[str, list[str]] = {}
    for name, (component, _) in command.fields().items():
        sections.setdefault(section_name(component), []).append(name)
    return {k: tuple(v) for k, v in sections.items()}


def section_name(component: type) -> str:
    """A component's key in a config file: its `SECTION`, or its class name less Settings."""
    explicit = getattr(component, "SECTION", None)
    return explicit or component.__name__.removesuffix("Settings").lower()


def namespace(args: argparse.Namespace, fill: bool = True) -> argparse.Namespace:
    """Every field of the command, read and checked (BadInput naming the flag), with the
    defaults filled in (per --task where the command has a table), or None where not given
    when not `fill`: what a command's run reads."""
    command: Command = args.command_spec
    values = given(args)
    task = values.get("task", command.default("task") if "task" in command.fields() else None)
    out = argparse.Namespace()
    for name, (_, f) in command.fields().items():
        value = values.get(name, command.default(name, task) if fill else None)
        setattr(out, name, None if value is None else read_value(name, flag_of(f), value, value))
    return out


def build_program(prog: str, description: str, version: str, commands, parser_class):
    """The program's parser: --version and a subcommand per Command."""
    parser = parser_class(prog=prog, description=description)
    parser.add_argument("--version", action="version", version=f"{prog} {version}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=parser_class)
    for command in commands:
        add_command(sub, command)
    return parser
