"""Every Python process the suite starts takes what its own process takes (tests/conftest.py puts
this folder on PYTHONPATH): connections off this machine refused (tests/network.py) and
bitsandbytes' 4-bit layers on their AVX512-BF16 path whatever the CPU (tests/avx512bf16.py).
Both modules are loaded by their file, so the process's sys.path stays its own."""

import importlib.util
import os

_TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(name: str):
    spec = importlib.util.spec_from_file_location(
        f"_suite_{name}", os.path.join(_TESTS, f"{name}.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_load("network").refuse()
_load("avx512bf16").install()
