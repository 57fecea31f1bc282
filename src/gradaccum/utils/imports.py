"""A user's object named on the command line, "module:attr" or "path/file.py:attr" (--reward's
functions, --task's class): imported from the working folder first, as `python -m` would, or
run from its file; a one-line BadInput naming the flag when it cannot be."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

from gradaccum.utils.errors import BadInput, first_line


def load_module(flag: str, name: str, where: str):
    """The module `where` of `name` (the flag's value): a FILE.py run as a module, or a
    module imported with the working folder first on the path."""
    if where.endswith(".py"):
        return _load_file(flag, name, where)
    return _load_module(flag, name, where)


def _load_module(flag: str, name: str, module: str):
    """Import `module`, the working directory first on the path (as `python -m` puts it);
    the path is as it was afterwards."""
    saved = list(sys.path)
    sys.path.insert(0, os.getcwd())
    importlib.invalidate_caches()
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name is not None and (module == err.name or module.startswith(err.name + ".")):
            raise BadInput(flag, name, first_line(err)) from None
        raise BadInput(flag, name, _raised_on_import(module, err)) from None
    except Exception as err:  # the module's own code failed
        raise BadInput(flag, name, _raised_on_import(module, err)) from None
    finally:
        sys.path[:] = saved


def _load_file(flag: str, name: str, path: str):
    """Run the Python file at `path` as a module named after it (its folder first on the
    path, as `python path` would, for its own imports)."""
    if not os.path.isfile(path):
        raise BadInput(flag, name, f"no file {path}")
    module_name = os.path.splitext(os.path.basename(path))[0]
    file_spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(file_spec)
    # Registered, as an import would, so that its dataclasses and pickling find it; a name
    # already taken (a file called json.py) is left to its owner.
    registered = module_name not in sys.modules
    if registered:
        sys.modules[module_name] = module
    saved = list(sys.path)
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    try:
        file_spec.loader.exec_module(module)
    except Exception as err:
        if registered:
            del sys.modules[module_name]
        raise BadInput(flag, name, _raised_on_import(path, err)) from None
    finally:
        sys.path[:] = saved
    return module


def _raised_on_import(where: str, err: Exception) -> str:
    return f"importing {where} raised {type(err).__name__}: {first_line(err)}"
