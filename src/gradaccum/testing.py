"""References that check accumulation without the code under test, and N ranks on one CPU.

Two kinds of helper, public so that the project's tests, `gradaccum verify --world-size` and
the benchmarks share one copy, and so that users can check their own setups the same way:

- big-batch references (docs/design.md, "Numerical rules"): every micro-batch padded to one
  length, stacked into one batch, one forward and one backward of the summed token loss
  divided by the valid-token count, in any dtype float64 included (`big_batch_grads`), or the
  per-micro-batch gradients summed exactly in float64 (`exact_fp64_sum`);
- the distributed harness: `run_ranks` starts N processes joined by gloo on CPU, the way
  torchrun starts them on one node; `check_equivalence` runs accumulation under DDP or FSDP2
  on them and compares with one process taking each global window as one batch.

The model is always passed in (a picklable factory `seed -> module` for the harness): this
module builds none of its own.
"""

from __future__ import annotations

import copy
import math
import multiprocessing
import os
import socket
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from .atomic import write_atomic
from .bigbatch import IGNORE_INDEX, concat_batches
from .distributed import RankInfo, aligned_windows, init_distributed, teardown

WRAPPERS = ("ddp", "fsdp2")

# ---- the loss and the data ------------------------------------------------------------------


def token_loss(model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy summed over valid labels (not IGNORE_INDEX), and their count.

    `batch["input_ids"]` goes into the model; its output (or its `.logits`) is (b, T, classes)
    and `batch["labels"]` (b, T) is already aligned with it. Logits are upcast to at least fp32
    (float64 stays float64, so a float64 reference is float64 throughout).
    """
    out = model(batch["input_ids"])
    logits = out if isinstance(out, torch.Tensor) else out.logits
    if logits.dtype != torch.float64:
        logits = logits.float()
    labels = batch["labels"]
    loss = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]),
        labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
    return loss, (labels != IGNORE_INDEX).sum()


def ragged_batches(
    kind: str,
    count: int,
    seed: int,
    seq_len: int = 16,
    batch: int = 3,
    vocab: int = 37,
    d_in: int = 8,
    classes: int = 5,
    dtype=torch.float32,
) -> list[dict]:
    """`count` micro-batches of `batch` rows whose valid tokens number 1..seq_len at random;
    the rest of each row is padding with label IGNORE_INDEX.

    kind "gpt": `input_ids` are token ids (b, seq_len) below `vocab`; any other kind: features
    (b, seq_len, d_in) in `dtype` with labels below `classes`.
    """
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        lengths = torch.randint(1, seq_len + 1, (batch,), generator=g)
        valid = torch.arange(seq_len)[None, :] < lengths[:, None]
        if kind == "gpt":
            ids = torch.randint(0, vocab, (batch, seq_len), generator=g)
            labels = torch.randint(0, vocab, (batch, seq_len), generator=g)
            ids = torch.where(valid, ids, torch.zeros_like(ids))
        else:
            ids = torch.randn(batch, seq_len, d_in, generator=g).to(dtype)
            labels = torch.randint(0, classes, (batch, seq_len), generator=g)
        out.append({"input_ids": ids, "labels": torch.where(valid, labels, IGNORE_INDEX)})
    return out


def valid_tokens(batches: Sequence[dict]) -> int:
    """Labels that are not IGNORE_INDEX, over all `batches`."""
    return sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in batches)


# ---- big-batch references ---------------------------------------------------------------------


def big_batch(micro_batches: Sequence[dict]) -> dict:
    """The micro-batches (dicts of tensors) stacked along the batch dimension; rows narrower
    than the widest are padded at the end (labels with IGNORE_INDEX, the rest with 0)."""
    return concat_batches(micro_batches, IGNORE_INDEX)


def big_batch_grads(
    model: torch.nn.Module,
    micro_batches: Sequence[dict],
    dtype: torch.dtype | None = None,
    loss_fn: Callable = token_loss,
) -> list[torch.Tensor]:
    """Gradients of (sum of token losses) / (valid tokens) over all micro-batches at once,
    on a copy of `model` (cast to `dtype` when given, floating inputs too)."""
    model = copy.deepcopy(model)
    if dtype is not None:
        model = model.to(dtype)
    batch = big_batch(micro_batches)
    if dtype is not None and batch["input_ids"].is_floating_point():
        batch = {**batch, "input_ids": batch["input_ids"].to(dtype)}
    loss_sum, n = loss_fn(model, batch)
    (loss_sum / n).backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def exact_fp64_sum(
    model: torch.nn.Module, micro_batches: Sequence[dict], loss_fn: Callable = token_loss
) -> list[torch.Tensor]:
    """The window gradient as exact accumulation would give it: each micro-batch's own
    gradient (in the model's dtype) of loss_sum / N, summed in float64."""
    model = copy.deepcopy(model)
    total = valid_tokens(micro_batches)
    out = None
    for batch in micro_batches:
        model.zero_grad()
        loss_sum, _ = loss_fn(model, batch)
        (loss_sum / total).backward()
        grads = [p.grad.double() for p in model.parameters()]
        out = grads if out is None else [a + b for a, b in zip(out, grads, strict=True)]
    return out


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """|got - want| / |want| (Frobenius norms, in float64)."""
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm().clamp(min=1e-30)).item()


def max_rel_error(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor]) -> float:
    """max over parameters of |got - want| / |want| (Frobenius norms, in float64)."""
    return max(rel_error(a, b) for a, b in zip(got, want, strict=True))


class GradRecorder(torch.optim.Optimizer):
    """An optimizer whose step only records the gradients it was given (parameters stay)."""

    def __init__(self, params):
        super().__init__(params, {"lr": 0.0})
        self.seen: list[list[torch.Tensor | None]] = []

    @torch.no_grad()
    def step(self, closure=None):
        self.seen.append(
            [
                None if p.grad is None else full(p.grad).detach().clone()
                for g in self.param_groups
                for p in g["params"]
            ]
        )


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of an FSDP2 shard (a DTensor); any other tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def record_grads(optimizer: torch.optim.Optimizer) -> list[list[torch.Tensor]]:
    """The gradients `optimizer` is handed at each step, whole tensors under FSDP2 (a list
    that grows by one entry per step)."""
    seen: list[list[torch.Tensor]] = []

    def hook(opt, args, kwargs):
        params = [p for g in opt.param_groups for p in g["params"]]
        seen.append([full(p.grad).detach().cpu().clone() for p in params])

    optimizer.register_step_pre_hook(hook)
    return seen


def adamw(params) -> torch.optim.Optimizer:
    """The optimizer the equivalence checks step: AdamW, lr 1e-2, weight decay 0.1."""
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


# ---- N ranks on CPU ---------------------------------------------------------------------------


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
    details = "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in failed.items())
    if stuck:
        raise TimeoutError(
            f"ranks {stuck} of {world_size} still running after {timeout_s} s{details}"
        )
    if failed or any("value" not in out for out in outcomes):
        lost = [r for r, out in enumerate(outcomes) if not out]
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


# ---- the distributed equivalence check --------------------------------------------------------


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
    vocab_size: int = 37
    """Token ids in the data are below this (the model must read at least this many)."""
    seq_len: int = 16
    """Positions per row, in tokens (the model must read at least this many)."""

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
        if self.vocab_size < 1 or self.seq_len < 1:
            raise ValueError(
                f"vocab_size {self.vocab_size}, seq_len {self.seq_len}: must be at least 1"
            )


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
    model_factory: Callable[[int], torch.nn.Module],
    world_size: int = 2,
    timeout_s: float = 120.0,
    loss_fn: Callable = token_loss,
    count_tokens: Callable | str | None = "auto",
    **setup,
) -> EquivalenceReport:
    """Run the windows on `world_size` gloo processes on CPU and on one process; compare.

    model_factory: a picklable callable(seed) -> module (a module-level function or a
      `functools.partial` of one) whose output for `input_ids` (b, seq_len) long is logits
      (b, seq_len, >= vocab_size) or has them as `.logits`; seeded by it, so that every rank
      and the single process build the same weights.
    loss_fn: a picklable loss_fn(model, batch) -> (loss_sum, num_tokens); `token_loss` by
      default (labels aligned with the logits).
    count_tokens: the Accumulator's (picklable), for a loss_fn that shifts labels itself.
    setup: the other fields of `EquivalenceSetup` (accum_steps, steps, wrapper, ...).
    """
    config = EquivalenceSetup(world_size=world_size, **setup)
    args = (model_factory, config, loss_fn, count_tokens)
    got = run_ranks(run_check_rank, world_size, args, timeout_s=timeout_s)[0]
    return compare(config, got, single_process_run(model_factory, config, loss_fn=loss_fn))


def compare(setup: EquivalenceSetup, got: dict, want: dict) -> EquivalenceReport:
    """The report for rank 0's `run_check_rank` output against `single_process_run`'s."""
    grad_error = max(
        rel_error(torch.cat([g.flatten() for g in a]), torch.cat([g.flatten() for g in b]))
        for a, b in zip(got["grads"], want["grads"], strict=True)
    )
    flat = _flat_gradient_mask(want["grads"])
    param_error = rel_error(
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


def rank_batches(setup: EquivalenceSetup, rank: int) -> list[dict]:
    """Rank `rank`'s micro-batches for the whole run, on CPU: 2 + rank rows each (so ranks
    hold unequal token counts), every row a random number (1..seq_len) of valid tokens."""
    k, steps, world = setup.accum_steps, setup.steps, setup.world_size
    count = steps * k
    if setup.short_rank and rank == world - 1 and world > 1:
        count = max(1, (steps - 1) * k - 1)  # a short window, then (if any) an empty one
    return ragged_batches(
        "gpt",
        count,
        seed=setup.seed * 1009 + rank,
        seq_len=setup.seq_len,
        batch=2 + rank,
        vocab=setup.vocab_size,
    )


def wrap(model: torch.nn.Module, wrapper: str) -> torch.nn.Module:
    """`model` under DDP, or sharded with FSDP2: each block of every ModuleList, then the root."""
    if wrapper == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    from torch.distributed.fsdp import fully_shard

    for module in list(model.modules()):
        if isinstance(module, torch.nn.ModuleList):
            for block in module:
                fully_shard(block)
    fully_shard(model)
    return model


def run_check_rank(
    info: RankInfo,
    factory: Callable,
    setup: EquivalenceSetup,
    loss_fn: Callable = token_loss,
    count_tokens: Callable | str | None = "auto",
) -> dict | None:
    """One rank's part (any backend, on `info.device`); rank 0 returns what `compare` reads,
    on CPU."""
    from .engine import Accumulator

    model = wrap(factory(setup.seed).to(info.device), setup.wrapper)
    optimizer = adamw(model.parameters())
    grads = record_grads(optimizer)
    acc = Accumulator(
        model,
        optimizer,
        sync_every_micro_batch=setup.sync_every_micro_batch,
        normalize=setup.normalize,
        count_tokens=count_tokens,
    )
    batches = [_to(b, info.device) for b in rank_batches(setup, info.rank)]
    results = [acc.step(w, loss_fn) for w in aligned_windows(batches, setup.accum_steps)]
    params = [full(p).detach().cpu() for p in model.parameters()]
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


def _to(batch: dict, device: torch.device) -> dict:
    return {key: value.to(device) for key, value in batch.items()}


def single_process_run(
    factory: Callable,
    setup: EquivalenceSetup,
    device: torch.device | str = "cpu",
    loss_fn: Callable = token_loss,
) -> dict:
    """The global batch on one process, without the engine: each window's micro-batches of
    every rank stacked into one batch, loss summed over tokens / tokens, one AdamW step."""
    model = factory(setup.seed).to(device)
    optimizer = adamw(model.parameters())
    k = setup.accum_steps
    per_rank = [rank_batches(setup, r) for r in range(setup.world_size)]
    grads, losses, tokens = [], [], []
    for step in range(setup.steps):
        batches = [b for data in per_rank for b in data[step * k : (step + 1) * k]]
        if not batches:
            break
        optimizer.zero_grad()
        loss_sum, n = loss_fn(model, _to(big_batch(batches), device))
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
