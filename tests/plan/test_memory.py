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


# ---- frozen base weights (LoRA) and the terms `gradaccum fit` measures ---------------------


def test_lora_params_llama2_7b_by_hand():
    # rank 16 on q, k, v, o (4096 x 4096 each) and gate, up, down (4096 x 11008), 32 blocks
    per_block = 16 * (4 * (4096 + 4096) + 3 * (4096 + 11008))
    assert mem.lora_params(LLAMA7, 16) == 32 * per_block == 39_976_960


def test_trainable_params_count_state_for_the_trainable_part_only():
    t = 40_000_000
    est = mem.estimate(P7, LLAMA7, setup(precision="bf16", trainable_params=t), 1, 2048)
    full = mem.estimate(P7, LLAMA7, setup(precision="bf16"), 1, 2048)
    assert est.params == 2 * P7  # the frozen base is still held, in 16 bits
    assert est.accum_buffer == 4 * t
    assert est.optimizer == 12 * t  # two fp32 moments and an fp32 master copy, trainable only
    assert est.activations == full.activations  # backward still runs through every block
    fp32 = mem.estimate(P7, LLAMA7, setup(precision="fp32", trainable_params=t))
    assert fp32.grads - fp32.grads_in_flight == 4 * t


def test_grads_in_flight_is_the_largest_tensor():
    fp32 = mem.estimate(P7, LLAMA7, setup(precision="fp32"))
    assert fp32.grads_in_flight == 4 * 32000 * 4096  # the embedding's fresh gradient
    assert fp32.grads - fp32.grads_in_flight == 4 * P7  # what .grad holds


def test_elementwise_gelu_keeps_three_more_mlp_tensors():
    s, b, h = 1024, 2, 768
    fused = mem.layer_activation_bytes(GPT2, b, s, setup())
    tanh_ops = mem.layer_activation_bytes(GPT2, b, s, setup(mlp_activation="elementwise-gelu"))
    assert tanh_ops - fused == 3 * 2 * s * b * 4 * h  # three bf16 tensors of width 4h
    with pytest.raises(ValueError):
        setup(mlp_activation="relu6")


def _lora_recipe(**extra):
    from gradaccum.plan import PlanInputs, make_plan

    return make_plan(
        PlanInputs(
            model="llama2-7b",
            precision="bf16",
            device_memory=24 * 10**9,
            seq_len=2048,
            micro_batch=1,
            checkpointing="full",
            target_tokens=32_768,
            **extra,
        )
    )


def test_7b_lora_on_a_24gb_card_fits_and_full_training_does_not():
    lora = _lora_recipe(lora_rank=16)
    assert lora.accum_steps == 32_768 // 2048 == 16
    assert lora.memory.fits is True
    assert lora.memory.optimizer_gb == pytest.approx(12 * 39_976_960 / 1e9)
    given = _lora_recipe(trainable_params=40_000_000)
    assert given.accum_steps == 16 and given.memory.fits is True
    full = _lora_recipe()
    assert full.accum_steps == 16 and full.memory.fits is False


def test_plan_cli_trainable_params(capsys):
    import json

    from gradaccum.cli import main

    base = "plan --model llama2-7b --device-memory 24GB --seq-len 2048 --micro-batch 1"
    base += " --checkpointing full --target-tokens 32k --json"
    assert main([*base.split(), "--trainable-params", "40M"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["accum_steps"] == 16 and d["memory"]["fits"] is True
    assert main([*base.split(), "--lora-rank", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--lora-rank 0" in err
    assert main(["plan", "--lora-rank", "8", "--params", "7B"]) == 2
    assert "--lora-rank 8" in capsys.readouterr().err
    assert main(["plan", "--trainable-params", "8B", "--model", "llama2-7b"]) == 2
    assert "--trainable-params 8B" in capsys.readouterr().err
