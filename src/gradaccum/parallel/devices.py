"""One small module for everything device-specific: cuda, npu (torch_npu), xpu, mps, cpu.

No other module calls `.cuda()`, `torch.cuda.*` or `torch_npu` directly; they ask here.
"""

from __future__ import annotations

import importlib
from contextlib import nullcontext

import torch

from gradaccum.utils.choices import DEVICES
from gradaccum.utils.errors import BadInput

_KINDS = ("cuda", "npu", "xpu", "mps", "cpu")


def _npu_installed() -> bool:
    if not hasattr(torch, "npu"):
        try:  # torch_npu registers torch.npu on import
            importlib.import_module("torch_npu")
        except ImportError:
            return False
    return hasattr(torch, "npu")


def _npu_available() -> bool:
    return _npu_installed() and torch.npu.is_available()


def available(kind: str) -> bool:
    """Whether a device kind can be used in this process."""
    if kind == "cpu":
        return True
    if kind == "cuda":
        return torch.cuda.is_available()
    if kind == "npu":
        return _npu_available()
    if kind == "xpu":
        return hasattr(torch, "xpu") and torch.xpu.is_available()
    if kind == "mps":
        return torch.backends.mps.is_available()
    raise ValueError(f"unknown device kind {kind!r}; expected one of {', '.join(_KINDS)}")


def unavailable_reason(kind: str) -> str | None:
    """Why a known device kind cannot be used in this process, in a user's words; None when
    it can. Builds without the kind are told apart from machines without the device."""
    if available(kind):
        return None
    build = f"this PyTorch ({torch.__version__})"
    if kind == "cuda":
        if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
            return f"{build} is built without CUDA; install a CUDA build of torch"
        return "no CUDA device is visible (driver missing, or CUDA_VISIBLE_DEVICES empty?)"
    if kind == "npu":
        if not _npu_installed():
            return "torch_npu is not installed (Ascend NPUs need it: pip install torch-npu)"
        return "torch_npu finds no NPU on this machine"
    if kind == "xpu":
        return f"no Intel XPU is visible to {build}"
    if not torch.backends.mps.is_built():
        return f"{build} is built without MPS (Apple GPUs, macOS only)"
    return "MPS is not available on this machine"


def device_count(kind: str) -> int:
    """Devices of an available kind this process sees (1 for cpu and mps)."""
    if kind in ("cpu", "mps"):
        return 1
    return int(_module(kind).device_count())


def check_device(text, flag: str = "--device") -> None:
    """`text` names a device this process can use: auto, or cpu, cuda, npu, xpu, mps with an
    optional index below the count of that kind here. BadInput naming `flag` otherwise: an
    unknown name, `meta` (tensors without data: nothing can train there), a kind this build
    or machine lacks, or an index past the last device. The one check every command with
    --device runs before it touches the device."""
    if not isinstance(text, str) or not text.strip():
        raise BadInput(flag, repr(text), f"expected a device name: {DEVICES}")
    if text == "auto":
        return
    kind, colon, index = text.partition(":")
    if kind == "meta":
        why = "meta tensors hold no data, nothing can train on them"
        raise BadInput(flag, text, f"{why}; choose {DEVICES}")
    if kind not in _KINDS:
        raise BadInput(flag, text, f"unknown device; choose {DEVICES}")
    if colon and not index.isdigit():
        why = f"the index after ':' must be a whole number ({kind}:0, {kind}:1)"
        raise BadInput(flag, text, why)
    why = unavailable_reason(kind)
    if why is not None:
        raise BadInput(flag, text, why)
    count = device_count(kind)
    if colon and int(index) >= count:
        have = f"{kind}:0" if count == 1 else f"{kind}:0 to {kind}:{count - 1}"
        raise BadInput(flag, text, f"this machine has {count} {kind} device(s): {have}")


def default_kind() -> str:
    """The best accelerator present, else cpu."""
    for kind in _KINDS:
        if available(kind):
            return kind
    return "cpu"


def resolve(device: str | torch.device | None = None, local_rank: int = 0) -> torch.device:
    """A concrete torch.device: `None`/"auto" picks the best kind, indexed by local rank."""
    if device is None or device == "auto":
        kind = default_kind()
    else:
        dev = torch.device(device)
        if dev.index is not None or dev.type in ("cpu", "mps"):
            return dev
        kind = dev.type
    if kind in ("cpu", "mps"):
        return torch.device(kind)
    return torch.device(kind, local_rank)


def _module(kind: str):
    return getattr(torch, kind, None)


def set_current(device: torch.device) -> None:
    """Bind this process to its accelerator (a no-op on cpu and mps)."""
    mod = _module(device.type)
    if device.type not in ("cpu", "mps") and mod is not None and device.index is not None:
        mod.set_device(device.index)


def distributed_backend(device: torch.device | str) -> str:
    """The collective backend for a device kind: nccl, hccl, xccl or gloo."""
    kind = torch.device(device).type
    return {"cuda": "nccl", "npu": "hccl", "xpu": "xccl"}.get(kind, "gloo")


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels, so that wall-clock timings mean something."""
    mod = _module(device.type)
    if device.type != "cpu" and mod is not None and hasattr(mod, "synchronize"):
        mod.synchronize()


def autocast(device: torch.device, dtype: torch.dtype | None):
    """An autocast context for the device kind, or a null context when dtype is None."""
    if dtype is None:
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def reset_peak_memory(device: torch.device) -> None:
    mod = _module(device.type)
    if device.type in ("cuda", "npu", "xpu") and mod is not None:
        mod.reset_peak_memory_stats(device)


def peak_memory_bytes(device: torch.device) -> int | None:
    """Peak bytes allocated on the device since the last reset; None where not tracked (cpu)."""
    mod = _module(device.type)
    if device.type in ("cuda", "npu", "xpu") and mod is not None:
        return int(mod.max_memory_allocated(device))
    if device.type == "mps":
        return int(torch.mps.current_allocated_memory())
    return None


def total_memory_bytes(device: torch.device) -> int | None:
    """Total memory of the device in bytes; None on cpu and mps."""
    mod = _module(device.type)
    if device.type in ("cuda", "npu", "xpu") and mod is not None:
        return int(mod.get_device_properties(device).total_memory)
    return None


def empty_cache(device: torch.device) -> None:
    mod = _module(device.type)
    if device.type != "cpu" and mod is not None and hasattr(mod, "empty_cache"):
        mod.empty_cache()


def out_of_memory_errors() -> tuple[type[BaseException], ...]:
    """Exception types that mean 'out of device memory' (caught by type, never by message)."""
    # torch.OutOfMemoryError is torch >= 2.5; torch.cuda.OutOfMemoryError is the same class.
    errors: list[type[BaseException]] = [
        getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError
    ]
    npu = _module("npu")
    if npu is not None and hasattr(npu, "OutOfMemoryError"):
        errors.append(npu.OutOfMemoryError)
    return tuple(errors)
