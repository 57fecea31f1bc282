"""DDP or FSDP2 with accumulation on N ranks against one process taking each global window as
one batch: the check behind `gradaccum verify --world-size N` (public through
`gradaccum.testing`).

Window by window, from the same parameters. The ranks record their parameters before each
window, the gradient handed to the optimizer and the parameters after it. The single process
then takes each window at the ranks' parameters of that window: its big-batch gradient, loss
and token count, in float64 where the model runs in it; and one AdamW step in float64 from
those parameters with the ranks' own gradient, replayed over the windows.

Why not compare the two trajectories: AdamW divides each gradient element by the root of its
own second moment, so an element whose gradient is zero up to rounding (an attention key
bias, which softmax cancels, or any element whose contributions nearly cancel) moves by up to
lr in a direction set by its last bits. Two runs that agree on every gradient to rounding can
then differ in such a weight by 2 lr per step, and every later window is computed at weights
that differ: that compares amplified rounding noise, not the engine. So the gradient is
compared against the tolerance of the precision study (`TOLERANCES["fp32"]`, derived in
docs/design.md, "Tolerances of verify"), and the step against `step_tolerance`, derived from
AdamW's update in the parameters' dtype.

FSDP2 runs under a sync policy (`EquivalenceSetup.sync`: "window", "micro", or "hsdp" on a
2-D mesh of replicas x shards); the gradient bytes rank 0 counted per window are compared with
the planner's for the same gradient, k, world and mesh (`TrafficCheck`), and a mismatch fails
the check as a wrong gradient does.

A mixture of experts (`EquivalenceSetup.moe_balance`) runs its windows through
`gradaccum.moe.Balance` on the ranks, and the single process takes the big batch of
cross-entropy plus the load-balancing loss (`moe_check.moe_big_batch`) instead.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from gradaccum.engine.accumulator import Accumulator
from gradaccum.models.loss import IGNORE_INDEX, causal_lm_loss
from gradaccum.moe.balance import Balance
from gradaccum.parallel import sharding
from gradaccum.parallel.process_group import RankInfo, aligned_windows
from gradaccum.verification.moe_check import moe_big_batch
from gradaccum.verification.precision_study import HEADROOM, nice_ceil
from gradaccum.verification.ranks import run_ranks
from gradaccum.verification.reference import (
    adam_ratio_bound,
    adamw,
    big_batch,
    big_batch_reference,
    full,
    ragged_batches,
    record_grads,
    whole_rel_error,
)
from gradaccum.verification.traffic import TrafficCheck, traffic_check
from gradaccum.verification.world_setup import WRAPPERS, EquivalenceSetup

__all__ = [
    "WRAPPERS",
    "EquivalenceReport",
    "EquivalenceSetup",
    "check_equivalence",
    "check_equivalences",
    "compare",
    "hsdp_mesh",
    "rank_batches",
    "replay_adamw",
    "run_check_rank",
    "run_check_ranks",
    "single_process_run",
    "step_errors",
    "step_tolerance",
    "wrap",
]


@dataclass
class EquivalenceReport:
    """How far N ranks with accumulation are from one process taking the global batch, each
    window from the ranks' parameters of that window."""

    setup: EquivalenceSetup
    """What ran."""
    grad_rel_error: float
    """Largest over windows of |g - g_ref| / |g_ref|: g the whole gradient handed to AdamW,
    g_ref the big batch's at the same parameters (float64 where the model runs in it)."""
    loss_rel_error: float
    """Largest over windows of the reported loss's relative error (loss per token)."""
    step_error: float
    """Largest over windows and elements of |p - p_ref| / (|p0| + lr): p the ranks'
    parameters after the window, p0 before it, p_ref one float64 AdamW step from p0 with the
    ranks' gradient and optimizer history."""
    step_tolerance: float
    """Largest `step_error` that passes (`step_tolerance`)."""
    steps: int
    """Optimizer steps the ranks took."""
    windows: int
    """Global windows holding data: the steps one process takes."""
    tokens: list[int]
    """Valid tokens per window as the engine reported them (summed over ranks)."""
    tokens_expected: list[int]
    """Valid tokens per window in the global batch, counted by the single process."""
    grad_collectives: list[int]
    """Gradient collectives rank 0 launched per window."""
    grad_bytes: list[int]
    """Bytes of gradient rank 0 handed to them per window."""
    traffic: TrafficCheck | None = None
    """Those bytes against the planner's; None where they were not compared."""
    reference: str = "float64"
    """What the single process computed the window gradients in."""
    notes: list[str] = field(default_factory=list)
    """Why the run could not be compared window by window, where it could not."""

    @property
    def passed(self) -> bool:
        tolerance = self.setup.tolerance
        return (
            self.steps == self.windows
            and self.grad_rel_error <= tolerance
            and self.loss_rel_error <= tolerance
            and self.step_error <= self.step_tolerance
            and self.tokens == self.tokens_expected
            and (self.traffic is None or self.traffic.equal)
        )

    def to_dict(self) -> dict:
        return {**asdict(self), "passed": self.passed}


def step_tolerance(steps: int, lr: float, betas: tuple[float, float], dtype) -> float:
    """The largest |p - p_ref| / (|p0| + lr) that passes after a window: p the ranks' AdamW
    step from p0 in `dtype`, p_ref the same step (same parameters, same gradients so far)
    in float64.

    With u = eps(dtype) / 2 the unit roundoff (2^-24 in fp32), AdamW rounds about ten times
    per element per step: p0 (1 - lr wd) twice (the factor, the product), m and v three
    times each (lerp; multiply and add), sqrt(v) and its bias correction, the quotient, the
    subtraction. The m and v of step t carry the roundings of the t - 1 steps before. Each
    rounding is at most u of |p0| or of lr |m_hat| / sqrt(v_hat) <= lr R_t
    (`adam_ratio_bound`), so |p - p_ref| <= u (3 |p0| + (5 t + 8) R_t lr)
    <= (5 t + 8) R_t u (|p0| + lr). Times HEADROOM (4), as the gradient's tolerance, rounded
    up to 1, 2 or 5 times a power of ten: 5e-6 for 2 steps in fp32, 1e-5 for 3.
    """
    u = torch.finfo(dtype).eps / 2
    bound = (5 * steps + 8) * adam_ratio_bound(steps, betas) * u
    return nice_ceil(HEADROOM * bound)


# ---- running it -------------------------------------------------------------------------------


def check_equivalence(
    model_factory: Callable[[int], torch.nn.Module],
    world_size: int = 2,
    timeout_s: float = 120.0,
    loss_fn: Callable = causal_lm_loss,
    count_tokens: Callable | str | None = "auto",
    **setup,
) -> EquivalenceReport:
    """Run the windows on `world_size` gloo processes on CPU and on one process; compare.

    model_factory: a picklable callable(seed) -> module (a module-level function or a
      `functools.partial` of one) whose output for `input_ids` (b, seq_len) long is logits
      (b, seq_len, >= vocab_size) or has them as `.logits`; seeded by it, so that every rank
      and the single process build the same weights.
    loss_fn: a picklable loss_fn(model, batch) -> (loss_sum, num_tokens); `causal_lm_loss`
      by default (labels aligned with the logits).
    count_tokens: the Accumulator's (picklable), for a loss_fn that shifts labels itself.
    setup: the other fields of `EquivalenceSetup` (accum_steps, steps, wrapper, ...).
    """
    config = EquivalenceSetup(world_size=world_size, **setup)
    return check_equivalences(model_factory, [config], timeout_s, loss_fn, count_tokens)[0]


def check_equivalences(
    model_factory: Callable[[int], torch.nn.Module],
    setups: list[EquivalenceSetup],
    timeout_s: float = 120.0,
    loss_fn: Callable = causal_lm_loss,
    count_tokens: Callable | str | None = "auto",
    rank_bytes: int = 0,
) -> list[EquivalenceReport]:
    """`check_equivalence` for several setups of one world size, in one start of the ranks
    (starting processes costs seconds). rank_bytes: see `run_ranks`."""
    worlds = {s.world_size for s in setups}
    if len(worlds) != 1:
        raise ValueError(f"world sizes {sorted(worlds)}: one start of the ranks runs one")
    args = (model_factory, list(setups), loss_fn, count_tokens)
    got = run_ranks(
        run_check_ranks, worlds.pop(), args, timeout_s=timeout_s, rank_bytes=rank_bytes
    )[0]
    return [
        compare(s, g, single_process_run(model_factory, s, loss_fn=loss_fn, ranks=g))
        for s, g in zip(setups, got, strict=True)
    ]


def run_check_ranks(info: RankInfo, factory, setups, loss_fn, count_tokens) -> list | None:
    """`run_check_rank` for each setup in turn; rank 0 returns the list of outputs."""
    out = [run_check_rank(info, factory, s, loss_fn, count_tokens) for s in setups]
    return out if info.is_main else None


def rank_batches(setup: EquivalenceSetup, rank: int) -> list[dict]:
    """Rank `rank`'s micro-batches for the whole run, on CPU: 2 + rank rows each (so ranks
    hold unequal token counts), every row a random number (1..seq_len) of valid tokens."""
    k, steps, world = setup.accum_steps, setup.steps, setup.world_size
    count = steps * k
    if setup.short_rank and rank == world - 1 and world > 1:
        count = max(1, (steps - 1) * k - 1)  # a short window, then (if any) an empty one
    batches = ragged_batches(
        "gpt",
        count,
        seed=setup.seed * 1009 + rank,
        seq_len=setup.seq_len,
        batch=2 + rank,
        vocab=setup.vocab_size,
    )
    if setup.moe_balance is not None:  # the routed tokens: the real ones, a prefix of each row
        for b in batches:
            b["attention_mask"] = (b["labels"] != IGNORE_INDEX).long()
    return batches


def wrap(model: torch.nn.Module, wrapper: str, mesh=None) -> torch.nn.Module:
    """`model` under DDP, or sharded with FSDP2 over `mesh` (`sharding.shard`: each block,
    then the root; None: every rank in one shard group)."""
    if wrapper == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    return sharding.shard(model, mesh)


def hsdp_mesh(setup: EquivalenceSetup, device: torch.device):
    """The 2-D DeviceMesh (replicate, shard) of `setup.mesh_shape` for sync "hsdp"; None for
    the other policies."""
    if setup.sync != "hsdp":
        return None
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, setup.mesh_shape, mesh_dim_names=sharding.MESH_NAMES)


def run_check_rank(
    info: RankInfo,
    factory: Callable,
    setup: EquivalenceSetup,
    loss_fn: Callable = causal_lm_loss,
    count_tokens: Callable | str | None = "auto",
) -> dict | None:
    """One rank's part (any backend, on `info.device`); rank 0 returns what `compare` and
    `single_process_run` read, on CPU: the parameters before each optimizer step ("before")
    and after the last ("params"), the gradients handed to it, the reported losses, tokens,
    micro-steps, collectives and bytes per step."""
    mesh = hsdp_mesh(setup, info.device)
    model = wrap(factory(setup.seed).to(info.device), setup.wrapper, mesh)
    optimizer = adamw(model.parameters())
    grads = record_grads(optimizer)
    acc = Accumulator(
        model,
        optimizer,
        sync=setup.sync,
        sync_every_micro_batch=setup.sync_every_micro_batch,
        normalize=setup.normalize,
        count_tokens=count_tokens,
    )
    batches = [_to(b, info.device) for b in rank_batches(setup, info.rank)]
    k = 1 if setup.step_every_micro_batch else setup.accum_steps
    balance = None
    if setup.moe_balance is not None:
        balance = Balance(model, setup.moe_balance, shift=setup.moe_shift)
    before, results = [], []
    for window in aligned_windows(batches, k):
        before.append(_whole(model))  # every rank: gathering FSDP2 shards is a collective
        if balance is None:
            results.append(acc.step(window, loss_fn))
        else:
            results.append(balance.step(acc, window)[0])
    params = _whole(model)
    if not info.is_main:
        return None
    return {
        "before": before,
        "params": params,
        "grads": grads,
        "losses": [r.loss for r in results],
        "tokens": [r.tokens for r in results],
        "micro_steps": [r.micro_steps for r in results],
        "collectives": [r.grad_collectives for r in results],
        "bytes": [r.grad_bytes for r in results],
        "replica_bytes": [r.grad_replica_bytes for r in results],
    }


def _whole(model: torch.nn.Module) -> list[torch.Tensor]:
    return [full(p).detach().cpu().clone() for p in model.parameters()]


def _to(batch: dict, device: torch.device) -> dict:
    return {key: value.to(device) for key, value in batch.items()}


# ---- the single process -----------------------------------------------------------------------


def single_process_run(
    factory: Callable,
    setup: EquivalenceSetup,
    device: torch.device | str = "cpu",
    loss_fn: Callable = causal_lm_loss,
    *,
    ranks: dict,
) -> dict:
    """The global batch on one process, without the engine, at the ranks' parameters: for
    each window, every rank's micro-batches stacked into one batch, the gradient of loss
    summed over tokens / tokens at the parameters the ranks held before that window (float64
    where the model runs in it); and AdamW replayed in float64 from those parameters with
    the ranks' gradients ("after", per window); the trainable parameters' shapes
    ("shapes"). `ranks`: rank 0's `run_check_rank` output."""
    model = factory(setup.seed).to(device)
    k = setup.accum_steps
    per_rank = [rank_batches(setup, r) for r in range(setup.world_size)]
    windows = []
    for step in range(setup.steps):
        batches = [b for data in per_rank for b in data[step * k : (step + 1) * k]]
        if not batches:
            break
        windows.append(batches)
    starts = ranks["before"] if len(ranks["before"]) == len(windows) else None
    grads, losses, tokens, dtype = [], [], [], torch.float64
    previous_f = None  # the window before's token fractions, for "global-previous"
    for i, window in enumerate(windows):
        if starts is not None:
            _load(model, starts[i])
        if setup.moe_balance is None:
            ref = big_batch_reference(model, _to(big_batch(window), device), loss_fn)
            loss_sum, targets = ref.loss_sum, ref.tokens
        else:
            f = previous_f if setup.moe_balance == "global-previous" else None
            ref = moe_big_batch(model, [_to(b, device) for b in window], setup.moe_shift, f=f)
            loss_sum, targets, previous_f = ref.ce, ref.targets, ref.f
        grads.append([None if g is None else g.detach().cpu() for g in ref.grads])
        losses.append(loss_sum / targets)
        tokens.append(targets)
        dtype = ref.dtype
    after = replay_adamw(ranks["before"], ranks["grads"]) if starts is not None else []
    names = [name for name, _ in model.named_parameters()]
    shapes = [tuple(p.shape) for p in model.parameters() if p.requires_grad]
    reference = str(dtype).replace("torch.", "")
    return {
        "shapes": shapes,
        "grads": grads,
        "losses": losses,
        "tokens": tokens,
        "after": after,
        "names": names,
        "reference": reference,
    }


def _load(model: torch.nn.Module, values: list[torch.Tensor]) -> None:
    _load_tensors(list(model.parameters()), values)


def replay_adamw(before: list[list[torch.Tensor]], grads: list[list]) -> list[list[torch.Tensor]]:
    """AdamW (`adamw`) in float64, its step i taken from the parameters before[i] with the
    gradients grads[i] (None: a parameter without one): the parameters after each step, the
    optimizer's moments carried from step to step as in the run that recorded them."""
    params = [torch.zeros_like(t, dtype=torch.float64, requires_grad=True) for t in before[0]]
    optimizer = adamw(params)
    out = []
    for start, step_grads in zip(before, grads, strict=True):
        _load_tensors(params, start)
        for p, g in zip(params, step_grads, strict=True):
            p.grad = None if g is None else g.to(torch.float64)
        optimizer.step()
        out.append([p.detach().clone() for p in params])
    return out


def _load_tensors(params: list[torch.Tensor], values: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for p, v in zip(params, values, strict=True):
            p.copy_(v)


def compare(setup: EquivalenceSetup, got: dict, want: dict) -> EquivalenceReport:
    """The report for rank 0's `run_check_rank` output against `single_process_run`'s."""
    steps, windows = len(got["grads"]), len(want["tokens"])
    notes, inf = [], math.inf
    grad_error = loss_error = step_error = inf
    if steps == windows:
        grad_error = max(
            whole_rel_error(a, b) for a, b in zip(got["grads"], want["grads"], strict=True)
        )
        loss_error = max(
            abs(a - b) / abs(b) for a, b in zip(got["losses"], want["losses"], strict=True)
        )
        step_error = step_errors(got["before"], got["params"], want["after"])
    else:
        notes.append(
            f"the ranks took {steps} optimizer steps for {windows} windows: a window's "
            "gradient and step have no counterpart to compare with"
        )
    hyper = _adamw_settings()
    dtype = got["params"][0].dtype if got["params"] else torch.float32
    return EquivalenceReport(
        setup=setup,
        grad_rel_error=grad_error,
        loss_rel_error=loss_error,
        step_error=step_error,
        step_tolerance=step_tolerance(max(windows, 1), hyper["lr"], hyper["betas"], dtype),
        steps=steps,
        windows=windows,
        tokens=got["tokens"],
        tokens_expected=want["tokens"],
        grad_collectives=got["collectives"],
        grad_bytes=got["bytes"],
        traffic=traffic_check(setup, want["shapes"], got),
        reference=want["reference"],
        notes=notes,
    )


def _adamw_settings() -> dict:
    """lr, betas, eps and weight decay of the optimizer the check steps (`adamw`)."""
    return adamw([torch.zeros(1, requires_grad=True)]).defaults


def step_errors(
    before: list[list[torch.Tensor]], last: list[torch.Tensor], replayed: list[list[torch.Tensor]]
) -> float:
    """Largest over steps and elements of |p - p_ref| / (|p0| + lr): p0 = before[i], p the
    parameters after step i (before[i + 1], `last` after the last step), p_ref = replayed[i]
    (`replay_adamw`), lr the learning rate of `adamw`. `step_tolerance` bounds it."""
    lr = _adamw_settings()["lr"]
    ends = [*before[1:], last]
    worst = 0.0
    for start, end, ref in zip(before, ends, replayed, strict=True):
        p0, p, r = (torch.cat([t.flatten().double() for t in ts]) for ts in (start, end, ref))
        if p.numel():
            worst = max(worst, float(((p - r).abs_() / p0.abs_().add_(lr)).max()))
    return worst
