"""What was built, in numbers (`ModelInfo`), and the check that the data fits the model."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from gradaccum.utils.errors import BadInput


@dataclass
class ModelInfo:
    source: str
    """What was built, in words: "preset tiny", "HF gpt2 from PATH", "checkpoint DIR"."""
    kind: str
    """"gpt" (the built-in GPT) or "hf" (a transformers model)."""
    params: int
    """Parameters (tied weights counted once)."""
    layers: int
    """Transformer blocks."""
    hidden: int
    """Width of the residual stream."""
    heads: int
    """Attention heads per block."""
    vocab_size: int
    """Tokens the model can read and predict."""
    seq_len: int
    """Longest sequence the model reads, in tokens."""
    config: dict
    """What to write to a checkpoint's config.json so `init_from` can rebuild the model."""
    active_params: int | None = None
    """Parameters one token runs through: a mixture of experts counts only the top-k experts
    each token is routed to (the built-in GPT's `active_params`); None: all of `params`
    (a dense model, or a Hugging Face model, not counted). FLOPs per token are about 6 times
    this, memory holds `params`."""

    def to_dict(self) -> dict:
        return asdict(self)


def check_fits(flag: str, value, model_vocab: int, model_seq: int, vocab_size, seq_len) -> None:
    """BadInput naming `flag value` when the data's `vocab_size` token ids or its `seq_len`
    tokens per sequence (None: not known) exceed the model's vocabulary or positions."""
    if vocab_size is not None and vocab_size > model_vocab:
        raise BadInput(
            f"{flag} {value}: the data has {vocab_size} token ids but the model's vocabulary "
            f"holds {model_vocab}"
        )
    if seq_len is not None and seq_len > model_seq:
        raise BadInput(
            f"{flag} {value}: sequences of {seq_len} tokens exceed the model's {model_seq} positions"
        )
