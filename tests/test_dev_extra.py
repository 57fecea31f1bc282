"""Every package of the `dev` extra is installed where the suite runs: the tests that
`pytest.importorskip` one of them (so that a user without the extra can still run the rest)
then never skip in a dev install, and a missing install step fails here instead of hiding
as skips."""

import os
import re
from importlib import metadata

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _dev_extra() -> list[str]:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    return [re.split(r"[<>=!~;\[ ]", spec, maxsplit=1)[0] for spec in extras["dev"]]


@pytest.mark.parametrize("name", _dev_extra())
def test_the_dev_extra_is_installed(name):
    try:
        metadata.version(name)
    except metadata.PackageNotFoundError:
        pytest.fail(f"{name}, of the dev extra, is not installed: pip install -e '.[dev]'")
