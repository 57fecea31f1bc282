"""A frozen base stored in 4 or 8 bits for LoRA (QLoRA: Dettmers et al. 2023), through
bitsandbytes (the `qlora` extra: pip install 'gradaccum[qlora]'; >= 0.47, whose CPU backend
runs the same layers without a GPU).

What is quantised, as transformers does it: every linear layer of the blocks (attention's
projections, the MLP's matrices); the embeddings, the output head, the norms, the biases and a
mixture of experts' router keep their dtype. A Hugging Face folder is loaded quantised by
transformers' `BitsAndBytesConfig` (`quantization_config`); the built-in GPT and a model built
from a config have their linear layers swapped for bitsandbytes' `Linear4bit` /
`Linear8bitLt` (`quantize_linears`), quantised from the weights they held.

- 4 bits: NF4 (or FP4, --base-quant) in blocks of 64 weights, the blocks' absmax constants
  quantised again (double quantisation); the matmul dequantises to the compute dtype (fp32 on
  the CPU, bf16 on accelerators unless --precision says otherwise), so the layer computes
  x @ dequantize(W)^T exactly in that dtype.
- 8 bits: LLM.int8 with bitsandbytes' default outlier threshold 6.0 (transformers' default):
  int8 weights with one scale per output row.

The adapters keep fp32 and train; the quantised weights never change, in any mode: on a CPU
with AVX512-BF16, bitsandbytes (>= 0.49) repacks a 4-bit layer's weight into an inference
layout the first time the layer runs in eval mode without grad, and computes it from then on
in bf16 through a kernel with no backward, in training too. `keep_training_layout` turns that
off for every layer a model holds, so an evaluation, a generation, verify or an export compute
what training computes, on every CPU (docs/reliability.md). `dequantized_weight`
and `dequantize_linears` give the weights back as ordinary tensors (the float64 reference of
`verify`, the merged export). `stored_bytes` counts what the quantised model holds, the
quantisation constants included (the memory test against the planner's figure).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import sys
import warnings

import torch
import torch.nn as nn

from gradaccum.models.quantized_spec import INT8_THRESHOLD, QuantSpec
from gradaccum.utils.errors import BadInput

MIN_VERSION = (0, 47)
"""The first bitsandbytes with a CPU backend."""
SKIPPED = ("router", "gate")
"""Linear layers left unquantised by their last name: a mixture of experts' router."""

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


HUB_LOGGER = "bitsandbytes.backends.cpu.ops"
"""The logger of bitsandbytes' warning when its CPU kernel is not fetched from the hub."""


def import_bitsandbytes() -> None:
    """Import bitsandbytes, where it is installed and not imported yet, without the `kernels`
    package in sight. On a CPU with AVX512-BF16 bitsandbytes' import calls `kernels.get_kernel`
    for a fused inference kernel: a Hugging Face hub lookup (and a download of code) at run
    time. With `kernels` hidden the import keeps bitsandbytes' own kernels; the one it would
    fetch serves only the inference layout `keep_training_layout` turns off. Call it before
    anything that imports bitsandbytes on its own (peft, trl)."""
    if "bitsandbytes" in sys.modules or importlib.util.find_spec("bitsandbytes") is None:
        return
    missing = object()
    saved = sys.modules.get("kernels", missing)
    sys.modules["kernels"] = None  # `from kernels import get_kernel` raises ImportError
    logger = logging.getLogger(HUB_LOGGER)
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        with quiet():
            import bitsandbytes  # noqa: F401
    finally:
        logger.setLevel(level)
        if saved is missing:
            sys.modules.pop("kernels", None)
        else:
            sys.modules["kernels"] = saved


def require_bitsandbytes(bits=None):
    """The bitsandbytes module; BadInput naming --base-bits when it is missing, older than
    MIN_VERSION, or refuses this platform (its own words, one line)."""
    try:
        import_bitsandbytes()
        with quiet():
            import bitsandbytes
    except ImportError:
        raise BadInput(
            "--base-bits", bits, "needs bitsandbytes >= 0.47 (pip install 'gradaccum[qlora]')"
        ) from None
    except Exception as err:  # noqa: BLE001  a platform bitsandbytes cannot load on
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise BadInput(
            "--base-bits", bits, f"bitsandbytes does not load here ({first[:160]})"
        ) from None
    version = tuple(int(p) for p in bitsandbytes.__version__.split(".")[:2] if p.isdigit())
    if version < MIN_VERSION:
        raise BadInput(
            "--base-bits",
            bits,
            f"bitsandbytes {bitsandbytes.__version__} has no CPU backend; needs >= 0.47 "
            "(pip install -U 'bitsandbytes>=0.47')",
        )
    return bitsandbytes


BNB_LOGGER = "bitsandbytes.autograd._functions"
"""The logger of bitsandbytes' notice at every forward of an LLM.int8 layer on non-fp16 inputs
("MatMul8bitLt: inputs will be cast from torch.float32 to float16")."""


@contextlib.contextmanager
def quiet():
    """bitsandbytes' per-call notices and warnings off inside the block, as they were after."""
    logger = logging.getLogger(BNB_LOGGER)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", module="bitsandbytes")
            yield
    finally:
        logger.setLevel(level)


def silence() -> None:
    """bitsandbytes' per-call notice off for the whole process (a run's every forward)."""
    logging.getLogger(BNB_LOGGER).setLevel(logging.ERROR)


def quantization_config(spec: QuantSpec):
    """transformers' BitsAndBytesConfig for `spec`."""
    from transformers import BitsAndBytesConfig

    if spec.bits == 8:
        return BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=INT8_THRESHOLD)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=spec.quant,
        bnb_4bit_use_double_quant=spec.double_quant,
        bnb_4bit_compute_dtype=DTYPES[spec.compute_dtype],
    )


def is_quantized_linear(module: nn.Module) -> bool:
    """Whether `module` is a bitsandbytes 4- or 8-bit linear layer."""
    name = type(module).__name__
    return name in ("Linear4bit", "Linear8bitLt") and type(module).__module__.startswith(
        "bitsandbytes"
    )


def quantized_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, layer) of every bitsandbytes linear layer of `model`, in module order."""
    return [(n, m) for n, m in model.named_modules() if is_quantized_linear(m)]


def _output_head(model: nn.Module):
    get = getattr(model, "get_output_embeddings", None)
    return get() if callable(get) else None


def quantizable_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The plain nn.Linear layers `quantize_linears` stores in fewer bits: all but the output
    head and a router."""
    head = _output_head(model)
    return [
        (n, m)
        for n, m in model.named_modules()
        if type(m) is nn.Linear and m is not head and n.rsplit(".", 1)[-1] not in SKIPPED
    ]


def quantize_linears(model: nn.Module, spec: QuantSpec, device="cpu") -> int:
    """Swap `model`'s block linear layers (`quantizable_layers`) for bitsandbytes layers
    holding their weights quantised on `device`; the biases keep fp32. The number swapped;
    BadInput (--base-bits) when there is none."""
    bnb = require_bitsandbytes(spec.bits)
    layers = quantizable_layers(model)
    if not layers and any(type(m).__name__ == "Conv1D" for m in model.modules()):
        raise BadInput(
            "--base-bits",
            spec.bits,
            f"{type(model).__name__} keeps its linear layers as transformers' Conv1D, which "
            "transformers quantises when it loads the model: give a folder saved with "
            "save_pretrained as --init-from",
        )
    if not layers:
        raise BadInput(
            "--base-bits",
            spec.bits,
            f"{type(model).__name__} has no linear layer to quantise (only the blocks' "
            "linear layers are stored in fewer bits)",
        )
    with quiet():
        for name, old in layers:
            new = _quantized(bnb, old, spec, device)
            parent_name, _, leaf = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, leaf, new)
    keep_training_layout(model)
    return len(layers)


def _quantized(bnb, old: nn.Linear, spec: QuantSpec, device) -> nn.Module:
    weight = old.weight.detach().to("cpu")
    bias = old.bias is not None
    if spec.bits == 4:
        new = bnb.nn.Linear4bit(
            old.in_features,
            old.out_features,
            bias=bias,
            compute_dtype=DTYPES[spec.compute_dtype],
            compress_statistics=spec.double_quant,
            quant_type=spec.quant,
            device="meta",
        )
        new.weight = bnb.nn.Params4bit(
            weight,
            requires_grad=False,
            compress_statistics=spec.double_quant,
            quant_type=spec.quant,
            module=new,
        )
    else:
        new = bnb.nn.Linear8bitLt(
            old.in_features,
            old.out_features,
            bias=bias,
            has_fp16_weights=False,
            threshold=INT8_THRESHOLD,
            device="meta",
        )
        new.weight = bnb.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=False)
    if bias:
        new.bias = nn.Parameter(old.bias.detach().to("cpu").clone(), requires_grad=False)
    return new.to(device)  # quantises the weight


INFERENCE_LAYOUT = "support_avx512bf16_for_cpu"
"""Linear4bit's switch (bitsandbytes >= 0.49) for repacking its weight in eval mode on a CPU
with AVX512-BF16; set from the CPU's flags when the layer is made."""


def keep_training_layout(model: nn.Module) -> int:
    """Keep every 4-bit layer of `model` in the layout it trains in, whatever mode it runs in
    and whatever the CPU: bitsandbytes' eval-mode repacking turned off (`INFERENCE_LAYOUT`).
    Call it on a model as soon as it is loaded or quantised, before any forward (the run, verify,
    fit and bench do; a model you load yourself with transformers' BitsAndBytesConfig too).
    RuntimeError when a layer was repacked already: its constants were rounded to bf16 and
    cannot be restored exactly. The number of 4-bit layers."""
    count = 0
    for name, layer in quantized_layers(model):
        if type(layer).__name__ != "Linear4bit":
            continue
        if hasattr(layer, INFERENCE_LAYOUT):
            setattr(layer, INFERENCE_LAYOUT, False)
        check_training_layout(name, layer)
        count += 1
    return count


def check_training_layout(name: str, layer: nn.Module) -> None:
    """RuntimeError when 4-bit `layer` holds bitsandbytes' CPU inference layout."""
    state = getattr(layer.weight, "quant_state", None)
    if getattr(state, "packing_format_for_cpu", False):
        raise RuntimeError(
            f"{name}: bitsandbytes repacked this 4-bit layer for CPU inference (it ran in eval "
            "mode before keep_training_layout was called); load the model again"
        )


def dequantized_weight(layer: nn.Module, name: str = "layer") -> torch.Tensor:
    """The weight a bitsandbytes layer computes with, (out, in), in fp32: as stored for
    training (RuntimeError for a layer in the CPU inference layout)."""
    import bitsandbytes.functional as F

    weight = layer.weight
    if type(layer).__name__ == "Linear4bit":
        check_training_layout(name, layer)
        return F.dequantize_4bit(weight.data, weight.quant_state).float()
    scb = getattr(weight, "SCB", None)
    if scb is None:
        scb = layer.state.SCB
    return weight.data.float() * (scb.float().unsqueeze(1) / 127.0)


def dequantize_linears(model: nn.Module, dtype: torch.dtype = torch.float32) -> nn.Module:
    """`model` with every bitsandbytes layer replaced by an nn.Linear holding its dequantised
    weight (and its bias) in `dtype`, in place; for a copy of the model (verify's reference,
    the merged export). Returns `model`."""
    for name, layer in quantized_layers(model):
        plain = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None,
                          device="meta")  # fmt: skip
        weight = dequantized_weight(layer, name).to(dtype)
        plain.weight = nn.Parameter(weight, requires_grad=False)
        if layer.bias is not None:
            plain.bias = nn.Parameter(layer.bias.detach().to(dtype).clone(), requires_grad=False)
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, leaf, plain)
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:  # transformers refuses to cast a model it loaded quantised
        quantizer.remove_quantization_config(model)
    return model


def quant_state_tensors(layer: nn.Module) -> list[torch.Tensor]:
    """The tensors a 4-bit layer's quantisation state holds beside its packed weight (absmax,
    the code table, the nested constants); none for another layer."""
    state = getattr(getattr(layer, "weight", None), "quant_state", None)
    if state is None:
        return []
    found = [state.absmax, state.code]
    nested = getattr(state, "state2", None)
    if nested is not None:
        found += [nested.absmax, nested.code]
    return [t for t in found if isinstance(t, torch.Tensor)]


def stored_bytes(model: nn.Module) -> int:
    """Bytes `model` holds: its parameters and buffers (a quantised weight at its packed
    size) and the 4-bit layers' quantisation constants, each tensor counted once."""
    seen, total = set(), 0
    tensors = [*model.parameters(), *model.buffers()]
    for _, layer in quantized_layers(model):
        tensors += quant_state_tensors(layer)
        state = getattr(layer, "state", None)
        for scb in (getattr(layer.weight, "SCB", None), getattr(state, "SCB", None)):
            if isinstance(scb, torch.Tensor):  # LLM.int8's row scales, where the layer keeps them
                tensors.append(scb)
    for t in tensors:
        if id(t) in seen:
            continue
        seen.add(id(t))
        total += t.numel() * t.element_size()
    return total


def prepare_for_kbit_training(model: nn.Module, checkpointing: bool = False) -> None:
    """What peft's `prepare_model_for_kbit_training` does before LoRA goes on: every base
    parameter frozen, the unquantised ones (embeddings, norms, head) cast from bf16/fp16 to
    fp32; with activation checkpointing, a transformers model's input embeddings made to
    require grad so the checkpointed blocks see an input with a gradient."""
    for p in model.parameters():
        p.requires_grad_(False)
        if p.dtype in (torch.float16, torch.bfloat16) and type(p).__name__ != "Params4bit":
            p.data = p.data.float()
    if checkpointing and hasattr(model, "enable_input_require_grads"):
        model.enable_input_require_grads()
