"""Memory per device for one training step: model state, optimizer state, activations.

All figures are bytes per device (GB in reports means 1e9 bytes). P is the parameter count,
w the world size, s the sequence length, b the micro-batch in sequences, h the hidden size,
a the attention heads, L the layers, V the vocabulary.

Precision (`--precision`):
- fp32: parameters, gradients, optimizer state and activations all in 32-bit.
- bf16 / fp16 (mixed precision): parameters stored in 16-bit; the optimizer keeps fp32 master
  weights. The engine adds each 16-bit gradient into an fp32 accumulation buffer as soon as it
  is produced (a post-accumulate-grad hook) and frees the 16-bit gradient, so gradient memory is
  the fp32 buffer plus one parameter's 16-bit gradient in flight, whatever k is. fp32
  parameters need no extra buffer: their .grad is the accumulator.

ZeRO (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models"): stage 1 shards optimizer state over w, stage 2 also gradients, stage 3 also
parameters. With sharded gradients (stage 2 and 3) each micro-batch's gradient is
reduce-scattered into the shard as it is produced (`sync_every_micro_batch`); one sync per
window, the engine's default, holds the unsharded accumulated gradient until the window's end,
so gradient and buffer memory count whole unless `sync_every_micro_batch` is set.

Activations follow Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", section 4.1: per layer s b h (34 + 5 a s / h) bytes at 16 bit (no tensor
or sequence parallelism, the paper's 4h GeLU MLP; SwiGLU MLPs of width about 8h/3 keep a
similar amount). Logits for the loss are kept in fp32: 4 s b V bytes (the paper's cross-entropy
term). Every activation term is proportional to b, so memory is affine in the micro-batch.

Frozen weights (`trainable_params`, LoRA): gradients, the fp32 buffer, master weights and
optimizer state count the trainable part only; parameters and activations the whole model.
A frozen base stored in 4, 8 or 16 bits (`quantized_base`, --base-bits; `quantized`): its
packed weights and constants in the parameters term. Over a 4- or 8-bit base every other
parameter is fp32 whatever the precision (`quantized.held_in_fp32`: peft's k-bit preparation
casts the embeddings, head, norms and biases, and the adapters are created in fp32), so the
trainable part is counted as fp32 parameters are: 4 bytes each, an fp32 .grad, no buffer and
no master copy. Activations keep --precision.
"""

from __future__ import annotations

from dataclasses import dataclass

from gradaccum.plan.presets import ModelShape
from gradaccum.plan.quantized import QuantizedBase, block_linears, held_in_fp32
from gradaccum.utils.choices import PRECISIONS

DEFAULT_PRECISION = "bf16"
"""The precision a plan assumes when --precision is not given: mixed precision."""
OPTIMIZERS = ("adamw", "sgd")
CHECKPOINTING = ("none", "full")
MLP_ACTIVATIONS = ("fused", "elementwise-gelu")


@dataclass(frozen=True)
class MemorySetup:
    """How a run holds its state on each device."""

    precision: str = DEFAULT_PRECISION
    """fp32, or bf16/fp16 mixed precision (16-bit parameters, fp32 master weights)."""
    optimizer: str = "adamw"
    """adamw (two fp32 moments) or sgd (one fp32 momentum buffer)."""
    zero: int = 0
    """ZeRO stage 0-3: what is sharded over the world (1 optimizer, 2 +gradients, 3 +params)."""
    world_size: int = 1
    """Devices the state is sharded over."""
    checkpointing: str = "none"
    """none, or full: keep each layer's input only and recompute the rest in backward."""
    flash_attention: bool = False
    """Fused attention that never stores the s x s attention scores."""
    sync_every_micro_batch: bool = False
    """Reduce(-scatter) gradients after every micro-batch. Only then do ZeRO-2/3 keep the
    gradient sharded between micro-batches; with one sync per window (the engine's default)
    each device holds the whole accumulated gradient until the window's last micro-batch."""
    trainable_params: int | None = None
    """Parameters that train (LoRA adapters, unfrozen layers); None: all of them. Gradients,
    the fp32 buffer, master weights and optimizer state count these only; activations still
    cover the whole model (backward runs through every block to reach the trainable ones)."""
    mlp_activation: str = "fused"
    """fused: the MLP's activation is one kernel that keeps only its input (F.gelu, F.silu;
    the paper's count). elementwise-gelu: GELU's tanh formula written as element-wise
    operations (Hugging Face GPT-2's `gelu_new`), keeping three more tensors of the MLP's
    width: tanh's output, 0.5 x and 1 + tanh (x itself is the GELU input already counted)."""
    quantized_base: QuantizedBase | None = None
    """The part of the frozen base stored in 4, 8 or 16 bits (--base-bits), with its bytes;
    None: every parameter in the parameter dtype."""

    def __post_init__(self):
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision {self.precision!r}: expected one of {PRECISIONS}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer {self.optimizer!r}: expected one of {OPTIMIZERS}")
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"zero {self.zero}: expected a stage from 0 to 3")
        if self.world_size < 1:
            raise ValueError(f"world_size {self.world_size}: must be at least 1")
        if self.checkpointing not in CHECKPOINTING:
            raise ValueError(f"checkpointing {self.checkpointing!r}: expected {CHECKPOINTING}")
        if self.trainable_params is not None and self.trainable_params < 1:
            raise ValueError(f"trainable_params {self.trainable_params}: must be at least 1")
        if self.mlp_activation not in MLP_ACTIVATIONS:
            raise ValueError(
                f"mlp_activation {self.mlp_activation!r}: expected one of {MLP_ACTIVATIONS}"
            )

    @property
    def mixed(self) -> bool:
        return self.precision != "fp32"

    def trained(self, params: int) -> int:
        """Of `params`, how many train."""
        return params if self.trainable_params is None else min(params, self.trainable_params)

    @property
    def bytes_per_param(self) -> int:
        """Bytes per parameter in the parameter dtype and per activation element."""
        return 2 if self.mixed else 4

    @property
    def held_bytes_per_param(self) -> int:
        """Bytes per parameter not stored quantised (the trainable part, and the rest of a
        quantised base): 4 over a 4- or 8-bit base, as the trainer casts them
        (`quantized.held_in_fp32`); otherwise the parameter dtype's."""
        q = self.quantized_base
        return 4 if q is not None and held_in_fp32(q.bits) else self.bytes_per_param

    @property
    def trained_in_16_bits(self) -> bool:
        """Whether the trainable parameters are bf16/fp16: only then do they need the fp32
        accumulation buffer and fp32 master weights."""
        return self.held_bytes_per_param == 2


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per device; a term is None where the inputs do not determine it."""

    params: int | None
    grads: int | None
    """Gradients held as .grad (fp32) or in flight before the fp32 buffer takes them (16-bit)."""
    accum_buffer: int
    """The fp32 accumulation buffer of mixed precision; 0 for fp32 parameters."""
    optimizer: int
    """Optimizer moments plus fp32 master weights under mixed precision."""
    activations: int | None
    """Everything kept for backward in one micro-batch, logits included."""
    logits: int | None
    """Of `activations`: the fp32 logits kept for the loss."""
    grads_in_flight: int | None = None
    """Of `grads`: the fresh gradient of the largest trainable tensor before it is added into
    .grad or the fp32 buffer. It exists while a gradient accumulates (k >= 2, tied weights),
    so a step of one micro-batch, which `gradaccum fit` measures, does not show it."""

    @property
    def model_state(self) -> int | None:
        """The part that does not depend on the micro-batch."""
        terms = (self.params, self.grads, self.accum_buffer, self.optimizer)
        return None if None in terms else sum(terms)

    @property
    def total(self) -> int | None:
        state = self.model_state
        return None if state is None or self.activations is None else state + self.activations


def _shard(n_bytes: int, setup: MemorySetup, stage: int) -> int:
    """Bytes left on one device when ZeRO `stage` or above shards them (padded, as FSDP does).
    Gradients (stage 2) stay whole between micro-batches unless they sync every micro-batch."""
    if stage == 2 and not setup.sync_every_micro_batch:
        return n_bytes
    if setup.zero >= stage:
        return -(-n_bytes // setup.world_size)
    return n_bytes


def stored_param_bytes(params: int, setup: MemorySetup) -> int:
    """Every parameter as stored, unsharded: 4P in fp32, 2P in bf16/fp16; with a quantised
    frozen base, its bytes (`quantized.quantized_base`) plus the rest, trainable part
    included, at `held_bytes_per_param` (fp32 over a 4- or 8-bit base)."""
    q = setup.quantized_base
    if q is None:
        return setup.bytes_per_param * params
    return q.bytes + setup.held_bytes_per_param * (params - q.params)


def param_bytes(params: int, shape: ModelShape | None, setup: MemorySetup) -> int | None:
    """Stored parameters: 4P in fp32, 2P in bf16/fp16 (`stored_param_bytes`).

    ZeRO-3 shards them, but the unit that runs (a block, or the embedding, whichever is larger)
    is gathered whole: one unit whole plus the rest sharded, unit + (P - unit) / w. FSDP's
    prefetch of the next unit, overlapping communication, comes on top of this. A quantised
    base is taken at its average bytes per parameter there.
    """
    stored = stored_param_bytes(params, setup)
    if setup.zero < 3 or setup.world_size == 1:
        return stored
    if shape is None:
        return None
    unit = max(shape.layer_params, shape.vocab * shape.hidden)
    rest = -(-max(0, params - unit) // setup.world_size)
    return stored * (unit + rest) // params


def grad_bytes(params: int, shape: ModelShape | None, setup: MemorySetup) -> int | None:
    """Gradients outside the accumulation buffer.

    fp32: 4P of .grad (sharded by ZeRO-2), plus the fresh gradient of the largest tensor
    before autograd adds it into .grad. bf16/fp16: only one parameter's 16-bit gradient at a
    time, 2 x largest tensor: the hook moves it into the fp32 buffer and frees it. Under DDP
    (world > 1, ZeRO 0-1) add the reducer's gradient buckets: P x bytes per parameter.
    With `trainable_params`, P is the trainable part; over a 4- or 8-bit base it is fp32
    whatever the precision (`held_bytes_per_param`), so it takes the fp32 reading.
    """
    in_flight = grad_in_flight_bytes(params, shape, setup)
    if in_flight is None:
        return None
    trained = setup.trained(params)
    # DDP (data parallel without gradient sharding) allocates its reducer's buckets, a second
    # copy of every gradient in its parameter's dtype (gradient_as_bucket_view=False, the default).
    ddp = setup.world_size > 1 and setup.zero <= 1
    buckets = setup.held_bytes_per_param * trained if ddp else 0
    if setup.trained_in_16_bits:
        return in_flight + buckets
    return _shard(4 * trained, setup, 2) + in_flight + buckets


def grad_in_flight_bytes(params: int, shape: ModelShape | None, setup: MemorySetup) -> int | None:
    """The largest trainable tensor's fresh gradient (no larger than the trainable part)."""
    if shape is None:
        return None
    return setup.held_bytes_per_param * min(shape.largest_tensor, setup.trained(params))


def accum_buffer_bytes(params: int, setup: MemorySetup) -> int:
    """The fp32 accumulation buffer: 4P for bf16/fp16 parameters (sharded by ZeRO-2), none for
    fp32 ones (fp32 precision, or a 4- or 8-bit base's fp32 trainable part)."""
    return _shard(4 * setup.trained(params), setup, 2) if setup.trained_in_16_bits else 0


def optimizer_bytes(params: int, setup: MemorySetup) -> int:
    """AdamW: two fp32 moments, 8P. SGD with momentum: 4P. Mixed precision adds 4P fp32
    master weights (Micikevicius et al. 2018) for bf16/fp16 parameters; fp32 ones (a 4- or
    8-bit base's trainable part too) need none. ZeRO-1 and above shard all of it."""
    trained = setup.trained(params)
    moments = 8 * trained if setup.optimizer == "adamw" else 4 * trained
    master = 4 * trained if setup.trained_in_16_bits else 0
    return _shard(moments + master, setup, 1)


def layer_activation_bytes(shape: ModelShape, micro_batch: int, seq_len: int, setup) -> int:
    """One block's saved activations (Korthikanti et al. 2022, section 4.1).

    16-bit: s b h (34 + 5 a s / h) = 34 s b h + 5 a s^2 b. The 34 is 11 (attention) + 19 (MLP)
    + 4 (two LayerNorms); 32 of it are 2-byte tensors, 2 are 1-byte dropout masks. 5 a s^2 b
    is the score matrix: softmax output (2), its dropout mask (1), dropout output (2).
    fp32 doubles the 2-byte tensors: 66 s b h + 9 a s^2 b. Flash attention drops the s^2 term.
    An element-wise GELU (`mlp_activation`) keeps three more tensors of the MLP's width.
    Measured against `gradaccum fit` (fp32, CPU): the built-in GPT within 1%, Hugging Face
    GPT-2 within 8% (its CPU dropout keeps 4-byte masks where the paper counts 1 byte).
    """
    s, b, h, a = seq_len, micro_batch, shape.hidden, shape.heads
    per_sbh, per_as2b = (34, 5) if setup.mixed else (66, 9)
    scores = 0 if setup.flash_attention else per_as2b * a * s * s * b
    gelu = 0
    if setup.mlp_activation == "elementwise-gelu":
        gelu = 3 * setup.bytes_per_param * s * b * shape.ffn_size
    return per_sbh * s * b * h + scores + gelu


def activation_bytes(
    shape: ModelShape, micro_batch: int, seq_len: int, setup: MemorySetup
) -> tuple[int, int]:
    """(all activations of one micro-batch, of which logits), in bytes.

    No checkpointing: L blocks' full activations. Full checkpointing: each block keeps only its
    input, 2 s b h at 16 bit (4 s b h in fp32), and backward recomputes one block at a time, so
    one block's full activations come on top, less its input, which is the checkpoint itself
    (the first norm's input in a pre-norm block). Logits: 4 s b V, fp32 for the loss.
    """
    one_layer = layer_activation_bytes(shape, micro_batch, seq_len, setup)
    if setup.checkpointing == "full":
        block_input = setup.bytes_per_param * seq_len * micro_batch * shape.hidden
        layers = shape.layers * block_input + one_layer - block_input
    else:
        layers = shape.layers * one_layer
    logits = 4 * seq_len * micro_batch * shape.vocab
    return layers + logits, logits


def estimate(
    params: int,
    shape: ModelShape | None,
    setup: MemorySetup,
    micro_batch: int | None = None,
    seq_len: int | None = None,
) -> MemoryEstimate:
    """Every term for one device. Activations need the shape, the micro-batch and seq_len."""
    activations = logits = None
    if shape is not None and micro_batch is not None and seq_len is not None:
        activations, logits = activation_bytes(shape, micro_batch, seq_len, setup)
    return MemoryEstimate(
        params=param_bytes(params, shape, setup),
        grads=grad_bytes(params, shape, setup),
        accum_buffer=accum_buffer_bytes(params, setup),
        optimizer=optimizer_bytes(params, setup),
        activations=activations,
        logits=logits,
        grads_in_flight=grad_in_flight_bytes(params, shape, setup),
    )


def max_micro_batch(
    params: int, shape: ModelShape, setup: MemorySetup, seq_len: int, device_memory: int
) -> int:
    """Largest micro-batch (sequences) whose total fits `device_memory` bytes; 0 if none does.

    Memory is model state plus b times one sequence's activations, so the answer is exact:
    floor((device_memory - model state) / activations per sequence).
    """
    state = estimate(params, shape, setup).model_state
    per_sequence, _ = activation_bytes(shape, 1, seq_len, setup)
    if state is None or state > device_memory:
        return 0
    return (device_memory - state) // per_sequence


def unsharded_grad_bytes(params: int) -> int:
    """The accumulated gradient kept whole on each device: 4P (fp32 .grad or fp32 buffer).

    This is what one sync per window holds between micro-batches under ZeRO-2/3, where
    syncing every micro-batch would hold only 4P / w.
    """
    return 4 * params


def lora_params(shape: ModelShape, rank: int) -> int:
    """Parameters LoRA adds at rank r (Hu et al. 2021) on every linear layer of every block:
    attention's q, k, v and output projections and the MLP's two (or, gated, three) matrices,
    r x (inputs + outputs) each. Embeddings and the output head stay frozen."""
    if rank < 1:
        raise ValueError(f"rank {rank}: must be at least 1")
    matrices = block_linears(shape)
    return shape.layers * rank * sum(n_in + n_out for n_in, n_out in matrices)
