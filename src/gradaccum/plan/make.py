"""Plan a run: global batch = micro-batch x k x world, and what it costs in memory and time.

Pure arithmetic, no torch. `make_plan(PlanInputs(...))` resolves every number the inputs
determine and leaves the rest None (`batch`: the batch and k; `costs`: memory, time, FLOPs
and the LR); `render_table(plan)` prints it for people. A batch schedule: the plan's batch
rows describe its first phase; steps, tokens and time are the whole run's.
"""

from __future__ import annotations

from gradaccum.plan import costs
from gradaccum.plan import memory as mem
from gradaccum.plan.batch import (
    check_schedule_micro,
    choose_micro_batch,
    deviation_warning,
    resolve_accum_steps,
)
from gradaccum.plan.communication import traffic
from gradaccum.plan.inputs import PlanInputs, show_value
from gradaccum.plan.presets import ModelShape, custom, preset
from gradaccum.plan.quantized import QuantizedBase, quantized_base, stored_base
from gradaccum.plan.result import Plan
from gradaccum.plan.sync import INTER_NODE_BW, INTRA_NODE_BW, Mesh, policy_setup, sync_plan
from gradaccum.utils.errors import BadInput
from gradaccum.utils.sizes import fmt_int


def _model(i: PlanInputs) -> tuple[ModelShape | None, int | None]:
    if i.model is not None:
        shape = preset(i.model, i.seq_len, i.vocab)
        return shape, shape.params
    if i.layers is not None:
        shape = custom(i.layers, i.hidden, i.heads, i.vocab)
        return shape, i.params if i.params is not None else shape.params
    return None, i.params


def _trainable(i: PlanInputs, shape: ModelShape | None, params: int | None):
    """(parameters that train or None for all, parameters held in memory). LoRA adds its
    adapters to the model; --trainable-params names a part of it."""
    if i.lora_rank is not None:
        adapters = mem.lora_params(shape, i.lora_rank)
        return adapters, None if params is None else params + adapters
    if i.trainable_params is not None and params is not None and i.trainable_params > params:
        raise BadInput(
            "--trainable-params",
            show_value(i.trainable_params),
            f"more than the model's {fmt_int(params)} parameters",
        )
    return i.trainable_params, params


def _quantized(i: PlanInputs, shape, params, trainable) -> QuantizedBase | None:
    """The frozen base's part stored at --base-bits (None without it or without a size)."""
    if i.base_bits is None or params is None:
        return None
    if i.base_linear_weights is not None and i.base_bits < 16:  # counted on the model
        return stored_base(i.base_bits, *i.base_linear_weights)
    if i.lora_rank is not None:  # the adapters come on top of a base wholly frozen
        return quantized_base(i.base_bits, shape, params)
    return quantized_base(i.base_bits, shape, params - trainable, trained_from_base=trainable)


def make_plan(i: PlanInputs) -> Plan:
    """Resolve every number the inputs determine. Raises BadInput for inputs that make none."""
    world = i.gpus or 1
    assumed = i.gpus is None
    shape, params = _model(i)
    trainable, held = _trainable(i, shape, params)
    quantized = _quantized(i, shape, params, trainable)
    setup = costs.memory_setup(i, world, trainable, quantized)
    mesh = _mesh(i)
    # how the state is held: --sync micro and hsdp shard the gradient (auto: once chosen)
    held_setup = policy_setup(setup, i.sync, mesh) if i.sync in ("micro", "hsdp") else setup
    warnings: list[str] = []
    notes: list[str] = []
    if assumed:
        notes.append(
            "one device assumed (--gpus not given): the global batch, k and the time are for "
            "1 device; give --gpus N to plan for N"
        )
    batch, fit_cap = choose_micro_batch(i, shape, held, held_setup, world, notes)
    if i.batch_schedule is not None:
        check_schedule_micro(i, batch, world)
    global_seq, global_tok, deviation = _landing(i, batch, world, fit_cap, warnings, notes)
    k, micro_tokens = batch.accum_steps, batch.micro_tokens
    sync, held_setup, fit_cap = _sync(i, held, shape, setup, held_setup, mesh, batch, fit_cap)
    memory = costs.memory_report(
        i, shape, params, held, held_setup, batch, fit_cap, global_seq, warnings
    )
    costs.memory_notes(
        i, shape, params, trainable, held_setup, world, batch.micro_batch, warnings, notes
    )
    scheduled = costs.scheduled_run(i, params, micro_tokens, world)
    steps, total_tokens = costs.run_length(i, global_tok, scheduled)
    timing = costs.timing(i, params, global_tok, total_tokens, k, steps, world, notes, scheduled)
    lr, lr_scale, lr_rule = costs.learning_rate(i, global_tok, micro_tokens, world, setup, notes)
    target_tokens = batch.target if batch.unit == "tokens" else None
    if target_tokens is None and i.target_sequences and i.seq_len:
        target_tokens = i.target_sequences * i.seq_len
    return Plan(
        world_size=world,
        micro_batch=batch.micro_batch,
        seq_len=i.seq_len,
        micro_tokens=micro_tokens,
        accum_steps=k,
        global_batch_sequences=global_seq,
        global_batch_tokens=global_tok,
        target_tokens=target_tokens,
        target_sequences=batch.target_seq,
        target_deviation=deviation,
        steps=steps,
        total_tokens=total_tokens,
        total_tokens_requested=i.total_tokens,
        micro_step_time_s=i.micro_step_time,
        **timing,
        lr=lr,
        lr_rule=lr_rule,
        lr_scale=lr_scale,
        model=shape.name if shape else None,
        params=params,
        trainable_params=trainable,
        precision=setup.precision,
        optimizer=setup.optimizer,
        zero=held_setup.zero,
        checkpointing=setup.checkpointing,
        flash_attention=setup.flash_attention,
        memory=memory,
        communication=traffic(params, setup, k),
        sync=sync,
        micro_batch_from=batch.micro_from,
        accum_steps_from=batch.k_from,
        warnings=warnings,
        notes=notes,
        batch_schedule=scheduled,
        world_size_assumed=assumed,
        base_bits=i.base_bits,
        active_params=i.active_params,
    )


def _mesh(i: PlanInputs) -> Mesh:
    """The devices as nodes x --gpus-per-node, and the bandwidths given or assumed."""
    nodes, per_node = i.nodes_and_gpus_per_node()
    intra = i.intra_node_bw or INTRA_NODE_BW
    inter = i.inter_node_bw or INTER_NODE_BW
    return Mesh(nodes, per_node, intra, inter)


def _sync(i: PlanInputs, held, shape, setup, held_setup, mesh: Mesh, batch, fit_cap):
    """The sync policies side by side (None on one device, or without a size or k), and with
    --sync auto the setup and largest micro-batch of the one it chose."""
    world, k = i.gpus or 1, batch.accum_steps
    if world == 1 or held is None or k is None:
        return None, held_setup, fit_cap
    sync = sync_plan(
        i.sync,
        held,
        shape,
        setup,
        mesh,
        k,
        batch.micro_batch,
        i.seq_len,
        i.device_memory,
        i.base_bits,
    )
    if i.sync == "auto" and sync.policy != "window":
        held_setup = policy_setup(setup, sync.policy, mesh)
        if fit_cap is not None:
            fit_cap = mem.max_micro_batch(held, shape, held_setup, i.seq_len, i.device_memory)
    return sync, held_setup, fit_cap


def _landing(i: PlanInputs, batch, world: int, fit_cap, warnings: list, notes: list):
    """k, and the global batch it gives (micro x k x world, exactly, in sequences and tokens),
    and its signed deviation from the target; a warning past 1%."""
    resolve_accum_steps(batch, i, world)
    k, micro_batch, micro_tokens = batch.accum_steps, batch.micro_batch, batch.micro_tokens
    global_seq = micro_batch * k * world if micro_batch and k else None
    global_tok = micro_tokens * k * world if micro_tokens and k else None
    deviation = None
    if batch.target is not None and k is not None:
        landed = global_tok if batch.unit == "tokens" else global_seq
        deviation = (landed - batch.target) / batch.target
        if abs(deviation) > 0.01:
            first = "first phase: " if i.batch_schedule is not None else ""
            warnings.append(first + deviation_warning(batch, landed, world, fit_cap))
    if k is None:
        notes.append(
            "k needs a global batch (--target-tokens or --target-sequences) and a micro-batch "
            "(--micro-batch, --micro-tokens, or --device-memory with a model), or --accum-steps"
        )
    return global_seq, global_tok, deviation
