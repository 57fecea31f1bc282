"""What --base-bits and --base-quant ask for, checked (no torch): the settings' side of
`gradaccum.models.quantized`."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from gradaccum.utils.errors import BadInput

TRAIN_BITS = (4, 8)
"""The --base-bits `gradaccum train`, `fit` and `verify` take (plan also takes 16)."""
QUANT_TYPES = ("nf4", "fp4")
"""--base-quant: the 4-bit data type."""
DEFAULT_QUANT = "nf4"
INT8_THRESHOLD = 6.0
"""LLM.int8's outlier threshold (bitsandbytes' and transformers' default)."""
COMPUTE_DTYPES = ("fp32", "bf16", "fp16")


@dataclass(frozen=True)
class QuantSpec:
    """How the frozen base is stored and computed."""

    bits: int
    """4 or 8."""
    quant: str = DEFAULT_QUANT
    """4 bits: nf4 or fp4."""
    double_quant: bool = True
    """4 bits: the blocks' absmax constants quantised again."""
    compute_dtype: str = "fp32"
    """fp32, bf16 or fp16: the dtype a 4-bit layer dequantises to for its matmul."""

    def __post_init__(self):
        if isinstance(self.bits, bool) or self.bits not in TRAIN_BITS:
            raise BadInput("--base-bits", self.bits, "expected 4 (NF4, QLoRA) or 8 (LLM.int8)")
        if self.quant not in QUANT_TYPES:
            raise BadInput("--base-quant", self.quant, f"expected one of {', '.join(QUANT_TYPES)}")
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"QuantSpec: compute_dtype {self.compute_dtype!r}")

    def record(self) -> dict:
        """What a checkpoint records of it (a resume must match it)."""
        if self.bits == 8:
            return {"bits": 8, "scheme": "llm.int8", "threshold": INT8_THRESHOLD}
        return {**asdict(self), "blocksize": 64}

    def describe(self) -> str:
        if self.bits == 8:
            return f"8-bit LLM.int8 (outlier threshold {INT8_THRESHOLD:g})"
        double = ", double-quantised constants" if self.double_quant else ""
        return (
            f"4-bit {self.quant.upper()} in blocks of 64{double}, computed in {self.compute_dtype}"
        )


def check_base_flags(
    base_bits, base_quant, lora_rank, default_rank: int | None = None
) -> int | None:
    """--base-bits is 4 or 8 (QuantSpec), --base-quant needs --base-bits 4, and a quantised
    base trains adapters only: without --lora-rank, `default_rank` (verify's and bench's) or
    one line naming --base-bits. The LoRA rank to use."""
    if base_bits is not None:
        QuantSpec(base_bits, base_quant or DEFAULT_QUANT)  # 4 or 8, nf4 or fp4
        if lora_rank is None and default_rank is None:
            raise BadInput(
                "--base-bits",
                base_bits,
                "a quantised base cannot be trained in full; give --lora-rank R to train "
                "adapters on it (QLoRA)",
            )
        lora_rank = lora_rank or default_rank
    if base_quant is not None and base_bits != 4:
        raise BadInput("--base-quant", base_quant, "needs --base-bits 4")
    return lora_rank


def compute_dtype_for(precision: str | None, device_type: str) -> str:
    """The compute dtype of a 4-bit layer: --precision's when it names one, else bf16 on an
    accelerator and fp32 on the CPU."""
    if precision in COMPUTE_DTYPES:
        return precision
    return "fp32" if device_type == "cpu" else "bf16"


def spec_of(config, device_type: str) -> QuantSpec | None:
    """The QuantSpec a config (train's, fit's, verify's) asks for: None without --base-bits."""
    bits = getattr(config, "base_bits", None)
    if bits is None:
        return None
    return QuantSpec(
        bits,
        getattr(config, "base_quant", None) or DEFAULT_QUANT,
        compute_dtype=compute_dtype_for(getattr(config, "precision", None), device_type),
    )
