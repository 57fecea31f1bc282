"""A distributed window checked against one process taking the whole global batch.

`run_ranks` starts N processes on CPU joined by gloo, the way torchrun starts them on one
node. `check_equivalence` uses it: N ranks run DDP (or FSDP2) with accumulation over ragged
micro-batches, rows of random lengths and unequal token counts per rank, optionally with one
rank's data running out early; one process takes every rank's micro-batches of each window as
one batch. Both take the same AdamW steps. Their gradients, parameters, losses and token
counts must agree to fp32 rounding.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from .atomic import write_atomic
from .distributed import RankInfo, aligned_windows, init_distributed, teardown

WRAPPERS = ("ddp", "fsdp2")
IGNORE_INDEX = -100


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(
    fn: Callable,
    world_size: int,
    args: tuple = (),
    timeout_s: float = 120.0,
    threads_per_rank: int = 1,
) -> list:
    """Run `fn(info: RankInfo, *args)` in `world_size` fresh processes joined by gloo on CPU
    (the way torchrun would start them on one node) and return each rank's return value.

    `fn` and `args` must be picklable (a module-level function); return values travel back
    through `torch.save`, so keep them to tensors, numbers, strings, lists and dicts.
    Raises TimeoutError when a rank is still running after `timeout_s` seconds (all ranks
    are then stopped), RuntimeError with the ranks' tracebacks when one failed.
    """
    if world_size < 1:
        raise ValueError(f"world_size {world_size}: must be at least 1")
    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="gradaccum-ranks-") as tmp:
        procs = [
            ctx.Process(
                target=_rank_main,
                args=(fn, args, rank, world_size, port, tmp, threads_per_rank, timeout_s),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        stuck = [rank for rank, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        outcomes = [_read_outcome(tmp, rank) for rank in range(world_size)]
    failed = {rank: out["error"] for rank, out in enumerate(outcomes) if "error" in out}
    if stuck:
        details = "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in failed.items())
        raise TimeoutError(
            f"ranks {stuck} of {world_size} still running after {timeout_s} s{details}"
        )
    if failed or any("value" not in out for out in outcomes):
        lost = [r for r, out in enumerate(outcomes) if not out]
        details = "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in failed.items())
        raise RuntimeError(f"ranks {sorted(failed) + lost} of {world_size} failed{details}")
    return [out["value"] for out in outcomes]


def _rank_main(fn, args, rank, world_size, port, tmp, threads, timeout_s) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(threads)
    info = None
    try:
        info = init_distributed(device="cpu", backend="gloo", timeout_s=timeout_s)
        outcome = {"value": fn(info, *args)}
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises
        outcome = {"error": traceback.format_exc()}
    path = os.path.join(tmp, f"rank{rank}.pt")
    write_atomic(path, lambda f: torch.save(outcome, f))
    # After a failure the other ranks may sit in a collective: leave without the group's
    # goodbye, closing the sockets is what tells them.
    if info is not None and "value" in outcome:
        teardown(info)


def _read_outcome(tmp: str, rank: int) -> dict:
    path = os.path.join(tmp, f"rank{rank}.pt")
    if not os.path.exists(path):
        return {}
    return torch.load(path, weights_only=True)


# ---- the equivalence check -----------------------------------------------------------------


@dataclass(frozen=True)
class EquivalenceSetup:
    """What the check runs; every rank and the single process build the same from it."""

    world_size: int = 2
    """Ranks taking part."""
    accum_steps: int = 4
    """Micro-batches per rank per window (k)."""
    steps: int = 3
    """Optimizer steps (AdamW, lr 1e-2, weight decay 0.1)."""
    wrapper: str = "ddp"
    """ddp (DistributedDataParallel) or fsdp2 (`fully_shard` on each block, then the root)."""
    sync_every_micro_batch: bool = False
    """Reduce gradients after every micro-batch instead of once per window."""
    short_rank: bool = True
    """The last rank's data runs out a micro-batch into the next-to-last window."""
    seed: int = 0
    """Seeds the model and every rank's data."""
    normalize: str = "tokens"
    """The Accumulator's normalize ("micro_batch_mean" shows what dividing by k costs)."""
    tolerance: float = 1e-5
    """Largest relative error that passes."""

    def __post_init__(self):
        if self.world_size < 1:
            raise ValueError(f"world_size {self.world_size}: must be at least 1")
        if self.accum_steps < 1 or self.steps < 1:
            raise ValueError(
                f"accum_steps {self.accum_steps}, steps {self.steps}: must be at least 1"
            )
        if self.wrapper not in WRAPPERS:
            raise ValueError(f"wrapper {self.wrapper!r}: expected one of {', '.join(WRAPPERS)}")
        if not self.tolerance > 0:
            raise ValueError(f"tolerance {self.tolerance}: must be positive")


@dataclass
class EquivalenceReport:
    """How far N ranks with accumulation are from one process taking the global batch."""

    setup: EquivalenceSetup
    """What ran."""
    grad_rel_error: float
    """Largest over windows of |g - g_ref| / |g_ref|, g the whole gradient handed to AdamW."""
    param_rel_error: float
    """|p - p_ref| / |p_ref| after the last step, p all parameters as one vector, over the
    elements the loss depends on (see `excluded`)."""
    loss_rel_error: float
    """Largest over windows of the reported loss's relative error (loss per token)."""
    tokens: list[int]
    """Valid tokens per window as the engine reported them (summed over ranks)."""
    tokens_expected: list[int]
    """Valid tokens per window in the global batch, counted by the single process."""
    grad_collectives: list[int]
    """Gradient collectives rank 0 launched per window."""
    grad_bytes: list[int]
    """Bytes of gradient rank 0 handed to them per window."""
    excluded: dict[str, int]
    """Elements left out of `param_rel_error`, by parameter: their gradient is zero up to
    rounding in every window (below 1e-7 of the gradient's root mean square; an attention key
    bias, which softmax cancels), so AdamW turns rounding noise into full-size steps."""

    @property
    def passed(self) -> bool:
        errors = (self.grad_rel_error, self.param_rel_error, self.loss_rel_error)
        tolerance = self.setup.tolerance
        return all(e <= tolerance for e in errors) and self.tokens == self.tokens_expected

    def to_dict(self) -> dict:
        return {**asdict(self), "passed": self.passed}


def check_equivalence(
    world_size: int = 2,
    timeout_s: float = 120.0,
    model_factory: Callable[[int], torch.nn.Module] | None = None,
    **setup,
) -> EquivalenceReport:
    """Run the windows on `world_size` gloo processes on CPU and on one process; compare.

    setup: the other fields of `EquivalenceSetup` (accum_steps, steps, wrapper, ...).
    model_factory: a picklable callable(seed) -> module mapping `input_ids` (b, 16) long to
      logits (b, 16, vocab >= 37); default `small_gpt`.
    """
    config = EquivalenceSetup(world_size=world_size, **setup)
    factory = model_factory or small_gpt
    got = run_ranks(run_check_rank, world_size, (factory, config), timeout_s=timeout_s)[0]
    return compare(config, got, single_process_run(factory, config))


def compare(setup: EquivalenceSetup, got: dict, want: dict) -> EquivalenceReport:
    """The report for rank 0's `run_check_rank` output against `single_process_run`'s."""
    grad_error = max(
        _rel(torch.cat([g.flatten() for g in a]), torch.cat([g.flatten() for g in b]))
        for a, b in zip(got["grads"], want["grads"], strict=True)
    )
    flat = _flat_gradient_mask(want["grads"])
    param_error = _rel(
        torch.cat([a[~m] for a, m in zip(got["params"], flat, strict=True)]),
        torch.cat([b[~m] for b, m in zip(want["params"], flat, strict=True)]),
    )
    excluded = {
        name: int(mask.sum()) for name, mask in zip(want["names"], flat, strict=True) if mask.any()
    }
    loss_error = max(
        abs(a - b) / abs(b) for a, b in zip(got["losses"], want["losses"], strict=True)
    )
    return EquivalenceReport(
        setup=setup,
        grad_rel_error=grad_error,
        param_rel_error=param_error,
        loss_rel_error=loss_error,
        tokens=got["tokens"],
        tokens_expected=want["tokens"],
        grad_collectives=got["collectives"],
        grad_bytes=got["bytes"],
        excluded=excluded,
    )


def small_gpt(seed: int) -> torch.nn.Module:
    """The default model of the check: a 2-layer GPT, vocab 37, 16 positions, width 32."""
    from .train.model import GPT, GPTConfig

    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=37, seq_len=16, n_layer=2, n_head=2, n_embd=32))


def rank_batches(setup: EquivalenceSetup, rank: int) -> list[dict]:
    """Rank `rank`'s micro-batches for the whole run, on CPU: 2 + rank rows each (so ranks
    hold unequal token counts), every row a random number (1..16) of valid tokens."""
    k, steps, world = setup.accum_steps, setup.steps, setup.world_size
    count = steps * k
    if setup.short_rank and rank == world - 1 and world > 1:
        count = max(1, (steps - 1) * k - 1)  # a short window, then (if any) an empty one
    g = torch.Generator().manual_seed(setup.seed * 1009 + rank)
    rows, seq_len = 2 + rank, 16
    out = []
    for _ in range(count):
        lengths = torch.randint(1, seq_len + 1, (rows,), generator=g)
        valid = torch.arange(seq_len)[None, :] < lengths[:, None]
        ids = torch.randint(0, 37, (rows, seq_len), generator=g)
        labels = torch.randint(0, 37, (rows, seq_len), generator=g)
        out.append({"input_ids": ids, "labels": torch.where(valid, labels, IGNORE_INDEX)})
    return out


def _loss(model, batch):
    from .train.model import causal_lm_loss

    return causal_lm_loss(model, batch, ignore_index=IGNORE_INDEX)


def _adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _to(batch: dict, device: torch.device) -> dict:
    return {key: value.to(device) for key, value in batch.items()}


def run_check_rank(info: RankInfo, factory: Callable, setup: EquivalenceSetup) -> dict | None:
    """One rank's part (any backend, on `info.device`); rank 0 returns what `compare` reads,
    on CPU."""
    from . import Accumulator

    model = factory(setup.seed).to(info.device)
    if setup.wrapper == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard

        for module in list(model.modules()):
            if isinstance(module, torch.nn.ModuleList):
                for block in module:
                    fully_shard(block)
        fully_shard(model)
    optimizer = _adamw(model.parameters())
    grads: list[list[torch.Tensor]] = []
    optimizer.register_step_pre_hook(lambda opt, *_: grads.append(_full_grads(opt)))
    acc = Accumulator(
        model,
        optimizer,
        sync_every_micro_batch=setup.sync_every_micro_batch,
        normalize=setup.normalize,
    )
    batches = [_to(b, info.device) for b in rank_batches(setup, info.rank)]
    results = [acc.step(w, _loss) for w in aligned_windows(batches, setup.accum_steps)]
    params = [_full(p).detach().cpu() for p in model.parameters()]
    if not info.is_main:
        return None
    return {
        "grads": grads,
        "params": params,
        "losses": [r.loss for r in results],
        "tokens": [r.tokens for r in results],
        "collectives": [r.grad_collectives for r in results],
        "bytes": [r.grad_bytes for r in results],
    }


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t  # FSDP2 shards are DTensors


def _full_grads(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return [_full(p.grad).detach().cpu().clone() for p in params]


def single_process_run(
    factory: Callable, setup: EquivalenceSetup, device: torch.device | str = "cpu"
) -> dict:
    """The global batch on one process, without the engine: each window's micro-batches of
    every rank stacked into one batch, loss summed over tokens / tokens, one AdamW step."""
    model = factory(setup.seed).to(device)
    optimizer = _adamw(model.parameters())
    k = setup.accum_steps
    per_rank = [rank_batches(setup, r) for r in range(setup.world_size)]
    grads, losses, tokens = [], [], []
    for step in range(setup.steps):
        batches = [b for data in per_rank for b in data[step * k : (step + 1) * k]]
        if not batches:
            break
        big = _to({key: torch.cat([b[key] for b in batches]) for key in batches[0]}, device)
        optimizer.zero_grad()
        loss_sum, n = _loss(model, big)
        (loss_sum / n).backward()
        grads.append([p.grad.detach().cpu().clone() for p in model.parameters()])
        losses.append(loss_sum.item() / n.item())
        tokens.append(int(n))
        optimizer.step()
    names = [name for name, _ in model.named_parameters()]
    params = [p.detach().cpu().clone() for p in model.parameters()]
    return {"grads": grads, "params": params, "losses": losses, "tokens": tokens, "names": names}


def _flat_gradient_mask(grads: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """Per parameter, the elements whose gradient is below 1e-7 of the whole gradient's root
    mean square in every window."""
    masks = None
    for window in grads:
        whole = torch.cat([g.flatten() for g in window]).double()
        floor = 1e-7 * whole.norm() / math.sqrt(whole.numel())
        flat = [g.double().abs() < floor for g in window]
        masks = flat if masks is None else [a & b for a, b in zip(masks, flat, strict=True)]
    return masks


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()
