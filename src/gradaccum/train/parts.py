"""What a run trains with: its data, its model placed on the device, and its optimizer.

A new run and a resumed one (`build.fresh`, `build.resumed`) take them from here, so both train
the same way: the model placed with activation checkpointing first, then torch.compile, then
DDP (so the engine still sees DDP and its no_sync), and the same AdamW groups (a resumed
optimizer's state loads into them). With --lora-rank the adapters are in the model from the
moment it is built (`adapters.attach`), so all three wrap the adapted model and the optimizer
gets the adapters alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.parallel import DistributedDataParallel

from gradaccum.data.tokens import DataInfo, TokenDataset
from gradaccum.hf import packed_positions_supported
from gradaccum.models.build import build_model
from gradaccum.models.checkpointing import set_checkpointing
from gradaccum.models.info import ModelInfo
from gradaccum.models.optimizer import adamw
from gradaccum.models.quantized_spec import spec_of
from gradaccum.parallel import sharding
from gradaccum.parallel.process_group import RankInfo
from gradaccum.train import adapters, eval_set, moe
from gradaccum.train.config import TrainConfig
from gradaccum.train.rundir import checkpoint
from gradaccum.utils.errors import BadInput, first_line

ADAM_BETAS = (0.9, 0.95)
"""AdamW's betas in training (nanoGPT, GPT-3): a shorter second-moment memory than torch's
0.999, steadier at the large LRs of small models."""


@dataclass
class Data:
    """The run's tokens: the training split, the held-out split, and what they are."""

    train: TokenDataset
    val: TokenDataset
    info: DataInfo
    eod_id: int | None = None
    """The end-of-document id each micro-batch is document-masked at (--document-mask);
    None: no document mask, the micro-batches as before."""


def load_data(config: TrainConfig) -> Data:
    """Pretraining's tokens: --data read and split, or all of it and --eval-data
    (`eval_set.pretrain_tokens`); BadInput naming --data (or --eval-data) when it cannot be.
    (A fine-tuning run's examples: `sft.load_data`.)"""
    try:
        data = Data(*eval_set.pretrain_tokens(config))  # --eval-data, --eval-fraction
    except BadInput:
        raise
    except (ValueError, OSError, ImportError) as err:
        raise BadInput("--data", config.data or "(built-in)", first_line(err)) from None
    data.eod_id = document_eod(config, data.info)
    return data


def document_eod(config: TrainConfig, info: DataInfo) -> int | None:
    """The id --document-mask cuts at: --eod-id, else the data's own end-of-document id;
    None without --document-mask. BadInput when the data marks no document ends and none is
    given, or the id is outside the data's vocabulary."""
    if not config.document_mask:
        return None
    if config.eod_id is None:
        if info.eod_token is None:
            raise BadInput(
                "--document-mask",
                None,
                f"--data {config.data} marks no document ends; give --eod-id N, the id that "
                "ends each document (its tokenizer's end-of-text id, e.g. 50256 for GPT-2)",
            )
        return info.eod_token
    if config.eod_id >= info.vocab_size:
        raise BadInput(
            "--eod-id",
            config.eod_id,
            f"outside the data's vocabulary of {info.vocab_size} ids",
        )
    return config.eod_id


def document_mask_lines(data: Data) -> list[str]:
    """The opening line of a --document-mask run; none without it."""
    if data.eod_id is None:
        return []
    return [
        "document mask: attention within each document, each end-of-document id "
        f"{data.eod_id} opening the next one at position 0"
    ]


def check_document_mask(config: TrainConfig, model: torch.nn.Module, info: ModelInfo) -> None:
    """--document-mask needs a model that keeps documents apart: the built-in GPT reads
    document ids; a Hugging Face model must honour restarting position ids, measured
    (`gradaccum.hf.packed_positions_supported`: three forwards of 8 tokens). BadInput if not."""
    if not config.document_mask or getattr(model, "reads_document_ids", False):
        return
    if info.kind != "hf" or not packed_positions_supported(model):
        raise BadInput(
            "--document-mask",
            None,
            f"{type(model).__name__} does not keep packed documents apart (its attention "
            "ignores restarting position ids); train without --document-mask",
        )


def new_model(
    config: TrainConfig, data_info: DataInfo, device="cpu"
) -> tuple[torch.nn.Module, ModelInfo]:
    """A new run's model: --model, --model-config or --init-from, sized for the data; with
    --base-bits, its blocks' linear layers in 4 or 8 bits on `device`; with --lora-rank, the
    adapters on it and the base frozen (`adapters.attach`)."""
    model, info = build_model(
        preset=config.preset,
        config_path=config.model_config,
        init_from=config.init_from,
        vocab_size=data_info.vocab_size,
        seq_len=config.seq_len,
        quant=spec_of(config, torch.device(device).type),
        device=device,
    )
    check_document_mask(config, model, info)
    moe.check(config, model)  # --moe-balance fits the model
    return adapters.attach(model, info, config)


def checkpoint_model(
    config: TrainConfig, data_info: DataInfo, path: str, device="cpu"
) -> tuple[torch.nn.Module, ModelInfo]:
    """A resumed run's model as trained: the config.json and weights of the checkpoint at
    `path`; BadInput naming --resume when the data no longer fits it. A LoRA checkpoint holds
    the adapters only: the base is built again as the new run built it (`adapters`)."""
    if config.lora_rank is not None:
        return adapters.resumed_model(config, path, *new_model(config, data_info, device))
    try:
        model, info = build_model(  # a sharded checkpoint's weights: `payload.restore`
            init_from=path, vocab_size=data_info.vocab_size, seq_len=config.seq_len,
            weights=not checkpoint.is_sharded(path),
        )  # fmt: skip
    except BadInput as err:
        raise BadInput(
            "--resume", config.out, f"the checkpoint's model does not fit ({err.why or err})"
        ) from None
    check_document_mask(config, model, info)
    moe.check(config, model)
    return model, info


def place(
    model: torch.nn.Module, config: TrainConfig, rank_info: RankInfo, sync: str
) -> torch.nn.Module:
    """`model` on the rank's device with --activation-checkpointing and --compile, under DDP
    when there are several ranks, or sharded with FSDP2 (`sharding.shard`) when the run's
    `sync` (--sync, or auto's choice) is micro or hsdp."""
    device = rank_info.device
    model.to(device)
    if config.activation_checkpointing and not set_checkpointing(model, True):
        raise BadInput(
            "--activation-checkpointing",
            None,
            f"{type(model).__name__} cannot recompute its "
            "activations (no set_activation_checkpointing or gradient_checkpointing_enable)",
        )
    if sync in ("micro", "hsdp"):
        world = rank_info.world_size
        return sharding.shard(model, sharding.mesh_of(sync, world, device))
    if config.compile:  # before DDP, so the engine still sees DDP and its no_sync
        model = torch.compile(model)
    if rank_info.world_size > 1:
        ids = [device.index] if device.type not in ("cpu", "mps") else None
        model = DistributedDataParallel(model, device_ids=ids)
    return model


def check_sync(config: TrainConfig, rank_info: RankInfo) -> None:
    """--sync micro and hsdp shard over several ranks, hsdp over at least two nodes of at
    least two ranks each (the replicas are the nodes); BadInput naming --sync otherwise."""
    if not config.shards_model:
        return
    world = rank_info.world_size
    if world == 1:
        raise BadInput(
            "--sync", config.sync, "one process has no ranks to sync: run it under torchrun"
        )
    per_node = sharding.per_node(world)
    if config.sync == "hsdp" and sharding.hsdp_shape(world, per_node) is None:
        raise BadInput(
            "--sync",
            "hsdp",
            f"{world} ranks, {per_node} per node, do not make a mesh of replicas x shards "
            "(each node one replica of at least 2 ranks, at least 2 nodes): use --sync micro",
        )


def whole_model(
    model: torch.nn.Module, config: TrainConfig, data_info: DataInfo, keep: bool
) -> torch.nn.Module | None:
    """A model sharded with FSDP2 as one plain model on the CPU where `keep` (the run's
    model built again, `new_model`, with the gathered weights), None elsewhere; a
    collective: every rank calls it."""
    state = sharding.full_state(model, keep)
    if not keep:
        return None
    plain = new_model(config, data_info)[0]
    plain.load_state_dict(state)
    return plain


def optimizer(model: torch.nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    """The run's AdamW: --lr and --weight-decay, the decay on matrices and embeddings only."""
    return adamw(
        model,
        lr=config.lr,
        weight_decay=config.weight_decay,
        betas=ADAM_BETAS,
        eps=1e-8,
        decay_matrices_only=True,
    )


def unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The model itself, under DDP's `module` and torch.compile's `_orig_mod` (a model sharded
    with FSDP2 is the model itself, its parameters sharded)."""
    if isinstance(model, DistributedDataParallel):
        model = model.module
    return getattr(model, "_orig_mod", model)
