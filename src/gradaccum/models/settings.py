"""The model a command builds, and LoRA on it: settings components (no torch)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from gradaccum.settings.field import setting
from gradaccum.utils.choices import DEFAULT_MODEL, check_builtin_model
from gradaccum.utils.errors import BadInput


def read_probability(value, flag: str) -> float:
    """A probability in [0, 1): a number below 1, not negative."""
    try:
        if isinstance(value, bool):
            raise ValueError
        number = float(value)
    except (TypeError, ValueError):
        raise BadInput(flag, value, "expected a probability in [0, 1)") from None
    if not 0 <= number < 1:  # NaN fails this too
        raise BadInput(flag, f"{number:g}", "must be in [0, 1)")
    return number


@dataclass
class ModelSettings:
    """model"""

    model: str | None = setting(None, "str", metavar="PRESET", default_text=DEFAULT_MODEL)
    """The built-in GPT to build: tiny, small, gpt2-124m or tiny-moe (a mixture of experts);
    for `plan`, a model shape whose parameters and memory it counts: a published one
    (llama2-7b, ...; gpt2-124m is GPT-2's) or tiny or small (the vocabulary --vocab's, else
    the built-in corpus's)."""
    model_config: str | None = setting(None, "path")
    """A Hugging Face config.json: the causal LM it describes, random init, no download."""
    init_from: str | None = setting(None, "path", metavar="DIR")
    """A folder to start from: a checkpoint (config.json + model.pt, or a sharded run's
    sharded/) or a Hugging Face model folder with its weights, tokenizer and chat template."""
    compile: bool = setting(False, "bool")
    """torch.compile the model (needs a working compiler toolchain)."""
    activation_checkpointing: bool = setting(False, "bool")
    """Recompute activations in backward: less memory, about a third more compute."""


@dataclass
class LoraSettings:
    """LoRA: adapters on a frozen base (pip install 'gradaccum[lora]')"""

    lora_rank: int | None = setting(None, least=1, metavar="R")
    """Train LoRA adapters of rank R on the frozen model: each adapted linear layer (out x in)
    gains R x (in + out) parameters, the only ones that train."""
    lora_alpha: float | None = setting(
        None, "float", above=True, metavar="A", default_text="2 x rank"
    )
    """With --lora-rank: the adapters' update is scaled by alpha / rank."""
    lora_dropout: float | None = setting(None, parse=read_probability, metavar="P",
                                        default_text="0")  # fmt: skip
    """With --lora-rank: dropout on the adapters' input, in [0, 1); 0 keeps a run exact and
    bit-for-bit reproducible."""
    lora_targets: str | None = setting(
        None, "str", metavar="A,B", default_text="every linear layer but the output head"
    )
    """With --lora-rank: module names to adapt, e.g. q_proj,v_proj (a module matches when its
    name is the target or ends in "." + target)."""
    base_bits: int | None = setting(None, metavar="BITS")
    """With --lora-rank: the frozen base stored in 4 bits (NF4, QLoRA) or 8 (LLM.int8) through
    bitsandbytes (pip install 'gradaccum[qlora]'): the blocks' linear layers quantised, the
    adapters trained in fp32 on top."""
    base_quant: str | None = setting(None, "choice", choices=("nf4", "fp4"), default_text="nf4")
    """With --base-bits 4: the 4-bit data type, NF4 (QLoRA's) or FP4; constants double-quantised."""
    merge_lora: bool = setting(False, "bool")
    """With --lora-rank: also write the model with the adapters folded into its weights
    (--out/merged)."""


def model_source(args) -> tuple[str | None, str | None]:
    """(preset, config.json) from --model and --model-config: one or the other, a config
    that exists, the default preset when neither is given."""
    if args.model is not None and args.model_config is not None:
        raise BadInput(f"--model {args.model}: give --model or --model-config, not both")
    if args.model_config is None:
        return check_builtin_model(args.model or DEFAULT_MODEL, "--model"), None
    if not os.path.exists(args.model_config):
        raise BadInput("--model-config", args.model_config, "no such file")
    return None, args.model_config
