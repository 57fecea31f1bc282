import json
import math
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradaccum.plan import PlanError, PlanInputs, accum_steps_for, make_plan, render_table

P7 = 6_738_415_616  # Llama 2 7B

SPEC_FIELDS = {
    "world_size",
    "micro_batch",
    "seq_len",
    "micro_tokens",
    "accum_steps",
    "global_batch_sequences",
    "global_batch_tokens",
    "target_tokens",
    "target_deviation",
    "steps",
    "total_tokens",
    "step_time_s",
    "total_time_h",
    "device_hours",
    "flops_total",
    "lr",
    "memory",
    "warnings",
}
SPEC_MEMORY = {
    "params_gb",
    "grads_gb",
    "accum_buffer_gb",
    "optimizer_gb",
    "activations_gb",
    "total_gb",
    "fits",
    "max_micro_batch",
}


def test_target_tokens_by_hand():
    plan = make_plan(PlanInputs(target_tokens=1_000_000, seq_len=4096, micro_batch=4, gpus=8))
    # 4 x 4096 = 16,384 tokens per micro-batch; x 8 devices = 131,072 per micro-step.
    # 1,000,000 / 131,072 = 7.63 -> k = 8 -> 8 x 131,072 = 1,048,576 tokens.
    assert plan.micro_tokens == 16_384
    assert plan.accum_steps == 8
    assert plan.global_batch_tokens == 1_048_576
    assert plan.global_batch_sequences == 4 * 8 * 8
    assert plan.target_deviation == pytest.approx(48_576 / 1_000_000)
    assert len(plan.warnings) == 1 and "+4.9%" in plan.warnings[0]


def test_exact_target_has_no_warning():
    plan = make_plan(PlanInputs(target_tokens=4 * 2**20, seq_len=4096, micro_batch=4, gpus=8))
    assert plan.accum_steps == 4 * 2**20 // (4 * 4096 * 8) == 32
    assert plan.target_deviation == 0
    assert plan.warnings == []


def test_target_sequences_and_micro_tokens():
    plan = make_plan(PlanInputs(target_sequences=512, micro_tokens=8192, seq_len=2048, gpus=4))
    # 8192 / 2048 = 4 sequences; 512 / (4 x 4) = 32
    assert (plan.micro_batch, plan.accum_steps, plan.global_batch_tokens) == (4, 32, 512 * 2048)


def test_round_half_goes_to_the_larger_batch():
    # 10 / (4 x 1) = 2.5: k = 2 gives 8 and k = 3 gives 12, both 2 away; the tie goes up.
    plan = make_plan(PlanInputs(target_sequences=10, micro_batch=4))
    assert plan.accum_steps == 3 and plan.global_batch_sequences == 12


def test_k_is_at_least_one_and_warns():
    plan = make_plan(PlanInputs(target_sequences=10, micro_batch=8, gpus=4))
    assert plan.accum_steps == 1 and plan.global_batch_sequences == 32
    assert "alone is 32 sequences" in plan.warnings[0]


def test_warning_suggests_an_exact_micro_batch():
    plan = make_plan(PlanInputs(target_sequences=256, micro_batch=6, gpus=8))
    # 256 / 48 = 5.33 -> k = 5 -> 240; micro-batch 4 gives 256 / 32 = 8 exactly
    assert plan.global_batch_sequences == 240
    assert "--micro-batch 4 lands exactly (k = 8)" in plan.warnings[0]


def test_micro_batch_above_target():
    with pytest.raises(PlanError, match="^--micro-batch 300: above the target of 256 sequences"):
        make_plan(PlanInputs(target_sequences=256, micro_batch=300))


def test_accum_steps_given():
    plan = make_plan(PlanInputs(accum_steps=16, micro_batch=2, seq_len=1024, gpus=2))
    assert plan.global_batch_tokens == 2 * 1024 * 16 * 2
    assert plan.target_tokens is None and plan.target_deviation is None


def test_steps_time_flops_by_hand():
    plan = make_plan(
        PlanInputs(
            target_tokens=4 * 2**20,
            seq_len=4096,
            micro_batch=4,
            gpus=8,
            micro_step_time=0.3,
            steps=1000,
            model="llama2-7b",
        )
    )
    assert plan.step_time_s == pytest.approx(32 * 0.3)
    assert plan.total_time_h == pytest.approx(1000 * 9.6 / 3600)
    assert plan.device_hours == pytest.approx(8 * 1000 * 9.6 / 3600)
    assert plan.total_tokens == 1000 * 4_194_304
    assert plan.flops_total == 6 * P7 * 1000 * 4_194_304


def test_a_mixture_of_experts_counts_the_flops_of_its_active_parameters_only():
    """Memory holds every parameter; each token runs through its top-k experts' share."""
    common = dict(target_tokens=2**20, seq_len=1024, micro_batch=4, steps=10, params=8 * 10**9)
    dense = make_plan(PlanInputs(**common))
    moe = make_plan(PlanInputs(**common, active_params=2 * 10**9))
    assert moe.flops_total == 6 * 2 * 10**9 * 10 * 2**20
    assert dense.flops_total == 4 * moe.flops_total
    assert moe.memory.params_gb == dense.memory.params_gb == 16.0  # bf16: 2 bytes each
    assert "6 N D, N = 2B active" in render_table(moe) and "active" not in render_table(dense)


def test_total_tokens_rounds_steps_up():
    plan = make_plan(
        PlanInputs(target_tokens=2**20, seq_len=1024, micro_batch=8, total_tokens=10**9)
    )
    # 1e9 / 1,048,576 = 953.67 -> 954 steps -> 954 x 1,048,576 tokens
    assert plan.steps == 954
    assert plan.total_tokens == 954 * 1_048_576 == 1_000_341_504
    assert plan.total_tokens_requested == 10**9


def test_time_from_peak_and_mfu_by_hand():
    plan = make_plan(
        PlanInputs(
            target_tokens=4 * 10**6,
            seq_len=2000,
            micro_batch=250,
            gpus=8,
            total_tokens=10**12,
            params=7 * 10**9,
            peak_tflops=989,
            mfu=0.4,
        )
    )
    flops = 6 * 7e9 * 1e12  # steps = 250,000 exactly, so total tokens = 1e12
    assert plan.flops_total == pytest.approx(flops)
    assert plan.device_hours == pytest.approx(flops / (989e12 * 0.4) / 3600)
    assert plan.total_time_h == pytest.approx(flops / (989e12 * 0.4) / 3600 / 8)
    assert plan.step_time_s == pytest.approx(6 * 7e9 * 4e6 / (8 * 989e12 * 0.4))


def test_measured_time_gives_mfu():
    plan = make_plan(
        PlanInputs(
            accum_steps=4,
            micro_batch=2,
            seq_len=1024,
            gpus=2,
            params=10**9,
            micro_step_time=0.25,
            peak_tflops=100,
        )
    )
    # 6 x 1e9 x 16,384 tokens in 4 x 0.25 s on 2 devices of 100 TFLOP/s
    assert plan.mfu_implied == pytest.approx(6e9 * 16384 / (1.0 * 2 * 100e12))


@pytest.mark.parametrize(
    "rule, factor", [("linear", 4.0), ("sqrt", 2.0), ("none", 1.0), (None, 2.0)]
)
def test_lr_scaling(rule, factor):
    plan = make_plan(
        PlanInputs(
            target_tokens=4 * 2**20,
            seq_len=4096,
            micro_batch=4,
            gpus=8,
            base_lr=3e-4,
            base_batch_tokens=2**20,
            lr_rule=rule,
        )
    )
    assert plan.lr == pytest.approx(3e-4 * factor)  # c = 4; adamw's default is sqrt


def test_sgd_defaults_to_linear_lr():
    plan = make_plan(
        PlanInputs(
            accum_steps=2, micro_tokens=1000, base_lr=0.1, base_batch_tokens=1000, optimizer="sgd"
        )
    )
    assert plan.lr_rule == "linear" and plan.lr == pytest.approx(0.2)


def test_undetermined_fields_are_none():
    plan = make_plan(PlanInputs(micro_batch=4))
    d = plan.to_dict()
    for name in ("accum_steps", "global_batch_tokens", "steps", "total_time_h", "lr", "seq_len"):
        assert d[name] is None
    assert all(v is None for v in d["memory"].values())
    assert d["communication"] is None


def test_json_fields():
    d = make_plan(
        PlanInputs(
            model="gpt2-124m",
            target_tokens=2**19,
            seq_len=1024,
            micro_batch=8,
            gpus=2,
            device_memory=80 * 10**9,
        )
    ).to_dict()
    assert SPEC_FIELDS <= set(d)
    assert SPEC_MEMORY <= set(d["memory"])
    assert d["memory"]["fits"] is True and d["memory"]["max_micro_batch"] > 8


def test_memory_in_plan_by_hand():
    plan = make_plan(PlanInputs(model="llama2-7b", micro_batch=1, seq_len=4096))
    assert plan.memory.params_gb == pytest.approx(2 * P7 / 1e9)
    assert plan.memory.accum_buffer_gb == pytest.approx(4 * P7 / 1e9)
    assert plan.memory.optimizer_gb == pytest.approx(12 * P7 / 1e9)
    s, h, a, v = 4096, 4096, 32, 32000
    activations = 32 * (34 * s * h + 5 * a * s * s) + 4 * s * v
    assert plan.memory.activations_gb == pytest.approx(activations / 1e9)


def test_micro_batch_chosen_from_device_memory():
    plan = make_plan(
        PlanInputs(
            model="llama2-7b",
            target_tokens=4 * 2**20,
            seq_len=4096,
            gpus=8,
            device_memory=80 * 10**9,
            zero=3,
            flash_attention=True,
            checkpointing="full",
        )
    )
    cap = plan.memory.max_micro_batch
    assert plan.micro_batch <= cap and plan.memory.fits
    assert plan.global_batch_tokens == 4 * 2**20  # 1024 sequences, reached exactly
    assert plan.micro_batch_from == "largest that fits --device-memory"


def test_not_fitting_names_the_micro_batch_and_k():
    inputs = dict(
        model="llama2-7b",
        target_sequences=1024,
        seq_len=4096,
        gpus=8,
        zero=3,
        flash_attention=True,
        checkpointing="full",
        device_memory=80 * 10**9,
    )
    cap = make_plan(PlanInputs(**inputs)).memory.max_micro_batch
    plan = make_plan(PlanInputs(micro_batch=cap + 10, **inputs))
    assert plan.memory.fits is False
    k = round(1024 / (cap * 8) + 1e-9)
    assert any(f"micro-batch {cap} fits, and k = {k}" in w for w in plan.warnings)


def test_nothing_fits_says_so():
    plan = make_plan(
        PlanInputs(model="llama2-70b", seq_len=4096, micro_batch=1, device_memory=80 * 10**9)
    )
    assert plan.memory.fits is False and plan.memory.max_micro_batch == 0
    assert "model state alone" in plan.warnings[-1]


def test_communication_by_hand():
    base = dict(accum_steps=4, micro_batch=1, params=10**9, gpus=8)
    ddp = make_plan(PlanInputs(**base)).communication
    # ring all-reduce sends 2 (w-1)/w of the buffer: once the 4 GB fp32 accumulated gradient,
    # or k = 4 times the 2 GB bf16 micro-batch gradient
    assert ddp.collective == "all-reduce"
    assert ddp.sync_per_window_bytes == 2 * 7 * 4 * 10**9 // 8
    assert ddp.sync_every_micro_batch_bytes == 4 * 2 * 7 * 2 * 10**9 // 8
    fsdp = make_plan(PlanInputs(zero=2, **base)).communication
    assert fsdp.collective == "reduce-scatter"
    assert fsdp.sync_per_window_bytes == 7 * 4 * 10**9 // 8
    assert fsdp.sync_per_window_grads_gb == pytest.approx(4.0)
    assert fsdp.sync_every_micro_batch_grads_gb == pytest.approx(0.5)
    assert make_plan(PlanInputs(**{**base, "gpus": 1})).communication is None


@pytest.mark.parametrize(
    "inputs, message",
    [
        (
            dict(target_tokens=10, target_sequences=2),
            "--target-tokens 10 conflicts with --target-sequences 2",
        ),
        (
            dict(accum_steps=2, target_tokens=10**6),
            "--accum-steps 2 conflicts with --target-tokens 1M",
        ),
        (dict(micro_batch=2, micro_tokens=4096), "--micro-batch 2 conflicts with --micro-tokens"),
        (dict(params=7 * 10**9, model="llama2-7b"), "--params 7B conflicts with --model llama2-7b"),
        (dict(model="llama2-7b", layers=4), "--model llama2-7b conflicts with --layers 4"),
        (dict(steps=10, total_tokens=10**9), "--steps 10 conflicts with --total-tokens 1B"),
        (dict(model="llama9"), "--model llama9: unknown model"),
        (dict(mfu=1.5, peak_tflops=100), "--mfu 1.5: must be a fraction"),
        (dict(micro_batch=0), "--micro-batch 0: must be"),
        (dict(layers=4, hidden=64), "--layers 4: a model shape also needs --heads, --vocab"),
        (dict(base_lr=1e-3), "--base-lr 0.001: needs --base-batch-tokens"),
        (dict(target_tokens=10**6, micro_batch=4), "--target-tokens 1M: needs --seq-len"),
        (dict(micro_tokens=5000, seq_len=2048), "--micro-tokens 5000: not a whole number"),
    ],
)
def test_bad_inputs_name_the_flag(inputs, message):
    with pytest.raises(PlanError) as err:
        make_plan(PlanInputs(**inputs))
    assert str(err.value).startswith(message)


def test_table_has_units_and_warnings():
    plan = make_plan(
        PlanInputs(
            target_tokens=10**6,
            seq_len=4096,
            micro_batch=4,
            gpus=8,
            model="gpt2-124m",
            device_memory=80 * 10**9,
        )
    )
    text = render_table(plan)
    assert "tokens / step" in text and "GB" in text and "sequences / device" in text
    assert "warning: global batch 1,048,576 tokens is +4.9%" in text


# Properties -------------------------------------------------------------------------------------


@given(st.integers(1, 10**9), st.integers(1, 4096), st.integers(1, 1024), st.booleans())
def test_global_is_micro_times_k_times_world_and_k_is_best(target, micro, world, in_tokens):
    if micro > target:
        return
    if in_tokens:
        plan = make_plan(PlanInputs(target_tokens=target, micro_tokens=micro, gpus=world))
        landed = plan.global_batch_tokens
        assert landed == plan.micro_tokens * plan.accum_steps * world
    else:
        plan = make_plan(PlanInputs(target_sequences=target, micro_batch=micro, gpus=world))
        landed = plan.global_batch_sequences
        assert landed == plan.micro_batch * plan.accum_steps * world
    k = plan.accum_steps
    assert k >= 1
    # |m j w - T| is convex in j, so over all j >= 1 its minimum lies at floor(T / (m w)) or the
    # next j up (or at j = 1); a few neighbours either side make the reference plainly complete
    q = target // (micro * world)
    best = min(abs(micro * j * world - target) for j in range(max(1, q - 2), q + 4))
    assert abs(landed - target) == best
    if abs(micro * (k - 1) * world - target) == best and k > 1:
        assert landed >= target  # a tie goes to the larger batch
    assert not (abs(micro * (k + 1) * world - target) == best and landed < target)
    assert (abs(plan.target_deviation) > 0.01) == any("from the target" in w for w in plan.warnings)


@given(st.integers(1, 10**12), st.integers(1, 10**6))
def test_accum_steps_for_is_round_half_up(target, per_micro_step):
    expected = max(1, math.floor(Fraction(target, per_micro_step) + Fraction(1, 2)))
    assert accum_steps_for(target, per_micro_step) == expected


optional = st.none() | st.integers(1, 10**7)


@settings(max_examples=150, deadline=None)
@given(
    target_tokens=optional,
    seq_len=st.none() | st.sampled_from([128, 1000, 4096]),
    micro_batch=st.none() | st.integers(1, 64),
    gpus=st.none() | st.integers(1, 64),
    steps=st.none() | st.integers(1, 10**6),
    model=st.none() | st.sampled_from(["gpt2-124m", "llama2-7b"]),
    zero=st.none() | st.integers(0, 3),
    device_memory=st.none() | st.integers(10**9, 200 * 10**9),
    micro_step_time=st.none() | st.floats(0.01, 10),
    flash_attention=st.none() | st.booleans(),
)
def test_any_valid_inputs_give_a_plan_or_a_plan_error(**inputs):
    try:
        plan = make_plan(PlanInputs(**inputs))
    except PlanError as err:
        assert str(err).startswith("--") and "\n" not in str(err)
        return
    json.dumps(plan.to_dict())
    text = render_table(plan)
    assert "devices" in text
    if plan.global_batch_sequences is not None:
        assert plan.global_batch_sequences == plan.micro_batch * plan.accum_steps * plan.world_size
    if plan.memory.fits is not None and plan.memory.max_micro_batch is not None:
        assert plan.memory.fits == (plan.micro_batch <= plan.memory.max_micro_batch)


def test_params_with_a_shape_counts_params_and_sizes_activations_by_shape():
    # The shape formula leaves out biases and learned positions; --params gives the true count.
    shape = dict(layers=2, hidden=64, heads=2, vocab=100, seq_len=32, micro_batch=4)
    counted = make_plan(
        PlanInputs(params=10**9, precision="fp32", steps=10, accum_steps=1, **shape)
    )
    by_shape = make_plan(PlanInputs(precision="fp32", steps=10, accum_steps=1, **shape))
    assert counted.to_dict()["params"] == 10**9
    assert counted.memory.params_gb == pytest.approx(4.0)  # 1e9 fp32 parameters x 4 bytes
    assert counted.flops_total == 6 * 10**9 * (4 * 32 * 10)  # 6 N D, D = 4 x 32 x 10 steps
    assert counted.memory.activations_gb == by_shape.memory.activations_gb


def test_schedule_micro_batch_from_memory_fits_the_smallest_target():
    # Decreasing batch: 64 sequences of 1,024 tokens, then 16. On 2 devices a micro-batch of
    # 32 would land the first target exactly, but the second must hold one micro-batch per
    # device: at most 16 / 2 = 8 sequences, which lands 16 exactly with k = 1.
    plan = make_plan(
        PlanInputs(
            model="gpt2-124m",
            device_memory=80 * 10**9,
            seq_len=1024,
            gpus=2,
            batch_schedule="0:64Ki,1M:16Ki",
            total_tokens=2 * 10**6,
        )
    )
    assert plan.memory.max_micro_batch > 32
    assert plan.micro_batch == 8 and plan.accum_steps == 64 // (8 * 2)
    assert [p.accum_steps for p in plan.batch_schedule.phases] == [4, 1]
    # 1M tokens at 65,536 a step: ceil(15.26) = 16 steps, to 1,048,576; the other 951,424
    # at 16,384 a step: ceil(58.07) = 59
    assert [p.steps for p in plan.batch_schedule.phases] == [16, 59]
    assert plan.steps == 75 and plan.total_tokens == 16 * 65_536 + 59 * 16_384


@settings(max_examples=40, derandomize=True, deadline=None)
@given(
    first=st.integers(1, 64),
    growth=st.integers(1, 64),
    switch=st.integers(1, 2**24),
    total=st.integers(1, 2**26),
    micro_batch=st.integers(1, 4),
    gpus=st.integers(1, 8),
    micro_step_s=st.floats(0.01, 5),
)
def test_schedule_plan_totals_are_its_phases(
    first, growth, switch, total, micro_batch, gpus, micro_step_s
):
    seq_len = 256
    per_micro_step = micro_batch * seq_len * gpus
    small, large = first * per_micro_step, first * growth * per_micro_step
    plan = make_plan(
        PlanInputs(
            batch_schedule=f"0:{small},{switch}:{large}",
            total_tokens=total,
            seq_len=seq_len,
            micro_batch=micro_batch,
            gpus=gpus,
            micro_step_time=micro_step_s,
        )
    )
    phases = plan.batch_schedule.phases
    # whole micro-batches in every target: k is the target over the micro-step, exactly
    assert phases[0].accum_steps == plan.accum_steps == first
    assert {p.accum_steps for p in phases} <= {first, first * growth}
    assert plan.steps == sum(p.steps for p in phases)
    assert total <= plan.total_tokens < total + phases[-1].tokens_per_step
    micro_steps = sum(p.steps * p.accum_steps for p in phases)
    assert plan.total_time_h * 3600 == pytest.approx(micro_steps * micro_step_s)
    assert plan.step_time_s == pytest.approx(first * micro_step_s)
