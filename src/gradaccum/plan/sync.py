"""Gradient-sync policies over several nodes: what each holds and sends per optimizer step.

Pure arithmetic, no torch. w ranks on N nodes of n devices (w = N n), k micro-batches per
window, G = 4P bytes: the fp32 gradient of the P trainable parameters (every policy reduces in
fp32, so G does not depend on --precision).

- window: no sync until the window's last micro-batch, then one reduction of the accumulated
  gradient over the w ranks: an all-reduce (ZeRO 0-1, DDP), 2 (w-1)/w G per rank, or a
  reduce-scatter (ZeRO 2-3, FSDP2), (w-1)/w G. Gradient memory G: the whole gradient per rank
  until the sync, sharded or not.
- micro: a reduce-scatter over w after every micro-batch into an fp32 shard (FSDP2):
  k (w-1)/w G. Gradient memory G / w.
- hsdp: a 2-D mesh of r replicas x s shards, s = n (a shard group per node), r = N: a
  reduce-scatter within the node after every micro-batch, k (s-1)/s G, all intra-node, and one
  all-reduce of the fp32 shard across the replicas per window, 2 (r-1)/r G / s, all
  inter-node. Gradient memory G / s. Needs r >= 2.

A collective over all w ranks spanning nodes runs hierarchically (as NCCL does): within each
node on the whole G, then across the N nodes on the node's 1/n of it. Bytes sent per rank split
  reduce-scatter over w: intra (n-1)/n G,   inter (N-1)/N G / n   (together (w-1)/w G),
  all-reduce over w:     intra 2 (n-1)/n G, inter 2 (N-1)/N G / n (together 2 (w-1)/w G).
Sync time = intra bytes / intra-node bandwidth + inter bytes / inter-node bandwidth, both per
device and per direction: the phases one after the other, and not overlapped with backward,
so an upper bound on what the sync adds to a step.

Memory: each policy's whole per-device total (`memory.estimate`), micro and hsdp at ZeRO
max(--zero, 2) since they shard the gradient (FSDP2), hsdp's state sharded over s, not w.
`auto`: of the policies whose total fits --device-memory, the fastest; when none fits, the one
needing least memory, said as such.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from fractions import Fraction

from gradaccum.plan import memory as mem
from gradaccum.utils.choices import SYNC_POLICIES
from gradaccum.utils.sizes import fmt_bandwidth, fmt_bytes, fmt_seconds

POLICIES = SYNC_POLICIES
GPUS_PER_NODE = 8
"""Devices per node when --gpus-per-node is not given: the largest divisor of --gpus up to 8
(an 8-GPU or 8-NPU server)."""
INTRA_NODE_BW = 300e9
"""Bytes per second a device sends within a node (NVLink, HCCS), per direction: an assumed
figure, below NVLink 4's 450 GB/s and about Ascend 910B's seven HCCS links."""
INTER_NODE_BW = 400e9 / 8
"""Bytes per second a device sends to other nodes: one 400 Gb/s NIC per device (50 GB/s),
as on 8-NIC servers (DGX H100, Ascend 910B clusters)."""


@dataclass(frozen=True)
class Mesh:
    """The devices as nodes x devices per node, and the links' bandwidths (bytes/s, per device
    and direction)."""

    nodes: int
    gpus_per_node: int
    intra_node_bw: float = INTRA_NODE_BW
    inter_node_bw: float = INTER_NODE_BW

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node


def default_gpus_per_node(world: int) -> int:
    """The largest divisor of `world` up to GPUS_PER_NODE."""
    return max(d for d in range(1, min(world, GPUS_PER_NODE) + 1) if world % d == 0)


@dataclass
class PolicyCost:
    """One policy's gradient sync per optimizer step, per device."""

    policy: str
    """window, micro or hsdp."""
    collectives: str
    """What it runs per step, in words."""
    zero: int
    """The ZeRO stage its memory is counted at."""
    grad_memory_bytes: int
    """The accumulated fp32 gradient held between micro-batches: G, G / w or G / s."""
    intra_node_bytes: int
    """Bytes sent per device per step within its node."""
    inter_node_bytes: int
    """Bytes sent per device per step to other nodes."""
    sync_time_s: float
    """intra bytes / intra bandwidth + inter bytes / inter bandwidth."""
    memory_total_gb: float | None
    """Everything on the device under this policy (GB, 1e9 bytes); None without activations."""
    fits: bool | None
    """memory_total <= --device-memory; None without both."""


@dataclass
class SyncPlan:
    """The policies side by side, and the one the plan uses."""

    policy: str | None
    """The plan's policy: --sync, or auto's choice; None without --sync (the plan's memory
    rows are then --zero's, one sync per window unless --sync-every-micro-batch)."""
    why: str | None
    """With --sync auto: one line saying why this one."""
    nodes: int
    gpus_per_node: int
    intra_node_bw_gb_s: float
    """GB/s (1e9 bytes) per device per direction within a node."""
    inter_node_bw_gb_s: float
    """GB/s (1e9 bytes) per device per direction to other nodes."""
    policies: list[PolicyCost]
    """window, micro, and hsdp where the mesh has at least 2 nodes."""


def _split(grad: int, mesh: Mesh, all_reduce: bool) -> tuple[Fraction, Fraction]:
    """(intra, inter) bytes per rank of one hierarchical reduce-scatter or all-reduce of
    `grad` bytes over every rank of the mesh."""
    n, nodes = mesh.gpus_per_node, mesh.nodes
    times = 2 if all_reduce else 1
    intra = times * Fraction(n - 1, n) * grad
    inter = times * Fraction(nodes - 1, nodes) * Fraction(grad, n)
    return intra, inter


def policy_traffic(policy: str, grad: int, mesh: Mesh, k: int, zero: int):
    """(intra, inter, collectives in words) of `policy` per step: bytes per rank, exact."""
    w, n, nodes = mesh.world, mesh.gpus_per_node, mesh.nodes
    if policy == "window":
        all_reduce = zero < 2
        intra, inter = _split(grad, mesh, all_reduce)
        what = "all-reduce" if all_reduce else "reduce-scatter"
        return intra, inter, f"1 {what} over {w}, fp32"
    if policy == "micro":
        intra, inter = _split(grad, mesh, all_reduce=False)
        return k * intra, k * inter, f"{k} reduce-scatters over {w}, fp32"
    intra = k * Fraction(n - 1, n) * grad
    inter = 2 * Fraction(nodes - 1, nodes) * Fraction(grad, n)
    return intra, inter, f"{k} reduce-scatters over {n} + 1 all-reduce over {nodes}, fp32"


def policy_setup(setup: mem.MemorySetup, policy: str, mesh: Mesh) -> mem.MemorySetup:
    """How `policy` holds the state: micro and hsdp shard the gradient (ZeRO >= 2, synced every
    micro-batch), hsdp over the node's s devices only."""
    if policy == "window":
        return replace(setup, sync_every_micro_batch=False)
    world = mesh.gpus_per_node if policy == "hsdp" else setup.world_size
    zero = max(setup.zero, 2)
    return replace(setup, zero=zero, world_size=world, sync_every_micro_batch=True)


def _cost(policy, params, shape, setup, mesh, k, micro_batch, seq_len, device_memory):
    held = policy_setup(setup, policy, mesh)
    grad = mem.unsharded_grad_bytes(setup.trained(params))
    intra, inter, what = policy_traffic(policy, grad, mesh, k, held.zero)
    shards = {"window": 1, "micro": mesh.world, "hsdp": mesh.gpus_per_node}[policy]
    time = float(intra) / mesh.intra_node_bw + float(inter) / mesh.inter_node_bw
    total = mem.estimate(params, shape, held, micro_batch, seq_len).total
    fits = None if total is None or not device_memory else total <= device_memory
    return PolicyCost(
        policy=policy,
        collectives=what,
        zero=held.zero,
        grad_memory_bytes=-(-grad // shards),
        intra_node_bytes=round(intra),
        inter_node_bytes=round(inter),
        sync_time_s=time,
        memory_total_gb=None if total is None else total / 1e9,
        fits=fits,
    )


def choose(costs: list[PolicyCost], device_memory: int | None) -> tuple[str, str]:
    """auto: the fastest policy that fits --device-memory, or the one needing least memory
    when none does; (policy, why in one line)."""
    known = [c for c in costs if c.fits is not None]
    if not known:
        raise ValueError("choose: no policy's memory is known")
    fitting = [c for c in known if c.fits]
    limit = fmt_bytes(device_memory)
    if not fitting:
        least = min(known, key=lambda c: (c.memory_total_gb, c.sync_time_s))
        return least.policy, (
            f"none fits --device-memory {limit}, and this one needs the least memory, "
            f"{fmt_bytes(least.memory_total_gb * 1e9)}"
        )
    best = min(fitting, key=lambda c: (c.sync_time_s, c.memory_total_gb))
    why = f"the fastest sync ({fmt_seconds(best.sync_time_s)} per step)"
    faster = [c for c in known if c.sync_time_s < best.sync_time_s]
    if faster:
        over = ", ".join(
            f"{c.policy} ({fmt_seconds(c.sync_time_s)}) needs {fmt_bytes(c.memory_total_gb * 1e9)}"
            for c in faster
        )
        why += f" of those that fit --device-memory {limit}; {over}"
    else:
        why += f", and it fits --device-memory {limit}"
    return best.policy, why


def sync_plan(
    policy, params, shape, setup, mesh, k, micro_batch, seq_len, device_memory, base_bits=None
):
    """Every policy's cost for this plan, and the plan's own (`policy`, or auto's choice).

    `setup` is the plan's (window) MemorySetup over all w devices; `params` those held, of
    which `setup.trained` have gradients. base_bits: --base-bits; a base in 4 or 8 bits
    leaves auto window alone (`unsharded_choice`)."""
    names = [p for p in POLICIES if p != "hsdp" or mesh.nodes >= 2]
    costs = [
        _cost(p, params, shape, setup, mesh, k, micro_batch, seq_len, device_memory) for p in names
    ]
    why = None
    if policy == "auto" and base_bits is not None and base_bits < 16:
        policy, why = unsharded_choice(costs, base_bits, device_memory)
    elif policy == "auto":
        policy, why = choose(costs, device_memory)
    return SyncPlan(
        policy=policy,
        why=why,
        nodes=mesh.nodes,
        gpus_per_node=mesh.gpus_per_node,
        intra_node_bw_gb_s=mesh.intra_node_bw / 1e9,
        inter_node_bw_gb_s=mesh.inter_node_bw / 1e9,
        policies=costs,
    )


def unsharded_choice(costs: list[PolicyCost], bits: int, device_memory) -> tuple[str, str]:
    """auto with --base-bits 4 or 8: window, the one policy `gradaccum train` runs with a
    quantised base (micro and hsdp shard the model with FSDP2, which shards no 4- or 8-bit
    weights); (policy, why in one line). The others' costs stay in the table, for
    comparison."""
    window = next(c for c in costs if c.policy == "window")
    fits = "fits" if window.fits else "does not fit"
    return "window", (
        f"the only policy gradaccum train runs with --base-bits {bits} (micro and hsdp shard "
        f"the model, and a base in {bits} bits is not sharded); it {fits} --device-memory "
        f"{fmt_bytes(device_memory)}"
    )


def mesh_words(plan: SyncPlan) -> str:
    """'64 devices = 8 nodes x 8; within a node 300 GB/s, across nodes 50 GB/s per device'."""
    intra = fmt_bandwidth(plan.intra_node_bw_gb_s * 1e9)
    inter = fmt_bandwidth(plan.inter_node_bw_gb_s * 1e9)
    w = plan.nodes * plan.gpus_per_node
    return (
        f"{w} devices = {plan.nodes} node{'s' if plan.nodes != 1 else ''} x "
        f"{plan.gpus_per_node}; within a node {intra}, "
        f"across nodes {inter} per device and direction"
    )
