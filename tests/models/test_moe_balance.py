"""The MoE load-balancing loss under accumulation, on one process: each mode's window gradient
against the float64 big batch computed without the engine or the balance
(`tests/models/moe_reference.py`), the figures it reports, resume and abandon, the router
logits of the Hugging Face MoE models, and the one-line refusals."""

from __future__ import annotations

import pytest
import torch

from gradaccum import Accumulator
from gradaccum.models.gpt import GPT, GPTConfig
from gradaccum.models.loss import causal_lm_loss
from gradaccum.moe import router
from gradaccum.moe.balance import Balance
from gradaccum.parallel import collectives
from gradaccum.testing import GradRecorder, max_rel_error

from .moe_reference import COEF, EXPERTS, MODELS, TOP_K, moe_batches, moe_config, reference

transformers = pytest.importorskip("transformers")

CASES = [("gpt", False), ("mixtral", False), ("mixtral", True), ("qwen2_moe", True)]


def run(model, windows, mode, shift=False, balance=None):
    """Each window through Balance.step on an Accumulator whose optimizer only records."""
    recorder = GradRecorder(model.parameters())
    acc = Accumulator(model, recorder)
    balance = balance or Balance(model, mode, shift=shift)
    outs = [balance.step(acc, window) for window in windows]
    acc.close()
    return recorder.seen, outs, balance


@pytest.mark.parametrize("name, shift", CASES)
def test_global_is_the_big_batch_gradient_and_loss(name, shift):
    model = MODELS[name]()
    window = moe_batches(4, seed=5)
    (grads,), [(result, stats)], _ = run(model, [window], "global", shift)
    want = reference(model, window, shift)
    assert max_rel_error(grads, want["grads"]) <= 1e-5
    assert result.aux_loss == pytest.approx(want["lbl"], rel=1e-6)
    assert stats.lbl == pytest.approx(want["lbl"], rel=1e-6)
    assert stats.routing_agrees is True and stats.f_source == "global"
    assert stats.tokens == sum(int(b["attention_mask"].sum()) for b in window)


@pytest.mark.parametrize("name, shift", CASES[:3])
def test_micro_is_each_micro_batch_s_own_loss_weighted_by_its_tokens(name, shift):
    model = MODELS[name]()
    window = moe_batches(4, seed=5)
    (grads,), [(result, stats)], _ = run(model, [window], "micro", shift)
    big = reference(model, window, shift)
    own = reference(model, window, shift, mode="micro")
    assert max_rel_error(grads, big["grads"]) > 1e-3  # not the big batch's
    assert max_rel_error(grads, own["grads"]) <= 1e-5
    assert result.aux_loss == pytest.approx(own["aux"], rel=1e-6)
    assert stats.lbl == pytest.approx(big["lbl"], rel=1e-6)  # reported: the window's own
    assert stats.routing_agrees is None and stats.f_source == "micro"


@pytest.mark.parametrize("name", ["gpt", "mixtral"])
def test_global_previous_takes_the_previous_window_s_f(name):
    model = MODELS[name]()
    windows = [moe_batches(3, seed=11), moe_batches(4, seed=12), moe_batches(2, seed=13)]
    grads, outs, _ = run(model, windows, "global-previous")
    own = [reference(model, window, False) for window in windows]
    assert max_rel_error(grads[0], own[0]["grads"]) <= 1e-5  # the first falls back
    for step in (1, 2):
        want = reference(model, windows[step], False, mode="given", f=own[step - 1]["f"])
        assert max_rel_error(grads[step], want["grads"]) <= 1e-5
        assert max_rel_error(grads[step], own[step]["grads"]) > 1e-3
        assert outs[step][0].aux_loss == pytest.approx(want["aux"], rel=1e-6)
        assert outs[step][1].lbl == pytest.approx(own[step]["lbl"], rel=1e-6)
    assert [stats.f_source for _, stats in outs] == ["global", "previous", "previous"]


def test_the_load_figures_are_max_over_mean_of_the_window_s_counts():
    model = MODELS["gpt"]()
    window = moe_batches(4, seed=21)
    _, [(_, stats)], _ = run(model, [window], "micro")
    counts = reference(model, window, False)["counts"]  # (L, E) top-k counts, float64
    load = [max(row) / (sum(row) / len(row)) for row in counts.tolist()]
    assert stats.load == pytest.approx(load, rel=1e-12)
    assert stats.max_load == pytest.approx(max(load), rel=1e-12)


def test_global_previous_resumes_exactly_from_its_state_dict():
    windows = [moe_batches(3, seed=s) for s in (31, 32)]
    model = MODELS["gpt"]()
    grads, _, _ = run(model, windows, "global-previous")
    first = Balance(model, "global-previous")
    run(model, windows[:1], "global-previous", balance=first)
    state = first.state_dict()
    resumed = Balance(model, "global-previous")
    resumed.load_state_dict(state)
    again, [(_, stats)], _ = run(model, windows[1:], "global-previous", balance=resumed)
    assert stats.f_source == "previous"
    assert max_rel_error(again[0], grads[1]) <= 1e-7


def test_an_abandoned_window_leaves_the_previous_f():
    model = MODELS["gpt"]()
    first, dropped, second = (moe_batches(3, seed=s) for s in (41, 42, 43))
    recorder = GradRecorder(model.parameters())
    acc = Accumulator(model, recorder)
    balance = Balance(model, "global-previous")
    balance.step(acc, first)
    window = acc.begin_window(dropped, extra_sums=balance.prepare(model, dropped))
    balance.begin(window)
    with window.micro_step():
        loss_sum, n, aux = balance.loss(model, dropped[0])
        window.backward(loss_sum, n, aux=aux)
    window.abandon()  # as after running out of memory
    balance.abandon()
    _, stats = balance.step(acc, second)
    f_first = reference(model, first, False)["f"]
    want = reference(model, second, False, mode="given", f=f_first)
    assert max_rel_error(recorder.seen[1], want["grads"]) <= 1e-5
    assert stats.lbl == pytest.approx(want["lbl"], rel=1e-6)  # nothing of the dropped one


# ---- the router logits of the models --------------------------------------------------------


@pytest.mark.parametrize("kind", ["qwen3_moe", "olmoe"])
def test_other_hf_moe_configs_are_read_and_their_routing_pass_routes_alike(kind):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(moe_config(kind, coef=0.02))
    spec = router.moe_spec(model)
    assert (spec.n_expert, spec.top_k, spec.coef, spec.layers) == (EXPERTS, TOP_K, 0.02, 2)
    assert_routing_pass_routes_alike(model, moe_batches(2, seed=3))


@pytest.mark.parametrize("name", list(MODELS))
def test_the_routing_pass_routes_as_the_training_forward(name):
    model = MODELS[name]()
    spec = router.moe_spec(model)
    assert (spec.n_expert, spec.top_k, spec.coef, spec.layers) == (EXPERTS, TOP_K, COEF, 2)
    assert_routing_pass_routes_alike(model, moe_batches(2, seed=3))


def assert_routing_pass_routes_alike(model, batches):
    for batch in batches:
        for shift in (False, True):
            _, trained = router.forward(model, batch, shift)
            routed = router.routing_pass(model, batch, shift)
            assert len(routed) == len(trained) == 2
            for a, b in zip(routed, trained, strict=True):
                assert not a.requires_grad
                assert torch.equal(a.topk(TOP_K).indices, b.topk(TOP_K).indices)
                assert torch.allclose(a, b, rtol=1e-6, atol=1e-7)


# ---- the engine's aux term and extra sums ----------------------------------------------------


def test_an_aux_term_is_added_unscaled_and_reported_and_weight_0_drops_it():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=37, seq_len=16, n_layer=1, n_head=2, n_embd=16))
    batches = moe_batches(3, seed=51)
    recorder = GradRecorder(model.parameters())
    acc = Accumulator(model, recorder)
    window = acc.begin_window(batches)
    for i, batch in enumerate(batches):
        with window.micro_step():
            loss_sum, n = causal_lm_loss(model, batch)
            aux = 0.5 * (i + 1) * model.wte.weight.square().sum()
            window.backward(loss_sum, n, aux=aux)
    result = window.finish()
    ref = GPT(GPTConfig(vocab_size=37, seq_len=16, n_layer=1, n_head=2, n_embd=16))
    ref.load_state_dict(model.state_dict())
    ref = ref.double()
    total = sum(int((b["labels"] != -100).sum()) for b in batches)
    loss = sum(causal_lm_loss(ref, b)[0] for b in batches) / total
    (loss + 3.0 * ref.wte.weight.square().sum()).backward()  # 0.5 * (1 + 2 + 3)
    assert max_rel_error(recorder.seen[0], [p.grad for p in ref.parameters()]) <= 1e-5
    assert result.aux_loss == pytest.approx(
        3.0 * float(ref.wte.weight.detach().square().sum()), rel=1e-6
    )
    assert result.loss == pytest.approx(float(loss.detach()), rel=1e-6)  # cross-entropy only

    window = acc.begin_window(2, tokens=int((batches[0]["labels"] != -100).sum()))
    for weight in (1.0, 0.0):
        with window.micro_step():
            loss_sum, n = causal_lm_loss(model, batches[0])
            window.backward(loss_sum, n, weight, aux=model.wte.weight.sum() * 0 + 7.0)
    assert window.finish().aux_loss == pytest.approx(7.0)  # the weight-0 repeat left out
    assert acc.step(batches, causal_lm_loss).aux_loss is None


def test_extra_sums_come_back_with_one_process_and_are_checked():
    model = GPT(GPTConfig(vocab_size=37, seq_len=16, n_layer=1, n_head=2, n_embd=16))
    acc = Accumulator(model, GradRecorder(model.parameters()))
    window = acc.begin_window(1, extra_sums=torch.tensor([3, 4], dtype=torch.int64))
    assert window.extra_sums.tolist() == [3, 4]
    window.abandon()
    assert acc.begin_window(1).extra_sums is None
    acc.abandon_window()
    with pytest.raises(
        ValueError, match="extra_sums must be a 1-d int64 tensor, got torch.float32"
    ):
        acc.begin_window(1, extra_sums=torch.tensor([1.0]))
    size = collectives.agree_on_window_size(5, 2, extra_sums=torch.tensor([7], dtype=torch.int64))
    assert (size.tokens, size.micro_steps, size.extra_sums.tolist()) == (5, 2, [7])


# ---- refusals ------------------------------------------------------------------------------


def one_line(err) -> str:
    said = str(err.value)
    assert "\n" not in said
    return said


def test_an_aux_term_without_n_up_front_is_refused():
    model = MODELS["gpt"]()
    acc = Accumulator(model, GradRecorder(model.parameters()), count_tokens=None)
    window = acc.begin_window(1)
    with pytest.raises(ValueError) as err, window.micro_step():
        loss_sum, n = causal_lm_loss(model, moe_batches(1, seed=1)[0])
        window.backward(loss_sum, n, aux=loss_sum * 0)
    assert "N is not known up front" in one_line(err) and "count_tokens" in str(err.value)
    assert window.state == "abandoned"


def test_a_bad_mode_a_dense_model_and_a_model_without_router_logits_are_refused():
    moe = MODELS["gpt"]()
    with pytest.raises(ValueError) as err:
        Balance(moe, "pooled")
    assert one_line(err) == "moe balance 'pooled': expected one of micro, global, global-previous"
    dense = GPT(GPTConfig(vocab_size=37, seq_len=16, n_layer=1, n_head=2, n_embd=16))
    with pytest.raises(ValueError) as err:
        Balance(dense, "global")
    assert one_line(err).startswith("GPT has no mixture-of-experts layers")
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2))
    with pytest.raises(ValueError) as err:
        Balance(gpt2, "micro")
    assert one_line(err).startswith("GPT2LMHeadModel has no mixture-of-experts layers")
    balance = Balance(router.moe_spec(moe), "micro")  # a spec, then a model without routers
    acc = Accumulator(dense, GradRecorder(dense.parameters()))
    with pytest.raises(ValueError) as err:
        balance.step(acc, moe_batches(2, seed=1))
    assert one_line(err).startswith("GPT returned no router logits")


def test_a_window_begun_without_the_balance_s_counts_is_refused():
    model = MODELS["gpt"]()
    batches = moe_batches(2, seed=1)
    acc = Accumulator(model, GradRecorder(model.parameters()))
    balance = Balance(model, "global")
    balance.prepare(model, batches)
    window = acc.begin_window(batches)
    with pytest.raises(ValueError) as err:
        balance.begin(window)
    assert "extra_sums hold none, not the 9 of Balance.prepare" in one_line(err)


def test_global_under_fp16_scales_the_aux_term_as_the_loss_and_routes_alike():
    model = MODELS["gpt"]()
    window = moe_batches(4, seed=5)
    recorder = GradRecorder(model.parameters())
    acc = Accumulator(model, recorder, precision="fp16")
    result, stats = Balance(model, "global").step(acc, window)
    want = reference(model, window, False)
    assert result.loss_scale > 1 and not result.skipped
    # fp16 autocast rounds to 11 bits, far inside 1e-2; an aux term left at the loss scale,
    # or never given it, is off by orders of magnitude more
    assert max_rel_error(recorder.seen[0], want["grads"]) <= 1e-2
    assert stats.routing_agrees is True  # the routing pass ran under the same autocast


def test_the_routed_tokens_are_the_real_input():
    ids = torch.arange(6).view(2, 3)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    documents = torch.tensor([[0, 0, 1], [2, -1, -1]])
    assert router.routed_mask({"input_ids": ids, "attention_mask": mask}).tolist() == [
        True, True, False, True, False, False
    ]  # fmt: skip
    assert router.routed_mask({"input_ids": ids, "document_ids": documents}).tolist() == [
        True, True, True, True, False, False
    ]  # fmt: skip
    assert bool(router.routed_mask({"input_ids": ids}).all())
