"""Where a window's gradient lives until the optimizer takes it.

fp32 (or fp64) parameters keep their gradient in `.grad`, as autograd adds it. bf16/fp16
parameters add each micro-batch's gradient into an fp32 buffer as it is produced (a
post-accumulate-grad hook) and free the low-precision gradient at once; all buffers are views
of one flat tensor. Under DDP with such parameters the buffers are not `.grad` tensors DDP
could reduce, so DDP never syncs and the store all-reduces the flat buffer once per window
("manual sync"). With `master_weights` the optimizer steps fp32 copies of the low-precision
parameters, copied back (rounded once) after each step.

Parameters the optimizer holds but the model does not (a learnable temperature used in
loss_fn) are the store's like the model's: buffered, cleared, corrected and clipped. No
wrapper syncs them, so under data parallelism the store all-reduces their gradient once per
window (summed over ranks and divided by the world size, as DDP and FSDP2 average), zeros
standing in on a rank that did not use them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from gradaccum.engine.precision import is_low_precision
from gradaccum.parallel import collectives
from gradaccum.parallel.backends import Backend


class GradStore:
    """The gradient storage of one model: buffers, the flat buffer, which buffers this window
    wrote, master weights, and the engine's own sync where it owns it.

    params: the parameters that require grad: the model's, then `extras`, those only the
    optimizer holds. dp: the model's data-parallel backend (`backends.data_parallel`). optimizer:
    re-pointed at the master weights when there are any.
    """

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        dp: Backend,
        optimizer: torch.optim.Optimizer,
        accum_dtype: torch.dtype = torch.float32,
        master_weights: bool = False,
        extras: list[torch.nn.Parameter] = (),
    ):
        self._params = params
        self._extras = list(extras)
        self._dp = dp
        self._optimizer = optimizer
        # FSDP2 reduces and shards the model's gradients itself (its MixedPrecisionPolicy sets
        # the reduce dtype), so there only parameters outside the model may need a buffer.
        self._candidates = self._extras if dp.shards_gradients else params
        buffered = any(_needs_buffer(p, accum_dtype) for p in self._candidates)
        self.manual_sync = buffered and dp.buffers_synced_by_engine
        """Whether the store all-reduces the window's gradient itself (DDP never syncs)."""
        self._buffers: dict[torch.Tensor, torch.Tensor] = {}
        self._hooks: list = []  # handles of the buffer hooks, removed by close()
        self._written: set[int] = set()
        self._flat: torch.Tensor | None = None
        if buffered:
            self._make_buffers(accum_dtype)
        self._masters: dict[torch.Tensor, torch.nn.Parameter] = {}
        if master_weights:
            self._make_masters()
        self._traffic = dp.count_traffic() if dp.averages_over_ranks else None
        self._own_traffic = (0, 0)  # the all-reduce of parameters outside the model, this window

    # ---- building -------------------------------------------------------------------------

    def _make_buffers(self, dtype: torch.dtype) -> None:
        # Under manual sync every parameter, fp32 ones too, goes through the flat buffer so a
        # single all-reduce covers the whole gradient.
        chosen = [p for p in self._candidates if self.manual_sync or _needs_buffer(p, dtype)]
        device = self._params[0].device
        self._flat = torch.zeros(sum(p.numel() for p in chosen), dtype=dtype, device=device)
        offset = 0
        for p in chosen:
            self._buffers[p] = self._flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
            self._hooks.append(p.register_post_accumulate_grad_hook(self._accumulate_into_buffer))

    def _accumulate_into_buffer(self, p: torch.Tensor) -> None:
        buf = self._buffers[p]
        if id(p) in self._written:
            buf.add_(p.grad)
        else:
            buf.copy_(p.grad)
            self._written.add(id(p))
        p.grad = None  # free the low-precision gradient at once

    def _make_masters(self) -> None:
        if self._dp.shards_gradients:
            raise ValueError(
                "master_weights=True does not apply to FSDP2: keep the parameters in fp32 and "
                "shard with fully_shard(..., mp_policy=MixedPrecisionPolicy("
                "param_dtype=torch.bfloat16, reduce_dtype=torch.float32)); FSDP2 then computes "
                "in bf16 and steps fp32 shards"
            )
        if not self._buffers:
            raise ValueError(
                "master_weights=True needs bf16/fp16 parameters (these are "
                f"{self._params[0].dtype}) and an fp32 accum_dtype"
            )
        if self._optimizer.state:
            raise ValueError("master_weights=True: build the Accumulator before the first step")
        for p in self._params:
            if p in self._buffers and is_low_precision(p.dtype):
                self._masters[p] = torch.nn.Parameter(p.detach().to(self._flat.dtype))
        for group in self._optimizer.param_groups:
            group["params"] = [self._masters.get(p, p) for p in group["params"]]

    # ---- one window -----------------------------------------------------------------------

    def reduce(self) -> None:
        """Sum the window's gradient over ranks where the store owns the sync: the flat
        buffer (manual sync), or the parameters outside the model; DDP and FSDP2 have synced
        the model's on the last micro-batch already."""
        self._own_traffic = (0, 0)
        if self.manual_sync:
            for p, buf in self._buffers.items():
                if id(p) not in self._written:
                    buf.zero_()  # a parameter unused on this rank adds nothing
            dist.all_reduce(self._flat, group=self._dp.group)
        elif self._extras and self._dp.averages_over_ranks and self._dp.world > 1:
            self._reduce_extras()

    def _reduce_extras(self) -> None:
        """All-reduce the gradient of each parameter outside the model. Each rank's backward
        carried the factor `world` that undoes a wrapper's average (`backward_scale`), so the
        sum is divided by `world`, as DDP and FSDP2 divide theirs. A rank that did not use the
        parameter adds zeros, so that every rank steps it alike."""
        nbytes = 0
        for p in self._extras:
            if p in self._buffers:
                grad = self._buffers[p]
                if id(p) not in self._written:
                    grad.zero_()
                    self._written.add(id(p))
            else:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                grad = p.grad
            grad.copy_(collectives.all_reduce_sum(grad, self._dp.group))  # on the backend's device
            grad.div_(self._dp.world)
            nbytes += grad.numel() * grad.element_size()
        self._own_traffic = (len(self._extras), nbytes)

    def gradients(self) -> list[torch.Tensor]:
        """The tensors that hold this window's gradient: buffers, then `.grad` of the rest."""
        grads = [buf for _, buf in self._live_buffers()]
        grads += [p.grad for p in self._params if p not in self._buffers and p.grad is not None]
        return grads

    def step(self, optimizer_step: Callable[[], object]) -> None:
        """Hand the gradient to the optimizer (`.grad` of each parameter or master weight),
        run `optimizer_step`, and copy master weights back into the parameters."""
        for p, buf in self._live_buffers():
            master = self._masters.get(p)
            if master is not None:
                master.grad = buf if buf.dtype == master.dtype else buf.float()
            else:
                p.grad = buf.to(p.dtype) if buf.dtype != p.dtype else buf
        optimizer_step()
        with torch.no_grad():
            for p, m in self._masters.items():
                p.copy_(m)

    def close(self) -> None:
        """Remove the hooks this store put on the parameters (the model is then free for
        another Accumulator)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    def clear(self) -> None:
        """Drop the window's gradient: `.grad` of parameters, masters and every tensor the
        optimizer holds, and the record of which buffers were written (their contents are
        overwritten next window). Once per window, at its start (a backward run outside any
        window must not leak into it) and at its end."""
        for p in self._params:
            p.grad = None
        for m in self._masters.values():
            m.grad = None
        for group in self._optimizer.param_groups:
            for p in group["params"]:
                p.grad = None
        self._written.clear()

    def drop_unreduced(self, reset: bool = False) -> None:
        """Drop the gradients the wrapper keeps unreduced from micro-batches run without sync
        (FSDP2: an abandoned window's, or any backward since the last sync); `reset` its
        iteration state too (`Backend.drop_unreduced_grads`)."""
        self._dp.drop_unreduced_grads(reset)

    def traffic(self) -> tuple[int, int, int, int]:
        """(gradient collectives, bytes, of them HSDP's all-reduces across replicas, their
        bytes) launched so far: the counter's running totals, 0 for manual sync (counted per
        window by `window_traffic`), -1 where not counted."""
        if self._traffic is not None:
            t = self._traffic
            return t.collectives, t.bytes, t.replica_collectives, t.replica_bytes
        counted = not (self._dp.averages_over_ranks and not self.manual_sync)
        return (0, 0, 0, 0) if counted else (-1, -1, -1, -1)

    def window_traffic(self, start: tuple[int, int, int, int]) -> tuple[int, int, int, int]:
        """What `traffic` counts, since `start`: of this window, plus the store's own
        all-reduce of parameters outside the model (within one node's replica group it is
        not: it runs over the whole data-parallel group and is counted apart from HSDP's)."""
        if self.manual_sync:  # DDP never syncs: the store's one all-reduce is the traffic
            return 1, self._flat.numel() * self._flat.element_size(), 0, 0
        now = self.traffic()
        if now[0] < 0 or not self._dp.averages_over_ranks:
            return now
        own_launched, own_bytes = self._own_traffic
        delta = [a - b for a, b in zip(now, start, strict=True)]
        return delta[0] + own_launched, delta[1] + own_bytes, delta[2], delta[3]

    # ---- checkpointing --------------------------------------------------------------------

    def state_dict(self) -> dict:
        if not self._masters:
            return {}
        return {"masters": [m.detach().clone() for m in self._masters.values()]}

    def load_state_dict(self, state: dict) -> None:
        if not self._masters:
            return
        with torch.no_grad():
            for m, saved in zip(self._masters.values(), state["masters"], strict=True):
                m.copy_(saved)
            for p, m in self._masters.items():
                p.copy_(m)

    def _live_buffers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(parameter, buffer) pairs that hold this window's gradient. Under manual sync all
        of them: a parameter unused on this rank may have a gradient from another."""
        return [
            (p, buf)
            for p, buf in self._buffers.items()
            if self.manual_sync or id(p) in self._written
        ]


def _needs_buffer(p: torch.Tensor, accum_dtype: torch.dtype) -> bool:
    # Decided per parameter: a model may mix fp32 (norms, embeddings) and bf16 weights.
    return is_low_precision(p.dtype) and p.dtype != accum_dtype
