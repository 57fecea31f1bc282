"""The gradient traffic `verify --world-size` counted on rank 0, against the planner's.

The engine counts each gradient collective's input bytes per window (`StepResult.grad_bytes`,
HSDP's all-reduces across replicas apart); the planner (`plan.sync.policy_traffic`) gives the
bytes one rank sends on a ring. `wire_bytes` turns the first into the second, and
`traffic_check` compares them, exactly, for the same P, k, world and mesh.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

from gradaccum.plan.sync import Mesh, policy_traffic
from gradaccum.verification.world_setup import EquivalenceSetup

__all__ = ["TrafficCheck", "padded_params", "traffic_check", "wire_bytes"]


@dataclass
class TrafficCheck:
    """The gradient traffic rank 0 counted per window (`StepResult.grad_bytes`) against the
    planner's (`plan.sync.policy_traffic`) for the same P, k, world and mesh, both as bytes
    one rank sends on a ring (`wire_bytes`)."""

    policy: str
    """window, micro or hsdp."""
    replicas: int
    """Ranks each reduced gradient is all-reduced over (DDP: the world; FSDP2 1-D: 1)."""
    shards: int
    """Ranks each gradient is reduce-scattered over (DDP: 1)."""
    params: int
    """P: the trainable parameters."""
    padded_params: int
    """P_S: P with each parameter's first dimension padded to a multiple of `shards`, as FSDP2
    lays out a reduce-scatter's input; the planner's G is 4 P_S bytes."""
    micro_steps: list[int]
    """Rank 0's micro-batches per window: the planner's k."""
    collectives: list[int]
    """Gradient collectives rank 0 launched per window."""
    input_bytes: list[int]
    """Bytes rank 0 handed to them per window (each collective's input)."""
    replica_bytes: list[int]
    """Of `input_bytes`, those handed to HSDP's all-reduces across replicas."""
    counted_wire_bytes: list[int]
    """`wire_bytes` of the counted inputs per window, rounded to a byte."""
    planned_wire_bytes: list[int]
    """The planner's bytes per rank per window (intra- plus inter-node), rounded to a byte."""
    planned: str
    """The planner's collectives per window, in words."""
    equal: bool
    """Counted and planned wire bytes equal, exactly (as fractions), in every window."""


def wire_bytes(wrapper: str, replicas: int, shards: int, counted: int, replica: int) -> Fraction:
    """Bytes one rank sends on a ring for a window whose gradient collectives took `counted`
    bytes of input, `replica` of them HSDP's all-reduce across `replicas`: a reduce-scatter
    over n ranks sends (n - 1)/n of its input, an all-reduce 2 (n - 1)/n, as the planner counts
    (`plan.sync`). DDP all-reduces every bucket over the world (replicas = world), FSDP2
    reduce-scatters over its `shards`. With P_S the padded parameters and k micro-batches:
    DDP window 4P in, 2 (w-1)/w 4P sent; FSDP2 window 4 P_S in, (w-1)/w 4 P_S sent; micro
    4k P_S in, k (w-1)/w 4 P_S sent; hsdp 4k P_S + 4 P_S / S in, k (S-1)/S 4 P_S +
    2 (R-1)/R 4 P_S / S sent (R replicas, S shards)."""
    if wrapper == "ddp":
        return 2 * Fraction(replicas - 1, replicas) * counted
    scattered = counted - replica
    return Fraction(shards - 1, shards) * scattered + 2 * Fraction(replicas - 1, replicas) * replica


def padded_params(shapes: list[tuple[int, ...]], shards: int) -> int:
    """Parameters with each one's first dimension padded to a multiple of `shards`."""
    total = 0
    for shape in shapes:
        first = shape[0] if shape else 1
        rest = math.prod(shape[1:])
        total += -(-first // shards) * shards * rest
    return total


def traffic_check(setup: EquivalenceSetup, shapes: list[tuple[int, ...]], got: dict):
    """The `TrafficCheck` of rank 0's `run_check_rank` output `got`; `shapes`: the trainable
    parameters'."""
    replicas, shards = setup.mesh_shape
    padded = padded_params(shapes, shards)
    grad = 4 * padded  # fp32, as the planner counts G
    mesh = Mesh(nodes=replicas, gpus_per_node=shards) if setup.sync == "hsdp" else None
    mesh = mesh or Mesh(nodes=1, gpus_per_node=setup.world_size)
    zero = 0 if setup.wrapper == "ddp" else 3  # all-reduce, or FSDP2's reduce-scatter
    counted, planned, words = [], [], ""
    windows = zip(got["micro_steps"], got["bytes"], got["replica_bytes"], strict=True)
    for k, nbytes, replica in windows:
        counted.append(wire_bytes(setup.wrapper, replicas, shards, nbytes, replica))
        intra, inter, words = policy_traffic(setup.sync, grad, mesh, k, zero)
        planned.append(intra + inter)
    return TrafficCheck(
        policy=setup.sync,
        replicas=replicas,
        shards=shards,
        params=padded_params(shapes, 1),
        padded_params=padded,
        micro_steps=got["micro_steps"],
        collectives=got["collectives"],
        input_bytes=got["bytes"],
        replica_bytes=got["replica_bytes"],
        counted_wire_bytes=[round(b) for b in counted],
        planned_wire_bytes=[round(b) for b in planned],
        planned=words,
        equal=counted == planned,
    )
