"""Decoder-only transformer shapes, and their exact parameter counts derived from the shape.

The count is built from the tensors each architecture really has (fused or not, biases or not),
so it matches what the released checkpoints report (e.g. Llama 2 7B: 6,738,415,616).
"""

from __future__ import annotations

from dataclasses import dataclass

from gradaccum.utils.choices import BUILTIN_MODELS


@dataclass(frozen=True)
class ModelShape:
    """The shape of a decoder-only transformer, enough to count parameters and activations."""

    name: str
    """Preset name, or 'custom' for a shape given on the command line."""
    layers: int
    """Number of transformer blocks."""
    hidden: int
    """Model width h (the residual stream), in elements."""
    heads: int
    """Attention heads a."""
    vocab: int
    """Vocabulary size V (rows of the embedding)."""
    kv_heads: int | None = None
    """Key/value heads for grouped-query attention; None means as many as `heads`."""
    ffn: int | None = None
    """Width of the MLP's inner layer; None means 4 x hidden."""
    gated_mlp: bool = False
    """SwiGLU-style MLP with three matrices (gate, up, down) instead of two."""
    biases: bool = False
    """Linear layers and norms carry biases (GPT-2); Llama has none."""
    tied_embeddings: bool = True
    """The output projection shares the input embedding's weights."""
    positions: int = 0
    """Rows of a learned position embedding (GPT-2: 1024); 0 for rotary positions."""

    def __post_init__(self):
        for field in ("layers", "hidden", "heads", "vocab"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field} {getattr(self, field)}: must be at least 1")
        if self.hidden % self.heads:
            raise ValueError(f"hidden {self.hidden} is not divisible by heads {self.heads}")
        if self.heads % self.num_kv_heads:
            raise ValueError(f"heads {self.heads} not divisible by kv_heads {self.num_kv_heads}")

    @property
    def num_kv_heads(self) -> int:
        return self.heads if self.kv_heads is None else self.kv_heads

    @property
    def ffn_size(self) -> int:
        return 4 * self.hidden if self.ffn is None else self.ffn

    @property
    def _norm(self) -> int:
        """Parameters in one norm: LayerNorm with bias has 2h, RMSNorm (no bias) h."""
        return 2 * self.hidden if self.biases else self.hidden

    @property
    def layer_params(self) -> int:
        """Parameters in one transformer block."""
        h, f = self.hidden, self.ffn_size
        kv = self.num_kv_heads * (h // self.heads)
        attention = h * h + 2 * h * kv + h * h  # q, k, v, output projections
        mlp = (3 if self.gated_mlp else 2) * h * f
        if self.biases:
            attention += h + 2 * kv + h
            mlp += (2 if self.gated_mlp else 1) * f + h
        return attention + mlp + 2 * self._norm

    @property
    def embedding_params(self) -> int:
        """Token embedding, learned positions, and the output projection when it is not tied."""
        h = self.hidden
        output = 0 if self.tied_embeddings else self.vocab * h
        return self.vocab * h + self.positions * h + output

    @property
    def params(self) -> int:
        """Total parameter count: blocks, embeddings, final norm."""
        return self.layers * self.layer_params + self.embedding_params + self._norm

    @property
    def largest_tensor(self) -> int:
        """Elements of the largest parameter tensor: its gradient is the largest in flight."""
        h = self.hidden
        kv = self.num_kv_heads * (h // self.heads)
        qkv = h * (h + 2 * kv) if self.biases else h * h  # GPT-2 fuses q, k, v into one matrix
        return max(self.vocab * h, h * self.ffn_size, qkv)


MODEL_SHAPES: dict[str, ModelShape] = {
    shape.name: shape
    for shape in (
        # Radford et al. 2019; the Hugging Face `gpt2` and `gpt2-medium` checkpoints.
        ModelShape("gpt2-124m", 12, 768, 12, 50257, biases=True, positions=1024),
        ModelShape("gpt2-350m", 24, 1024, 16, 50257, biases=True, positions=1024),
        # Touvron et al. 2023 (Llama 2), Table 1 and the released configs.
        ModelShape(
            "llama2-7b", 32, 4096, 32, 32000, ffn=11008, gated_mlp=True, tied_embeddings=False
        ),
        ModelShape(
            "llama2-13b", 40, 5120, 40, 32000, ffn=13824, gated_mlp=True, tied_embeddings=False
        ),
        ModelShape(
            "llama2-70b",
            80,
            8192,
            64,
            32000,
            kv_heads=8,
            ffn=28672,
            gated_mlp=True,
            tied_embeddings=False,
        ),
        # Meta Llama 3 8B config: GQA with 8 key/value heads, 128k vocabulary.
        ModelShape(
            "llama3-8b",
            32,
            4096,
            32,
            128256,
            kv_heads=8,
            ffn=14336,
            gated_mlp=True,
            tied_embeddings=False,
        ),
    )
}


BUILTIN_VOCAB = 512
"""The built-in corpus's vocabulary (`gradaccum.data.corpus.MarkovCorpus.vocab_size`): the
built-in GPT's when the plan is given no --vocab (the trainer takes it from the data)."""

BUILTIN_POSITIONS = 128
"""The trainer's --seq-len default: the built-in GPT's learned positions when the plan is
given no --seq-len."""


BUILTIN_ONLY = tuple(n for n in BUILTIN_MODELS if n not in MODEL_SHAPES)
"""Presets of the built-in GPT whose names no published shape takes (gpt2-124m is GPT-2's)."""


def preset(name: str, seq_len: int | None = None, vocab: int | None = None) -> ModelShape:
    """The shape called `name` (case-insensitive): a published model's (MODEL_SHAPES, where
    gpt2-124m is GPT-2's own), or a dense preset of the built-in GPT (`builtin_shape`, its
    positions `seq_len` and vocabulary `vocab`); KeyError listing the known names otherwise."""
    key = name.strip().lower()
    if key in MODEL_SHAPES:
        return MODEL_SHAPES[key]
    dense = [n for n, spec in BUILTIN_MODELS.items() if "n_expert" not in spec]
    if key in dense:
        return builtin_shape(key, seq_len, vocab)
    known = ", ".join([*MODEL_SHAPES, *(n for n in dense if n not in MODEL_SHAPES)])
    if key in BUILTIN_MODELS:  # a ModelShape has no experts to count
        raise KeyError(f"a mixture of experts: the plan counts dense shapes only; known: {known}")
    raise KeyError(f"unknown model {name!r}; known: {known}")


def builtin_shape(name: str, seq_len: int | None, vocab: int | None) -> ModelShape:
    """The built-in GPT preset `name` (`BUILTIN_MODELS`) as `gradaccum train --model` builds
    it: GPT-2's layout (biases, fused q, k, v, a learned position per token of `seq_len`, the
    head tied), its vocabulary the data's (`vocab`, default the built-in corpus's)."""
    spec = BUILTIN_MODELS[name]
    return ModelShape(
        name,
        spec["n_layer"],
        spec["n_embd"],
        spec["n_head"],
        BUILTIN_VOCAB if vocab is None else vocab,
        biases=True,
        positions=BUILTIN_POSITIONS if seq_len is None else seq_len,
    )


def custom(layers: int, hidden: int, heads: int, vocab: int) -> ModelShape:
    """A shape from --layers/--hidden/--heads/--vocab: GPT-style, 4h MLP, tied, no biases."""
    return ModelShape("custom", layers, hidden, heads, vocab)
