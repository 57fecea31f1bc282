"""The case `gradaccum verify` checks: the model from --model, --model-config or --init-from
with its loss, token count, tokenizer and precision, the window it is fed (ragged token
sequences, or --task sft examples), and the runs beyond that window: N gloo ranks against one
process, and the precision study."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from gradaccum import hf
from gradaccum.data.tokenizers import ByteTokenizer
from gradaccum.models.build import build_model
from gradaccum.models.loss import causal_lm_loss
from gradaccum.models.quantized_spec import QuantSpec, spec_of
from gradaccum.moe.router import moe_spec
from gradaccum.train.tasks.registry import rules_of
from gradaccum.utils.errors import BadInput
from gradaccum.verification.budget import RANK_BYTES_PER_PARAMETER
from gradaccum.verification.check import TOLERANCES, sample_batches
from gradaccum.verification.equivalence import EquivalenceSetup, check_equivalences
from gradaccum.verification.lint import quiet_rng
from gradaccum.verification.moe_check import check_mode
from gradaccum.verification.precision_study import derive_tolerances, precision_study, write_plot
from gradaccum.verification.qlora import (
    Adapters,
    adapt,
    check_dense,
    dequantized_reference,
    quantization_error,
)
from gradaccum.verification.sft import Reading, SFTWindow, read_examples, sft_window

BUILTIN_VOCAB = 256
SFT_VOCAB = ByteTokenizer.vocab_size
"""--task sft without --init-from: byte tokens and EOS
(`gradaccum.data.tokenizers.ByteTokenizer`)."""
WEIGHT_PRECISIONS = {torch.bfloat16: "bf16", torch.float16: "fp16"}
"""The --precision a folder's 16-bit weights are checked in when --precision is not given."""


# ---- models (module-level and picklable: the ranks of --world-size build them too) ----------


def builtin_gpt(seed: int, preset: str, vocab_size: int, seq_len: int):
    """The built-in GPT of a preset, seeded."""
    torch.manual_seed(seed)
    return build_model(preset=preset, vocab_size=vocab_size, seq_len=seq_len)[0]


def hf_causal_lm(seed: int, path: str):
    """A Hugging Face causal LM from its config, random weights, seeded, dropout off (the
    ranks and the single process would draw different masks; see
    `gradaccum.verification.lint.quiet_rng`)."""
    torch.manual_seed(seed)
    model = build_model(config_path=path)[0]
    quiet_rng(model)
    return model


def folder_model(seed: int, path: str, dtype: str):
    """The model of an --init-from folder with its own weights (`seed` draws nothing: the
    ranks take the signature of the other factories), in `dtype` ("auto": as stored, "fp32"),
    dropout off (`hf_causal_lm`)."""
    model = build_model(init_from=path, dtype=dtype)[0]
    quiet_rng(model)
    return model


@dataclass
class Case:
    """The model under check and how to feed it."""

    model: object
    description: str
    vocab_size: int
    factory: Callable
    loss_fn: Callable
    count_tokens: Callable | str
    shifted: bool
    info: object
    """The model's `ModelInfo` (parameters, layers, width, vocabulary)."""
    tokenizer: object = None
    """--task sft: the tokenizer its examples are read with (the --init-from folder's, else
    bytes); None for --task pretrain, which draws token ids."""
    precision: str = "fp32"
    """The engine's precision: --precision, or where not given the dtype the --init-from
    folder's weights are stored in (`WEIGHT_PRECISIONS`), else fp32."""
    adapters: Adapters | None = None
    """--lora-rank or --base-bits: the LoRA on the model and its quantised base
    (`verification.qlora`); None for the full model."""
    reference: object = None
    """The model the float64 big batch runs on where `model` cannot be cast to float64: with
    --base-bits, its dequantised copy with the same adapters; None: a copy of `model`."""


def build_case(args, sizes: dict) -> Case:
    """The model of --model, --model-config or --init-from, seeded as the ranks build it (a
    folder keeps its own weights); with --base-bits built quantised on the CPU, and with
    --lora-rank (or --base-bits) given LoRA adapters (`_adapt`). `sizes`: the window's
    (`cli/verify.parse_sizes`)."""
    sft = rules_of(getattr(args, "task", "pretrain")).reads_rows  # examples' tokenizer
    init_from = getattr(args, "init_from", None)
    quant = spec_of(args, "cpu")  # None without --base-bits
    try:
        if init_from is not None:
            case = _folder_case(args, sizes["seq_len"], sft, quant)
        else:
            case = _seeded_case(args, sizes, sft, quant)
        if getattr(args, "lora_rank", None) is not None:
            _adapt(case, args, sizes["seed"], quant)
    except BadInput:
        raise
    except ValueError as err:  # the model's own one-line reason, naming the flag
        raise BadInput(str(err)) from None
    case.precision = getattr(args, "precision", None) or _weights_precision(case.model)
    return case


def _seeded_case(args, sizes: dict, sft: bool, quant: QuantSpec | None = None) -> Case:
    """--model or --model-config: random weights drawn from the seed (with `quant`, quantised
    from them), byte tokens for SFT."""
    seed, seq_len = sizes["seed"], sizes["seq_len"]
    vocab = SFT_VOCAB if sft else BUILTIN_VOCAB
    if args.model_config is not None:
        source = {"config_path": args.model_config}
        factory = functools.partial(hf_causal_lm, path=args.model_config)
        loss_fn, count, shifted = hf.loss_fn, hf.count_tokens, False
    else:
        source = {"preset": args.model, "vocab_size": vocab}
        factory = functools.partial(
            builtin_gpt, preset=args.model, vocab_size=vocab, seq_len=seq_len
        )
        loss_fn, count, shifted = causal_lm_loss, "auto", True
    torch.manual_seed(seed)  # the draws of factory(seed): the weights the ranks build
    model, info = build_model(**source, seq_len=seq_len, quant=quant, device="cpu")
    if sft and info.vocab_size < SFT_VOCAB:
        raise BadInput(
            "--model-config",
            args.model_config,
            f"vocabulary of {info.vocab_size}; --task {args.task} feeds byte tokens, ids up to "
            f"{SFT_VOCAB - 1}",
        )
    words = f"{info.source} ({info.params:,} parameters)"
    tokenizer = ByteTokenizer() if sft else None
    return Case(model, words, info.vocab_size, factory, loss_fn, count, shifted, info, tokenizer)


def _folder_case(args, seq_len: int, sft: bool, quant: QuantSpec | None = None) -> Case:
    """--init-from: the folder's model with its weights, loaded in the dtype they are stored
    in unless --precision fp32 asks for fp32 (`gradaccum.models.build.build_model`, as `train`
    loads it; with `quant`, quantised from them, loaded in fp32 where the layers compute in
    fp32), and for SFT its tokenizer as `train --task sft` reads it
    (`gradaccum.train.sft.tokenizer_for`: the folder's own, bytes for a built-in GPT's
    checkpoint)."""
    from gradaccum.train.sft import tokenizer_for  # the trainer's rule, imported when used

    tokenizer = tokenizer_for(args)[0] if sft else None
    dtype = "fp32" if getattr(args, "precision", None) == "fp32" else "auto"
    if quant is not None and quant.compute_dtype == "fp32":
        # bitsandbytes' 4-bit forward dequantises in fp32 but its backward in the dtype the
        # weights were loaded in: from bf16 weights the two differ by bf16's rounding (4e-3 on
        # the adapters' gradient), which no one reference reproduces
        dtype = "fp32"
    vocab = tokenizer.vocab_size if tokenizer is not None else None
    model, info = build_model(
        init_from=args.init_from,
        vocab_size=vocab,
        seq_len=seq_len,
        dtype=dtype,
        quant=quant,
        device="cpu",
    )
    factory = functools.partial(folder_model, path=args.init_from, dtype=dtype)
    if info.kind == "hf":
        loss_fn, count, shifted = hf.loss_fn, hf.count_tokens, False
    else:
        loss_fn, count, shifted = causal_lm_loss, "auto", True
    words = f"{info.source} ({info.params:,} parameters)"
    return Case(model, words, info.vocab_size, factory, loss_fn, count, shifted, info, tokenizer)


def _adapt(case: Case, args, seed: int, quant: QuantSpec | None) -> None:
    """--lora-rank: `qlora.adapt` on the case's model. With --base-bits, first how far its
    quantised weights are from the originals (the --init-from folder loaded again, or the
    model built again from the seed: `case.factory`, unquantised), and after it the float64
    reference: the model's dequantised copy with the same adapters."""
    quantization = None
    if quant is not None:
        check_dense(case.model, quant)
        if args.init_from is not None:
            where = f"--init-from {args.init_from} loaded again without quantisation"
        else:
            where = f"the model built again from --seed {seed} without quantisation"
        quantization = quantization_error(case.model, quant, case.factory(seed), where)
    case.adapters = adapt(case.model, args.lora_rank, seed, quantization)
    if quant is not None:
        case.reference = dequantized_reference(case.model)


def _weights_precision(model: torch.nn.Module) -> str:
    """The precision of a model's 16-bit weights (`WEIGHT_PRECISIONS`), else fp32."""
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    return next((WEIGHT_PRECISIONS[d] for d in WEIGHT_PRECISIONS if d in dtypes), "fp32")


def check_beyond_window(case: Case, sizes: dict, study: bool) -> None:
    """--world-size and --precision-study run the model in fp32: refused in one line for a
    folder loaded with 16-bit weights."""
    dtypes = {p.dtype for p in case.model.parameters()}
    low = sorted(name for dtype, name in WEIGHT_PRECISIONS.items() if dtype in dtypes)
    if not low:
        return
    why = (
        f"runs on fp32 weights; the --init-from folder's are {', '.join(low)} (--precision "
        "fp32 loads them in fp32)"
    )
    if sizes["world_size"] > 1:
        raise BadInput("--world-size", sizes["world_size"], why)
    if study:
        raise BadInput("--precision-study: " + why)


def moe_mode(args, case: Case) -> str | None:
    """The load-balancing mode checked (`moe_check.check_mode`), refused in one line where
    this check cannot take it: on packed rows."""
    mode = check_mode(case.model, args.moe_balance)
    if mode is None:
        return None
    if rules_of(args.task).counts_examples and args.packing != "none":
        raise BadInput(
            "--packing",
            args.packing,
            f"a mixture of experts (--moe-balance {mode}) is checked on padded micro-batches: "
            "--packing none",
        )
    return mode


# ---- the window -------------------------------------------------------------------------


def sft_examples(args, case: Case, sizes: dict, seed: int) -> SFTWindow:
    """--task sft: k x micro-batch examples as `gradaccum train --task sft` reads them, with
    the case's tokenizer and the trainer's reading options."""
    tok = case.tokenizer
    reading = Reading(
        seq_len=sizes["seq_len"],
        tokenizer=tok,
        data_split=args.data_split,
        data_format=args.data_format,
        train_on_prompt=args.train_on_prompt,
        drop_long=args.drop_long,
        skip_bad_rows=args.skip_bad_rows,
    )
    examples = read_examples(args.data, reading, seed, sizes["k"] * sizes["micro_batch"])
    layout = "shifted" if case.shifted else "unshifted"
    return sft_window(
        examples,
        tok.pad_id,
        sizes,
        seed,
        layout,
        args.packing,
        args.micro_batch_tokens,
        tok.origin,
    )


def sample(case: Case, sizes: dict, seed: int) -> list[dict]:
    """Ragged token sequences; with an attention_mask for a mixture of experts, whose
    load-balancing loss counts the real tokens by it."""
    moe = moe_spec(case.model) is not None
    return sample_batches(
        sizes["k"], sizes["micro_batch"], sizes["seq_len"], case.vocab_size, seed, case.shifted, moe
    )


def previous_window(args, case: Case, sizes: dict) -> list[dict]:
    """--moe-balance global-previous: the window before, another draw of the same kind."""
    before = sizes["seed"] + 1
    sft = rules_of(args.task).counts_examples
    previous = sft_examples(args, case, sizes, before).micro_batches if sft else None
    return previous or sample(case, sizes, before)


# ---- beyond the window: N ranks, the precision study --------------------------------------


def world_setups(case: Case, sizes: dict, moe: str | None = None) -> list:
    """What --world-size checks: DDP and FSDP2, k micro-batches per rank, 2 windows; a mixture
    of experts with its load-balancing mode `moe`. FSDP2 syncs as --sync and --shards say
    (sizes["sync"], sizes["shards"]; default "window"), DDP once per window."""
    sync = sizes.get("sync", "window")
    return [
        EquivalenceSetup(
            world_size=sizes["world_size"],
            wrapper=wrapper,
            accum_steps=sizes["k"],
            steps=2,
            seed=sizes["seed"],
            vocab_size=case.vocab_size,
            seq_len=sizes["seq_len"],
            moe_balance=moe,
            moe_shift=not case.shifted,
            sync=sync if wrapper == "fsdp2" else "window",
            shards=sizes.get("shards") if wrapper == "fsdp2" else None,
        )
        for wrapper in ("ddp", "fsdp2")
    ]


def world_check(case: Case, sizes: dict, moe: str | None) -> list:
    """DDP and FSDP2 over N gloo ranks on CPU against one process (`EquivalenceReport`s), in
    one start of the ranks."""
    return check_equivalences(
        case.factory,
        world_setups(case, sizes, moe),
        timeout_s=600.0,
        loss_fn=case.loss_fn,
        count_tokens=case.count_tokens,
        rank_bytes=RANK_BYTES_PER_PARAMETER * case.info.params,
    )


def study(case: Case, sizes: dict, plot: str, progress: Callable[[int], None] | None) -> dict:
    """The precision study on --k-max windows of one sequence, its plot written to `plot`;
    as --json prints it. `progress(k)` after each k."""
    batches = sample_batches(
        sizes["k_max"], 1, sizes["seq_len"], case.vocab_size, sizes["seed"] + 1, case.shifted
    )
    points = precision_study(
        case.model,
        batches,
        case.loss_fn,
        count_tokens=case.count_tokens,
        seed=sizes["seed"],
        progress=progress,
    )
    written = write_plot(points, plot, title=f"window gradient error: {case.description}")
    return {
        "precision_study": [asdict(p) for p in points],
        "tolerances_derived": derive_tolerances(points),
        "tolerances_applied": dict(TOLERANCES),
        "plot": os.path.abspath(plot) if written else None,
    }
