"""From a TrainConfig and the batch its task asks for (`BatchRequest`) to the numbers a run
trains with: micro-batch, k, steps, warmup.

The batch arithmetic is gradaccum.plan's, the same `gradaccum plan` prints: k =
round(tokens_per_step / (micro_batch x seq_len x world)), at least 1, and the table says how
far the real batch lands from the target. A `--micro-batch auto` still unsettled (not
measured) is settled here by `micro_batch.unmeasured`, see `gradaccum.train.micro_batch`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from gradaccum.models import quantized
from gradaccum.models.gpt import GPT, GPTConfig
from gradaccum.models.info import ModelInfo
from gradaccum.parallel import devices, sharding
from gradaccum.plan import Plan, PlanInputs, make_plan, render_table
from gradaccum.train import adapters, micro_batch
from gradaccum.train.batch_request import BatchRequest
from gradaccum.train.batching import targets
from gradaccum.train.config import AUTO, TrainConfig
from gradaccum.train.tasks import rules_of
from gradaccum.utils.errors import BadInput

MAX_ACCUM_STEPS = 65536
"""Most micro-batches one window may hold: the trainer fetches a window's micro-batches
before the first backward (to count its tokens), so k bounds host memory."""


@dataclass
class Resolved:
    """The run's batch and length as planned: the plan's numbers, plus the warmup. The run's
    batch (`BatchState`) reads its first micro-batch, k and steps from here once; from then
    on it alone says what the run trains at."""

    plan: Plan
    """The plan `gradaccum plan` would print for this run (memory estimate included)."""
    warmup_steps: int
    """Optimizer steps of LR warmup."""
    sync: str = "window"
    """How the ranks sync the window's gradient: window (DDP), micro or hsdp (the model
    sharded by FSDP2): --sync, or the policy --sync auto chose."""
    sync_why: str | None = None
    """With --sync auto: why that policy, in words."""

    @property
    def shards_model(self) -> bool:
        """The model is sharded with FSDP2 (micro or hsdp)."""
        return self.sync in ("micro", "hsdp")

    @property
    def micro_batch(self) -> int:
        """Sequences per forward/backward on each rank."""
        return self.plan.micro_batch

    @property
    def accum_steps(self) -> int:
        """Micro-batches per optimizer step (k)."""
        return self.plan.accum_steps

    @property
    def tokens_per_step(self) -> int:
        """micro_batch x seq_len x k x world: tokens per optimizer step, as planned (a batch
        schedule's first)."""
        return self.plan.global_batch_tokens

    @property
    def total_steps(self) -> int:
        """Optimizer steps of the whole run."""
        return self.plan.steps

    @property
    def table(self) -> str:
        """The plan as `gradaccum plan` shows it."""
        return render_table(self.plan)


def resolve_run(
    config: TrainConfig,
    request: BatchRequest,
    model_info,
    rank_info,
    epoch_tokens: int | None = None,
) -> Resolved:
    """The plan of a run of `config` (on `rank_info`'s ranks and device) for the batch
    `request` (the task's, `Task.batch_request`); a schedule's plan is its first batch, its
    lr rule and its phases. epoch_tokens: a pretraining run's --epochs in tokens
    (`epochs.pretrain_epoch_tokens`), rounded up to whole steps as --max-tokens is; with
    --max-steps or --max-tokens too, the run is the shorter."""
    schedule = None if config.batch_schedule == AUTO else config.batch_schedule
    world, device = rank_info.world_size, rank_info.device
    if epoch_tokens is not None and request.max_steps is None:
        request = request.but(total_tokens=min(request.total_tokens or epoch_tokens, epoch_tokens))
    linears = base_linear_weights(model_info) if config.base_bits else None
    plan = dict(batch_schedule=schedule, base_linears=linears, request=request)
    resolved = resolve_plan(config, model_info, world, device, **plan)
    if epoch_tokens is not None and request.max_steps is not None:
        steps = -(-epoch_tokens // resolved.tokens_per_step)
        if steps < resolved.total_steps:
            plan["request"] = request.but(max_steps=steps)
            resolved = resolve_plan(config, model_info, world, device, **plan)
    return resolved


def _no_whole_sequence(
    config: TrainConfig, request: BatchRequest, flag: str, smallest: int, world_size: int
):
    """The BadInput for a step of `smallest` tokens below one sequence per rank. Without
    --tokens-per-step (its default in force) the user's --seq-len is what overflowed it, so
    the line names --seq-len and the bound; else the target that was given."""
    seq_len, one_each = config.seq_len, config.seq_len * world_size
    if request.tokens_per_step is None and config.batch_schedule is None:
        return BadInput(
            "--seq-len",
            seq_len,
            f"one sequence on each of {world_size} rank(s) is {one_each} tokens, more than "
            f"a step's --tokens-per-step {smallest} (the default); give --seq-len at most "
            f"{smallest // world_size} or --tokens-per-step at least {one_each}",
        )
    what = ""
    if config.batch_schedule not in (None, AUTO):  # name the point, not a flag not given
        what = f"its smallest target, {smallest} tokens per step, is "
    return BadInput(
        f"{flag}: {what}below one sequence of --seq-len {seq_len} on each of {world_size} rank(s)"
    )


def resolve_plan(
    config: TrainConfig,
    model_info,
    world_size: int,
    device: torch.device,
    batch_schedule: str | None = None,
    base_linears: tuple[int, int] | None = None,
    request: BatchRequest | None = None,
) -> Resolved:
    """Micro-batch, k, steps and warmup for `config` on `device`; BadInput if none. A
    --batch-schedule run's batch rows are its first window's. With a (fixed)
    `batch_schedule`, the plan covers the whole run phase by phase with its --lr-rule and
    --lr, as `gradaccum plan --batch-schedule ... --base-lr ... --lr-rule ...` prints it.
    base_linears: with --base-bits, the model's linear layers stored in 4 or 8 bits
    (`base_linear_weights`); None: the plan counts them from the shape. request: the batch
    to plan (`BatchRequest`); None: the settings' own (`BatchRequest.of(config)`)."""
    request = request or BatchRequest.of(config)
    seq_len, k = config.seq_len, request.accum_steps
    target, smallest, flag = targets(config, request)
    base = dict(
        seq_len=seq_len,
        gpus=world_size,
        params=model_info.params,
        active_params=model_info.active_params,
        layers=model_info.layers,
        hidden=model_info.hidden,
        heads=model_info.heads,
        vocab=model_info.vocab_size,
        precision=config.precision,
        checkpointing="full" if config.activation_checkpointing else "none",
        flash_attention=device.type == "cuda",
        device_memory=devices.total_memory_bytes(device),
        trainable_params=adapters.trainable_params(model_info),  # LoRA: the frozen-base memory
        base_bits=config.base_bits,  # QLoRA: the base's linear layers in 4 or 8 bits
        base_linear_weights=base_linears,
    )
    per_rank_seq = None if target is None else smallest // (seq_len * world_size)
    if target is not None and per_rank_seq < 1:
        raise _no_whole_sequence(config, request, flag, smallest, world_size)

    micro = request.micro_batch
    if micro == AUTO:
        micro = micro_batch.unmeasured(seq_len, k, target, per_rank_seq, base, device)
    elif target is not None and k is not None and micro * seq_len * k * world_size != target:
        raise BadInput(
            f"--accum-steps {k}: --micro-batch {micro} x --seq-len {seq_len} x k x "
            f"{world_size} rank(s) is {micro * seq_len * k * world_size} tokens, not "
            f"--tokens-per-step {target}; give two of the three"
        )

    length = (
        {"steps": request.max_steps}
        if request.max_steps is not None
        else {"total_tokens": request.total_tokens}
    )
    batch = {"accum_steps": k} if k is not None else {"target_tokens": target}
    if batch_schedule is not None:
        batch = {"batch_schedule": batch_schedule, "lr_rule": config.lr_rule, "base_lr": config.lr}
    sizes = dict(micro_batch=micro, **batch, **length, **base)
    sync, why = (config.sync or "window"), None
    if config.sync == AUTO:
        sync, why = auto_sync(config, world_size, device, sizes)
    if sync in ("micro", "hsdp"):  # FSDP2 shards parameters, gradients and optimizer state
        sizes.update(sync=sync, zero=3, gpus_per_node=sharding.per_node(world_size))
    plan = make_plan(PlanInputs(**sizes))
    if plan.accum_steps > MAX_ACCUM_STEPS:
        raise BadInput(
            f"--tokens-per-step {plan.global_batch_tokens}: {plan.accum_steps:,} micro-batches "
            f"of {micro} x {seq_len} tokens per step, more than {MAX_ACCUM_STEPS:,}; "
            "use a larger --micro-batch or more ranks"
        )
    steps = plan.steps
    if config.warmup_steps is not None and config.warmup_steps > steps:
        raise BadInput(f"--warmup-steps {config.warmup_steps}: longer than the run ({steps} steps)")
    return Resolved(plan=plan, warmup_steps=config.warmup(steps), sync=sync, sync_why=why)


def auto_sync(config: TrainConfig, world: int, device: torch.device, sizes: dict):
    """--sync auto: (the policy, why in words). The planner's choice (`gradaccum plan --sync
    auto`: the fastest sync whose memory fits the device) among those this run can take;
    window where nothing is to be sharded or chosen by (one process, a task, a 4- or 8-bit
    base or --compile that is not sharded, a device whose memory is not known)."""
    not_sharded = (
        rules_of(config.task).not_sharded and f"--task {config.task} is not sharded",
        config.base_bits and f"a base in {config.base_bits} bits is not sharded",
        config.compile and "--compile runs on the model whole",
    )
    if world == 1:
        return "window", "one process: no ranks to sync"
    for why in not_sharded:
        if why:
            return "window", why
    if sizes["device_memory"] is None:
        return "window", (
            f"the memory of a {device.type} device is not known, and window is the fastest "
            "sync: nothing to shard for"
        )
    per_node = sharding.per_node(world)
    plan = make_plan(PlanInputs(**sizes, sync=AUTO, gpus_per_node=per_node))
    if plan.sync is None:  # a batch the planner does not cost the policies for
        return "window", "the planner cannot compare the policies for this batch: window"
    policy, why = plan.sync.policy, plan.sync.why
    if policy == "hsdp" and sharding.hsdp_shape(world, per_node) is None:
        return "micro", f"{why}; hsdp needs 2 ranks a node or more: micro"
    return policy, why


def base_linear_weights(model_info: ModelInfo) -> tuple[int, int] | None:
    """(weights, output rows) of the linear layers a 4- or 8-bit base stores in fewer bits,
    counted on the run's model rebuilt from its config on the meta device (shapes, no
    memory): every linear layer but the output head and a router (`models.quantized`), and
    transformers' Conv1D (GPT-2's), which transformers quantises as linear layers. The plan's
    shape from layers, width and heads is a GPT block's (a 4h MLP, keys and values of full
    width); this is the model's own (a gated MLP of its width, grouped key/value heads,
    experts). None when the config does not rebuild: the plan then counts from the shape."""
    try:
        with torch.device("meta"):
            model = _skeleton(model_info)
    except (ImportError, ValueError, TypeError, KeyError):
        return None
    weights = rows = 0
    for _, layer in quantized.quantizable_layers(model):
        weights += layer.in_features * layer.out_features
        rows += layer.out_features
    for layer in model.modules():
        if type(layer).__name__ == "Conv1D":  # weight (in, out), out = nf
            weights += layer.weight.numel()
            rows += layer.nf
    return (weights, rows) if weights else None


def _skeleton(model_info: ModelInfo) -> torch.nn.Module:
    """The model `model_info` describes, built from its config alone (its LoRA record and a
    quantised model's quantization_config left out)."""
    config = {
        k: v
        for k, v in model_info.config.items()
        if k not in (adapters.RECORD, "quantization_config")
    }
    if model_info.kind == "gpt":
        names = {f.name for f in fields(GPTConfig)}
        return GPT(GPTConfig(**{k: v for k, v in config.items() if k in names}))
    from transformers import AutoConfig, AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
