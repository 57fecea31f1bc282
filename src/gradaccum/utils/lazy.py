"""A package's public names imported on first use (PEP 562), so that importing one of its
torch-free modules (its settings) does not import torch."""

from __future__ import annotations

import importlib
from collections.abc import Callable


def lazy_exports(package: str, exports: dict[str, str]) -> Callable[[str], object]:
    """A module `__getattr__` giving `name` from `exports[name]` (a module under `package`, or
    a whole dotted module name), or the submodule `name` of `package`."""

    def __getattr__(name: str):
        if name in exports:
            module = exports[name]
            full = module if module.startswith("gradaccum.") else f"{package}.{module}"
            return getattr(importlib.import_module(full), name)
        try:
            return importlib.import_module(f"{package}.{name}")
        except ModuleNotFoundError:
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None

    return __getattr__
