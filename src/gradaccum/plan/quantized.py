"""A frozen base stored in fewer bits (`--base-bits`): the bytes of its weights, constants included.

Only a frozen base is quantised (LoRA's base, QLoRA: Dettmers et al. 2023, "QLoRA: Efficient
Finetuning of Quantized LLMs"). As bitsandbytes and transformers quantise a model, only the
linear layers of the blocks are stored in 4 or 8 bits (attention's q, k, v, output and the
MLP's matrices). Everything else is held in fp32 whatever --precision says (`held_in_fp32`):
the embeddings, the output head, the norms and the biases, because peft's k-bit preparation
(`prepare_model_for_kbit_training`, which `gradaccum train` applies too) casts every
unquantised bf16/fp16 parameter to fp32; and the adapters (or the --trainable-params part),
which peft and `gradaccum.models.lora.apply_lora` create in fp32. Trainable fp32 parameters
keep their gradient in an fp32 .grad and step without a master copy (`memory`); only the
activations follow --precision.

Bytes per quantised parameter:
- 4 bits: NF4 (4-bit NormalFloat) in blocks of 64 weights, each block with an absmax
  constant, the constants themselves quantised again (double quantisation, bitsandbytes'
  default for `Linear4bit`/`Params4bit`, compress_statistics=True, and the QLoRA paper's
  setup): each block's absmax as 8 bits, with one fp32 constant per 256 blocks. Per
  parameter: 4 bits of weight + 8 / 64 bits of absmax + 32 / (64 x 256) bits of second-level
  constant = 0.5 + 1/64 + 1/4096 = 2113/4096 = 0.515869140625 bytes. (Without double
  quantisation, transformers' BitsAndBytesConfig default, the absmax is fp32: 0.5 + 4/64 =
  0.5625 bytes, 9% more; not modelled.) A tensor's few shared constants (the 256-entry code
  table, one offset) are not counted.
- 8 bits: LLM.int8 (Dettmers et al. 2022; bitsandbytes `Linear8bitLt`): an int8 weight and
  one fp32 scale per output row: 1 byte a parameter + 4 bytes a row.
- 16 bits: the frozen base in bf16/fp16, 2 bytes a parameter (what a bf16 or fp16 plan holds
  anyway; under --precision fp32 it halves the frozen part). No k-bit preparation: the rest
  and the trainable part keep the parameter dtype.
`gradaccum train --base-bits` trains on such a base (`gradaccum.models.quantized`, through
bitsandbytes); this counts its bytes.

Pure arithmetic, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from gradaccum.plan.presets import ModelShape

BASE_BITS = (4, 8, 16)
"""The --base-bits a plan takes."""

KBIT = (4, 8)
"""The --base-bits that bitsandbytes stores, and that `gradaccum train` trains on."""

NF4_BLOCK = 64
"""Weights per NF4 block (one absmax constant each)."""
DOUBLE_QUANT_BLOCK = 256
"""Absmax constants per block of the second quantisation (one fp32 constant each)."""


@dataclass(frozen=True)
class QuantizedBase:
    """The part of a frozen base stored at `bits`, and its bytes with the constants."""

    bits: int
    """4, 8 or 16."""
    params: int
    """Parameters stored at `bits` (the rest of the model: `held_in_fp32`)."""
    bytes: int
    """Their bytes: weights and quantisation constants."""
    scheme: str
    """In words: 'NF4, double-quantised constants', 'LLM.int8', '16-bit'."""


def held_in_fp32(bits: int | None) -> bool:
    """Whether a base at `bits` holds every parameter it does not quantise, trainable ones
    included, in fp32 (module docstring): 4 and 8 bits; 16 and no --base-bits keep the
    parameter dtype."""
    return bits in KBIT


def block_linears(shape: ModelShape) -> list[tuple[int, int]]:
    """(inputs, outputs) of each linear layer of one block: attention's q, k, v and output
    projections and the MLP's two (gated: three) matrices."""
    h, f = shape.hidden, shape.ffn_size
    kv = shape.num_kv_heads * (h // shape.heads)
    matrices = [(h, h), (h, kv), (h, kv), (h, h), (f, h)]
    return matrices + [(h, f)] * (2 if shape.gated_mlp else 1)


def linear_weights(shape: ModelShape) -> tuple[int, int]:
    """(weights, output rows) of the blocks' linear layers over the whole model: what
    bitsandbytes quantises (biases excluded)."""
    mats = block_linears(shape)
    return (
        shape.layers * sum(n_in * n_out for n_in, n_out in mats),
        shape.layers * sum(n_out for _, n_out in mats),
    )


def nf4_bytes(n: int) -> int:
    """Bytes of n weights in NF4 with double-quantised constants (module docstring):
    n/2 + n/64 + 4 n/16384 = 2113 n / 4096, rounded up to whole bytes."""
    return -(-2113 * n // 4096)


def int8_bytes(n: int, rows: int) -> int:
    """Bytes of n weights in LLM.int8 with `rows` output rows: n + 4 x rows."""
    return n + 4 * rows


def stored_base(bits: int, weights: int, rows: int) -> QuantizedBase:
    """`weights` linear weights with `rows` output rows stored in 4 or 8 bits, constants
    included (module docstring)."""
    if bits == 4:
        return QuantizedBase(4, weights, nf4_bytes(weights), "NF4, double-quantised constants")
    if bits == 8:
        return QuantizedBase(8, weights, int8_bytes(weights, rows), "LLM.int8")
    raise ValueError(f"bits {bits}: expected 4 or 8")


def quantized_base(
    bits: int, shape: ModelShape | None, frozen: int, trained_from_base: int = 0
) -> QuantizedBase:
    """What of a frozen base of `frozen` parameters `bits` stores, and its bytes.

    16: every frozen parameter, 2 bytes each. 4 and 8: the blocks' linear weights of `shape`
    (a shape is needed), less `trained_from_base`, parameters of the model itself that train
    (--trainable-params: counted as taken from those weights, the larger memory of the two
    readings; 0 for LoRA, whose adapters come on top of the base). 8 bits scales the rows
    of the scales in proportion.
    """
    if bits not in BASE_BITS:
        raise ValueError(f"bits {bits}: expected one of {BASE_BITS}")
    if bits == 16:
        return QuantizedBase(16, frozen, 2 * frozen, "16-bit")
    if shape is None:
        raise ValueError("a 4- or 8-bit base needs the model's shape")
    weights, rows = linear_weights(shape)
    n = min(frozen, max(0, weights - trained_from_base))
    return stored_base(bits, n, rows * n // weights)
