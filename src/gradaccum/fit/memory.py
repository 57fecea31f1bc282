"""Memory of one training step, measured, by term (`MemoryUse`).

On CPU (and mps), where no allocator reports a peak: the exact bytes of parameters, gradients,
buffers and optimizer state (unique storages: views and tied weights once), plus the
activations, the unique storages autograd saves for backward, counted with saved-tensor hooks
(`SavedTensorCounter`). On accelerators the allocator's peak, less those terms.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class MemoryUse:
    """What one training step held at its peak, in bytes, by term."""

    params: int
    """Parameters (unique storages: tied weights once); a 4- or 8-bit base's at their stored
    size, with their quantisation constants (`quantization_constants`)."""
    grads: int
    """Gradients: the .grad tensors, plus the engine's fp32 buffers for 16-bit parameters."""
    buffers: int
    """Module buffers (masks, running statistics)."""
    optimizer: int
    """Optimizer state (AdamW: two moments and a step count per parameter)."""
    activations: int
    """CPU: unique storages saved for backward. Accelerators: the peak less the terms above."""
    peak: int
    """The whole: the allocator's peak on accelerators, the sum of the five terms on CPU."""
    source: str
    """How the peak was measured: 'saved tensors' (CPU) or 'allocator peak'."""

    @property
    def state(self) -> int:
        """The part that does not grow with the micro-batch."""
        return self.params + self.grads + self.buffers + self.optimizer


def storage_key(t: torch.Tensor) -> tuple[str, int]:
    st = t.untyped_storage()
    return str(st.device), st.data_ptr()


def storage_bytes(tensors) -> int:
    """Bytes of the unique storages behind `tensors` (views and tied weights counted once)."""
    sizes = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            sizes[storage_key(t)] = t.untyped_storage().nbytes()
    return sum(sizes.values())


def quantization_constants(model: torch.nn.Module) -> list[torch.Tensor]:
    """The tensors a 4- or 8-bit base holds beside its packed weights, neither parameters nor
    buffers: a 4-bit layer's absmax constants and code tables, an 8-bit layer's per-row
    scales (on the weight, or in the layer's state when transformers loaded it). Empty for a
    model with no bitsandbytes layer."""
    from gradaccum.models import quantized

    found = []
    for _, layer in quantized.quantized_layers(model):
        found += quantized.quant_state_tensors(layer)
        state = getattr(layer, "state", None)
        for scales in (getattr(layer.weight, "SCB", None), getattr(state, "SCB", None)):
            if isinstance(scales, torch.Tensor):
                found.append(scales)
    return found


def optimizer_tensors(optimizer: torch.optim.Optimizer):
    """Every tensor the optimizer keeps as state."""
    for state in optimizer.state.values():
        yield from (v for v in state.values() if isinstance(v, torch.Tensor))


class SavedTensorCounter:
    """Counts the bytes autograd saves for backward: unique storages, parameters excluded.

    `with counter.hooks(): loss = ...` counts what the forward inside saves. `watch(module)`
    counts what `module`'s own forward saves even under activation checkpointing, whose
    hooks would otherwise take those tensors first (the innermost saved-tensor hooks win):
    that module then keeps its activations, as one block does while backward recomputes it.
    """

    def __init__(self, exclude: set[tuple[str, int]]):
        self.exclude = exclude
        self.sizes: dict[tuple[str, int], int] = {}
        self._open: list = []

    @property
    def total(self) -> int:
        return sum(self.sizes.values())

    def _pack(self, x: torch.Tensor) -> torch.Tensor:
        key = storage_key(x)
        if key not in self.exclude:
            self.sizes[key] = x.untyped_storage().nbytes()
        return x

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def _enter(self, *_):
        ctx = self.hooks()
        ctx.__enter__()
        self._open.append(ctx)

    def _exit(self, *_):
        if self._open:
            self._open.pop().__exit__(None, None, None)

    def watch(self, module: torch.nn.Module) -> list:
        """Count inside `module`'s forward too; returns hook handles to `.remove()`.

        The hooks go on its children: a block may checkpoint inside its own forward (as
        Hugging Face layers do), and only what runs inside the checkpoint is innermost."""
        handles = []
        for child in list(module.children()) or [module]:
            handles.append(child.register_forward_pre_hook(self._enter))
            handles.append(child.register_forward_hook(self._exit))
        return handles

    def close(self) -> None:
        """Leave any hooks a forward that raised left open."""
        while self._open:
            self._exit()


def _unpack(x: torch.Tensor) -> torch.Tensor:
    return x
