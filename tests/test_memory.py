import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradaccum.plan import memory as mem
from gradaccum.plan.presets import ModelShape, preset

LLAMA7 = preset("llama2-7b")
P7 = 6_738_415_616  # published Llama 2 7B parameter count
GPT2 = preset("gpt2-124m")
P_GPT2 = 124_439_808


def setup(**kw):
    return mem.MemorySetup(**kw)


def test_llama2_7b_bf16_adamw_by_hand():
    est = mem.estimate(P7, LLAMA7, setup(precision="bf16", optimizer="adamw"))
    assert est.params == 2 * P7  # 16-bit parameters
    assert est.accum_buffer == 4 * P7  # fp32 accumulation buffer
    assert est.optimizer == (4 + 4 + 4) * P7  # two fp32 moments + fp32 master weights
    assert est.grads == 2 * 32000 * 4096  # one 16-bit gradient in flight: the embedding
    assert est.params / 1e9 == pytest.approx(13.476831232)
    assert est.activations is None  # no micro-batch given


def test_fp32_adamw_by_hand():
    est = mem.estimate(P7, LLAMA7, setup(precision="fp32"))
    assert est.params == 4 * P7
    assert est.grads == 4 * P7 + 4 * 32000 * 4096  # .grad, plus the fresh one before it is added
    assert est.accum_buffer == 0  # fp32 parameters accumulate in place
    assert est.optimizer == 8 * P7  # no master copy


def test_sgd_by_hand():
    assert mem.estimate(P7, LLAMA7, setup(optimizer="sgd")).optimizer == (4 + 4) * P7
    assert mem.estimate(P7, LLAMA7, setup(optimizer="sgd", precision="fp32")).optimizer == 4 * P7


def test_zero_stages_shard_by_hand():
    w = 8
    z1 = mem.estimate(P7, LLAMA7, setup(zero=1, world_size=w))
    assert z1.optimizer == 12 * P7 // w and z1.accum_buffer == 4 * P7 and z1.params == 2 * P7
    # ZeRO-2 shards the gradient only when it syncs every micro-batch; one sync per window
    # holds the whole accumulated fp32 gradient until the window's end
    z2 = mem.estimate(P7, LLAMA7, setup(zero=2, world_size=w, sync_every_micro_batch=True))
    assert z2.accum_buffer == 4 * P7 // w and z2.params == 2 * P7
    z2_window = mem.estimate(P7, LLAMA7, setup(zero=2, world_size=w))
    assert z2_window.accum_buffer == 4 * P7
    z3 = mem.estimate(P7, LLAMA7, setup(zero=3, world_size=w))
    block = 202_383_360  # one Llama 2 7B block, larger than the 131M embedding
    assert z3.params == 2 * (block + (P7 - block) // w)  # (P7 - block) divides by 8


def test_ddp_buckets_add_one_gradient_copy_by_hand():
    one = mem.estimate(P7, LLAMA7, setup(precision="fp32"))
    ddp = mem.estimate(P7, LLAMA7, setup(precision="fp32", world_size=8))
    assert ddp.grads - one.grads == 4 * P7  # DDP's fp32 buckets
    mixed = mem.estimate(P7, LLAMA7, setup(world_size=8))
    assert mixed.grads == 2 * LLAMA7.largest_tensor + 2 * P7  # one bf16 grad + bf16 buckets
    fsdp = mem.estimate(P7, LLAMA7, setup(world_size=8, zero=2))
    assert fsdp.grads == 2 * LLAMA7.largest_tensor  # no DDP reducer under ZeRO-2/3


def test_activations_gpt2_by_hand():
    s, b, h, a, layers, v = 1024, 2, 768, 12, 12, 50257
    one_layer = s * b * h * 34 + 5 * a * s * s * b  # Korthikanti: s b h (34 + 5 a s / h)
    logits = 4 * s * b * v
    total, of_which_logits = mem.activation_bytes(GPT2, b, s, setup())
    assert of_which_logits == logits
    assert total == layers * one_layer + logits
    flash, _ = mem.activation_bytes(GPT2, b, s, setup(flash_attention=True))
    assert flash == layers * 34 * s * b * h + logits
    full, _ = mem.activation_bytes(GPT2, b, s, setup(checkpointing="full"))
    assert full == (layers - 1) * 2 * s * b * h + one_layer + logits
    fp32, _ = mem.activation_bytes(GPT2, b, s, setup(precision="fp32"))
    assert fp32 == layers * (66 * s * b * h + 9 * a * s * s * b) + logits


def test_max_micro_batch_by_hand():
    s = 1024
    st_ = setup()
    state = 2 * P_GPT2 + 2 * 50257 * 768 + 4 * P_GPT2 + 12 * P_GPT2
    per_seq = 12 * (34 * s * 768 + 5 * 12 * s * s) + 4 * s * 50257
    assert mem.estimate(P_GPT2, GPT2, st_).model_state == state
    assert mem.max_micro_batch(P_GPT2, GPT2, st_, s, state + 3 * per_seq) == 3
    assert mem.max_micro_batch(P_GPT2, GPT2, st_, s, state + 3 * per_seq - 1) == 2
    assert mem.max_micro_batch(P_GPT2, GPT2, st_, s, state - 1) == 0


def test_setup_validation():
    with pytest.raises(ValueError, match="precision"):
        setup(precision="fp8")
    with pytest.raises(ValueError, match="zero 4"):
        setup(zero=4)


# Properties -------------------------------------------------------------------------------------

shapes = st.builds(
    lambda layers, head_dim, heads, vocab, gated: ModelShape(
        "t", layers, head_dim * heads, heads, vocab, gated_mlp=gated, tied_embeddings=not gated
    ),
    st.integers(1, 96),
    st.sampled_from([16, 64, 128]),
    st.integers(1, 64),
    st.integers(2, 200_000),
    st.booleans(),
)
setups = st.builds(
    mem.MemorySetup,
    precision=st.sampled_from(mem.PRECISIONS),
    optimizer=st.sampled_from(mem.OPTIMIZERS),
    zero=st.integers(0, 3),
    world_size=st.integers(1, 1024),
    checkpointing=st.sampled_from(mem.CHECKPOINTING),
    flash_attention=st.booleans(),
)
seq_lens = st.integers(1, 32768)


def total(shape, s, b, seq_len):
    return mem.estimate(shape.params, shape, s, b, seq_len).total


@settings(max_examples=60)
@given(shapes, setups, seq_lens, st.integers(1, 512))
def test_memory_grows_with_micro_batch(shape, s, seq_len, b):
    assert total(shape, s, b, seq_len) <= total(shape, s, b + 1, seq_len)


@settings(max_examples=60)
@given(shapes, setups, seq_lens, st.integers(1, 512))
def test_activations_linear_in_micro_batch(shape, s, seq_len, b):
    one, logits_one = mem.activation_bytes(shape, 1, seq_len, s)
    many, logits_many = mem.activation_bytes(shape, b, seq_len, s)
    assert many == b * one and logits_many == b * logits_one


@settings(max_examples=60)
@given(shapes, setups, seq_lens, st.integers(1, 64))
def test_checkpointing_and_flash_never_increase(shape, s, seq_len, b):
    base = mem.MemorySetup(s.precision, s.optimizer, s.zero, s.world_size, "none", False)
    ckpt = mem.MemorySetup(s.precision, s.optimizer, s.zero, s.world_size, "full", False)
    flash = mem.MemorySetup(s.precision, s.optimizer, s.zero, s.world_size, "none", True)
    assert total(shape, ckpt, b, seq_len) <= total(shape, base, b, seq_len)
    assert total(shape, flash, b, seq_len) <= total(shape, base, b, seq_len)


@settings(max_examples=60)
@given(shapes, setups, seq_lens, st.integers(1, 64))
def test_zero_never_increases(shape, s, seq_len, b):
    by_stage = [
        total(shape, mem.MemorySetup(s.precision, s.optimizer, z, s.world_size), b, seq_len)
        for z in range(4)
    ]
    assert by_stage == sorted(by_stage, reverse=True)


@settings(max_examples=60)
@given(shapes, setups, st.integers(1, 8192), st.integers(1, 200 * 10**9))
def test_max_micro_batch_is_the_largest_that_fits(shape, s, seq_len, device_memory):
    b = mem.max_micro_batch(shape.params, shape, s, seq_len, device_memory)
    if b > 0:
        assert total(shape, s, b, seq_len) <= device_memory
    assert total(shape, s, b + 1, seq_len) > device_memory
