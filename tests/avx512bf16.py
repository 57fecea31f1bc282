"""bitsandbytes' AVX512-BF16 path, taken on every CPU the suite runs on.

On a CPU with AVX512-BF16 (an Intel Xeon of the last generations) bitsandbytes >= 0.49 makes
each `Linear4bit` repack its weight into a CPU inference layout the first time it runs in eval
mode without grad, and registers a fused bf16 kernel for that layout; its import also asks the
Hugging Face kernel hub for a faster one. Without the feature (an AMD EPYC) none of that
happens, so a suite green there said nothing of the other machine.

`install()` forces the layers' switch: every `Linear4bit` made in this process from then on
believes the CPU has the feature (`bitsandbytes.nn.modules.has_avx512bf16` answers True). A
layer left to bitsandbytes then repacks itself in eval mode and computes through `gemv_4bit`:
the fused kernel where the CPU has it, bitsandbytes' default kernel on the repacked bytes
elsewhere; training after it is wrong either way, which is what the QLoRA tests would see on
the Intel machine. conftest.py installs it for the whole suite.

`install(kernels=True)`, for a process of its own: the detection itself answers True
(`bitsandbytes.functional.has_avx512bf16`), so the import registers the fused kernel and makes
its kernel hub lookup, as on the Intel machine. The fused kernel runs AVX512 instructions: on a
CPU without them a call to it stops the process (SIGILL), so only a process that must never
call it (the kernel hub test) takes this.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

LAYERS = "bitsandbytes.nn.modules"
DETECTION = "bitsandbytes.functional"


def _says_yes() -> bool:
    return True


class _Forced(importlib.abc.MetaPathFinder):
    """Finds `module` as usual and sets its `has_avx512bf16` to `_says_yes` once it ran."""

    def __init__(self, module: str):
        self.module = module

    def find_spec(self, name, path, target=None):
        if name != self.module:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            module.has_avx512bf16 = _says_yes

        spec.loader.exec_module = exec_module
        return spec


def install(kernels: bool = False) -> None:
    """Force the AVX512-BF16 path from now on in this process (see the module's text)."""
    module = DETECTION if kernels else LAYERS
    if module in sys.modules:
        if kernels:
            raise RuntimeError("install(kernels=True) must come before bitsandbytes' import")
        sys.modules[module].has_avx512bf16 = _says_yes  # read when each layer is made
        return
    sys.meta_path.insert(0, _Forced(module))
