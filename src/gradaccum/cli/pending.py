"""Commands that come in later issues: they say so in one line and exit 2."""

from __future__ import annotations

import argparse

from ..errors import BadInput

_WHAT = {
    "plan": "plan a run",
    "train": "train a causal LM",
    "fit": "find the micro-batch that fits and keep the global batch",
    "verify": "prove accumulated gradients equal the big-batch gradient on your model",
    "bench": "the engine against a hand-written loop and its peers, side by side",
}


def add_parser(sub, name: str) -> None:
    p = sub.add_parser(name, help=f"{_WHAT[name]} (not available yet)")
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(run=lambda args, name=name: _not_yet(name))


def _not_yet(name: str) -> int:
    raise BadInput(f"'gradaccum {name}' is not available in this version yet")
