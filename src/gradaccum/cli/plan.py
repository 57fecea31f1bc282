"""`gradaccum plan` (placeholder until its issue lands)."""

from .pending import _not_yet


def add_parser(sub, name: str) -> None:
    p = sub.add_parser(name, help="(not available yet)")
    p.set_defaults(run=lambda args: _not_yet(name))
