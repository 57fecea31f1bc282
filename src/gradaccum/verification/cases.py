"""The case `gradaccum verify` checks: the model from --model or --model-config with its loss
and token count, the window it is fed (ragged token sequences, or --task sft examples), and
the runs beyond that window: N gloo ranks against one process, and the precision study."""

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
from gradaccum.moe.router import moe_spec
from gradaccum.utils.errors import BadInput
from gradaccum.verification.budget import RANK_BYTES_PER_PARAMETER
from gradaccum.verification.check import TOLERANCES, sample_batches
from gradaccum.verification.equivalence import EquivalenceSetup, check_equivalences
from gradaccum.verification.lint import quiet_rng
from gradaccum.verification.moe_check import check_mode
from gradaccum.verification.precision_study import derive_tolerances, precision_study, write_plot
from gradaccum.verification.sft import SFTWindow, sft_window

BUILTIN_VOCAB = 256
SFT_VOCAB = ByteTokenizer.vocab_size
"""--task sft: byte tokens and EOS (`gradaccum.data.tokenizers.ByteTokenizer`)."""


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


def build_case(args, sizes: dict) -> Case:
    """The model of --model or --model-config, seeded as the ranks build it; `sizes`: the
    window's (`cli/verify.parse_sizes`)."""
    seed, seq_len = sizes["seed"], sizes["seq_len"]
    sft = getattr(args, "task", "pretrain") == "sft"
    vocab = SFT_VOCAB if sft else BUILTIN_VOCAB
    try:
        if args.model_config is not None:
            model, info = build_model(config_path=args.model_config, seq_len=seq_len)
            factory = functools.partial(hf_causal_lm, path=args.model_config)
            loss_fn, count, shifted = hf.loss_fn, hf.count_tokens, False
        else:
            model, info = build_model(preset=args.model, vocab_size=vocab, seq_len=seq_len)
            factory = functools.partial(
                builtin_gpt, preset=args.model, vocab_size=vocab, seq_len=seq_len
            )
            loss_fn, count, shifted = causal_lm_loss, "auto", True
    except BadInput:
        raise
    except ValueError as err:  # the model's own one-line reason, naming the flag
        raise BadInput(str(err)) from None
    if sft and info.vocab_size < SFT_VOCAB:
        raise BadInput(
            "--model-config",
            args.model_config,
            f"vocabulary of {info.vocab_size}; --task sft feeds byte tokens, ids up to "
            f"{SFT_VOCAB - 1}",
        )
    model.load_state_dict(factory(seed).state_dict())  # the seeded weights the ranks build
    words = f"{info.source} ({info.params:,} parameters)"
    return Case(model, words, info.vocab_size, factory, loss_fn, count, shifted, info)


def moe_mode(args, case: Case) -> str | None:
    """The load-balancing mode checked (`moe_check.check_mode`), refused in one line where
    this check cannot take it: on packed rows."""
    mode = check_mode(case.model, args.moe_balance)
    if mode is None:
        return None
    if args.task == "sft" and args.packing != "none":
        raise BadInput(
            "--packing",
            args.packing,
            f"a mixture of experts (--moe-balance {mode}) is checked on padded micro-batches: "
            "--packing none",
        )
    return mode


# ---- the window -------------------------------------------------------------------------


def sft_examples(args, case: Case, sizes: dict, seed: int) -> SFTWindow:
    """--task sft: k x micro-batch examples as `gradaccum train --task sft` reads them."""
    layout = "shifted" if case.shifted else "unshifted"
    return sft_window(
        args.data,
        sizes["k"],
        sizes["micro_batch"],
        sizes["seq_len"],
        seed,
        layout,
        args.packing,
        args.micro_batch_tokens,
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
    sft = args.task == "sft"
    previous = sft_examples(args, case, sizes, before).micro_batches if sft else None
    return previous or sample(case, sizes, before)


# ---- beyond the window: N ranks, the precision study --------------------------------------


def world_setups(case: Case, sizes: dict, moe: str | None = None) -> list:
    """What --world-size checks: DDP and FSDP2, k micro-batches per rank, 2 windows; a mixture
    of experts with its load-balancing mode `moe`."""
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
