"""`gradaccum plan --base-bits`: a frozen base stored in 4, 8 or 16 bits, against byte counts
derived by hand from the published Llama 2 7B parameter count and shape. Over a 4- or 8-bit
base everything not quantised is fp32, as the trainer holds it: peft's k-bit preparation casts
the embeddings, head and norms to fp32, and the adapters are created in fp32, so they keep an
fp32 .grad (no buffer) and step without a master copy."""

import json
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradaccum.cli import main
from gradaccum.plan import PlanInputs, make_plan
from gradaccum.plan.presets import ModelShape

P7 = 6_738_415_616  # published Llama 2 7B parameter count
H, F, L, V = 4096, 11008, 32, 32000  # its width, MLP width, blocks, vocabulary
LINEAR7 = L * (4 * H * H + 3 * H * F)  # q, k, v, o and gate, up, down of every block
ADAPTERS16 = L * 16 * (4 * (H + H) + 3 * (H + F))  # rank 16: r x (in + out) per matrix
# NF4: 4 bits a weight, an 8-bit absmax per 64 weights, an fp32 constant per 256 absmaxes.
NF4_PER_PARAM = Fraction(1, 2) + Fraction(8, 64 * 8) + Fraction(32, 64 * 256 * 8)

ACCEPTANCE = (
    "plan --target-sequences 128 --seq-len 2048 --micro-batch 1 --model llama2-7b "
    "--lora-rank 16 --base-bits 4 --checkpointing full --device-memory 24GB"
)


def _plan_json(capsys, command: str) -> dict:
    assert main([*command.split(), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_hand_counts_match_the_published_model():
    assert LINEAR7 == 6_476_005_376
    assert P7 - LINEAR7 == 2 * V * H + (2 * L + 1) * H  # embedding, head and the RMSNorms
    assert ADAPTERS16 == 39_976_960
    assert NF4_PER_PARAM == Fraction(2113, 4096)  # 0.515869140625 bytes


def test_qlora_7b_on_a_24gb_card(capsys):
    d = _plan_json(capsys, ACCEPTANCE)
    nf4 = -(-LINEAR7 * NF4_PER_PARAM.numerator // NF4_PER_PARAM.denominator)
    weights = nf4 + 4 * (P7 - LINEAR7) + 4 * ADAPTERS16  # the rest of the base and adapters fp32
    assert d["accum_steps"] == 128 and d["global_batch_sequences"] == 128
    assert d["memory"]["fits"] is True
    assert d["base_bits"] == 4
    m = d["memory"]
    assert m["params_gb"] == pytest.approx(weights / 1e9, rel=1e-12)
    assert m["frozen_base_gb"] == pytest.approx(nf4 / 1e9, rel=1e-12)
    assert m["frozen_base_16bit_gb"] == pytest.approx(2 * LINEAR7 / 1e9, rel=1e-12)
    # fp32 adapters: .grad, plus a fresh gradient in flight of the largest trainable tensor,
    # taken as no larger than the embedding (V x H) nor than all the adapters; no buffer; AdamW's
    # two moments and no master copy.
    in_flight = 4 * min(V * H, ADAPTERS16)
    assert m["grads_gb"] == pytest.approx((4 * ADAPTERS16 + in_flight) / 1e9, rel=1e-12)
    assert m["accum_buffer_gb"] == 0
    assert m["optimizer_gb"] == pytest.approx(8 * ADAPTERS16 / 1e9, rel=1e-12)
    bf16 = _plan_json(capsys, ACCEPTANCE.replace(" --base-bits 4", ""))
    b = bf16["memory"]
    assert b["params_gb"] == pytest.approx(2 * (P7 + ADAPTERS16) / 1e9, rel=1e-12)
    # Without --base-bits the adapters are read in bf16: a buffer and master weights.
    assert b["grads_gb"] == pytest.approx(2 * min(V * H, ADAPTERS16) / 1e9, rel=1e-12)
    assert b["accum_buffer_gb"] == pytest.approx(4 * ADAPTERS16 / 1e9, rel=1e-12)
    assert b["optimizer_gb"] == pytest.approx(12 * ADAPTERS16 / 1e9, rel=1e-12)
    assert m["activations_gb"] == b["activations_gb"]  # activations follow --precision
    state = weights + 4 * ADAPTERS16 + in_flight + 8 * ADAPTERS16
    assert m["total_gb"] == pytest.approx(state / 1e9 + b["activations_gb"], rel=1e-12)


def test_qlora_table_says_what_training_it_needs(capsys):
    assert main(ACCEPTANCE.split()) == 0
    out = capsys.readouterr().out
    assert "4-bit frozen base" in out and "3.34 GB" in out and "4.55 GB" in out
    assert "6.93 GB" in out and "│ .grad " in out
    assert "norms and biases in fp32, as peft's k-bit preparation casts them" in out
    assert "gradaccum train --lora-rank R --base-bits 4 trains on it" in out
    assert "accumulation steps k" in out and "│       128 │" in out


def test_int8_and_16_bit_bases_by_hand(capsys):
    rows = L * (H + H + H + H + F + F + H)  # output rows: q, k, v, o, gate, up, down
    int8 = _plan_json(capsys, ACCEPTANCE.replace("--base-bits 4", "--base-bits 8"))
    weights = LINEAR7 + 4 * rows + 4 * (P7 - LINEAR7) + 4 * ADAPTERS16
    assert int8["memory"]["params_gb"] == pytest.approx(weights / 1e9, rel=1e-12)
    assert int8["memory"]["optimizer_gb"] == pytest.approx(8 * ADAPTERS16 / 1e9, rel=1e-12)
    b16 = _plan_json(capsys, ACCEPTANCE.replace("--base-bits 4", "--base-bits 16"))
    default = _plan_json(capsys, ACCEPTANCE.replace(" --base-bits 4", ""))
    assert b16["memory"]["total_gb"] == default["memory"]["total_gb"]  # bf16: 16 is the default
    fp32 = _plan_json(
        capsys, ACCEPTANCE.replace("--base-bits 4", "--base-bits 16 --precision fp32")
    )
    weights = 2 * P7 + 4 * ADAPTERS16  # the frozen base halved, the adapters in fp32
    assert fp32["memory"]["params_gb"] == pytest.approx(weights / 1e9, rel=1e-12)


def test_trainable_params_taken_from_the_quantised_weights(capsys):
    t = 100_000_000
    command = ACCEPTANCE.replace("--lora-rank 16", f"--trainable-params {t}")
    d = _plan_json(capsys, command)
    quantised = LINEAR7 - t  # the larger reading: what trains is not quantised
    nf4 = -(-quantised * 2113 // 4096)
    weights = nf4 + 4 * (P7 - quantised)  # what trains is fp32 like the rest
    assert d["memory"]["params_gb"] == pytest.approx(weights / 1e9, rel=1e-12)
    assert d["memory"]["grads_gb"] == pytest.approx((4 * t + 4 * min(V * H, t)) / 1e9)
    assert d["memory"]["accum_buffer_gb"] == 0
    assert d["memory"]["optimizer_gb"] == pytest.approx(8 * t / 1e9)


def test_zero3_shards_the_quantised_base_at_its_average_bytes(capsys):
    d = _plan_json(capsys, ACCEPTANCE + " --gpus 4 --zero 3")
    held = P7 + ADAPTERS16
    stored = -(-LINEAR7 * 2113 // 4096) + 4 * (held - LINEAR7)
    unit = 4 * H * H + 3 * H * F + 2 * H  # a block (larger than the embedding) gathered whole
    assert unit > V * H
    rest = -(-(held - unit) // 4)
    assert d["memory"]["params_gb"] == pytest.approx(stored * (unit + rest) // held / 1e9)


@pytest.mark.parametrize(
    "extra, words",
    [
        ("--base-bits 3 --lora-rank 16", "--base-bits 3: expected one of 4, 8, 16"),
        ("--base-bits 32 --lora-rank 16", "--base-bits 32: expected one of 4, 8, 16"),
        ("--base-bits four --lora-rank 16", "--base-bits four"),
        ("--base-bits 0 --lora-rank 16", "--base-bits 0"),
        ("--base-bits 4", "--base-bits 4: only a frozen base"),
    ],
)
def test_bad_base_bits_one_line_exit_2(capsys, extra, words):
    assert main(["plan", "--model", "llama2-7b", *extra.split()]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and words in captured.err


def test_4_bits_need_a_shape(capsys):
    assert main("plan --params 7B --trainable-params 40M --base-bits 4".split()) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--base-bits 4: needs the model's shape" in err
    assert main("plan --params 7B --trainable-params 40M --base-bits 16".split()) == 0


@settings(max_examples=60, deadline=None)
@given(
    layers=st.integers(1, 48),
    heads=st.sampled_from([1, 2, 4, 8, 16]),
    head_dim=st.sampled_from([16, 64, 128]),
    vocab=st.integers(256, 200_000),
    rank=st.integers(1, 64),
)
def test_4_8_and_16_bits_by_hand(layers, heads, head_dim, vocab, rank):
    """4 bits < 8 bits for the parameters; 16 bits holds everything in bf16, 4 and 8 the rest
    in fp32 (so a model that is mostly embedding can need more at 4 bits than at 16). The
    adapters' state is fp32 over 4 and 8 bits; activations are the same at every width."""
    hidden = heads * head_dim
    shape = ModelShape("custom", layers, hidden, heads, vocab)  # --layers ...: a 4h MLP
    plans = {
        bits: make_plan(
            PlanInputs(
                layers=layers, hidden=hidden, heads=heads, vocab=vocab, lora_rank=rank,
                seq_len=256, micro_batch=1, base_bits=bits,
            )
        )
        for bits in (4, 8, 16)
    }  # fmt: skip
    p4, p8, p16 = (plans[b].memory.params_gb * 1e9 for b in (4, 8, 16))
    assert p4 < p8
    linear = layers * sum(i * o for i, o in _linears(shape))
    adapters = layers * rank * sum(i + o for i, o in _linears(shape))
    held = p16 / 2  # 16 bits: base and adapters, 2 bytes each
    assert p4 == pytest.approx(-(-linear * 2113 // 4096) + 4 * (held - linear), abs=1)
    largest = max(vocab * hidden, 4 * hidden * hidden)  # the embedding or an MLP matrix
    for bits in (4, 8):
        m = plans[bits].memory
        assert m.grads_gb * 1e9 == pytest.approx(4 * adapters + 4 * min(largest, adapters))
        assert m.accum_buffer_gb == 0
        assert m.optimizer_gb * 1e9 == pytest.approx(8 * adapters)
        assert m.activations_gb == plans[16].memory.activations_gb
    assert plans[16].memory.optimizer_gb * 1e9 == pytest.approx(12 * adapters)


def _linears(shape):
    h, f = shape.hidden, shape.ffn_size
    return [(h, h)] * 4 + [(h, f), (f, h)]


@pytest.mark.parametrize("memory", ["24GB", "80GB"])
def test_sync_auto_with_a_quantised_base_chooses_what_train_runs(capsys, memory):
    # At 24GB nothing fits and micro needs the least memory: auto chose micro, which train
    # refuses with --base-bits. Whatever auto chooses, train must take it.
    from gradaccum.train.config import TrainConfig

    argv = ["plan", "--sync", "auto", "--base-bits", "4", "--lora-rank", "16", "--model",
            "llama2-7b", "--gpus", "8", "--micro-batch", "1", "--accum-steps", "4",
            "--seq-len", "2048", "--device-memory", memory]  # fmt: skip
    assert main([*argv, "--json"]) == 0
    sync = json.loads(capsys.readouterr().out)["sync"]
    TrainConfig(sync=sync["policy"], base_bits=4, lora_rank=16)  # refused: BadInput
    assert "--base-bits 4" in sync["why"] and "not sharded" in sync["why"]
    assert main(argv) == 0
    assert "8 devices = 1 node x 8;" in capsys.readouterr().out
