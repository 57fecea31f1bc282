"""The built-in GPT's mixture of experts: the layer against a per-token loop in float64, every
expert in the graph, the router logits' layout, the preset and its parameter count, and the
checkpoint round trip."""

from __future__ import annotations

import json

import pytest
import torch

from gradaccum.models.build import build_model, gpt_info
from gradaccum.models.checkpointing import first_block
from gradaccum.models.experts import MoE
from gradaccum.models.gpt import GPT, MLP, GPTConfig
from gradaccum.utils.choices import BUILTIN_MODELS, MOE_BALANCES

from .moe_reference import moe_gpt


def layer(top_k: int, seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    cfg = GPTConfig(vocab_size=8, seq_len=8, n_layer=1, n_head=2, n_embd=8, n_expert=4)
    return MoE(8, 4, top_k, lambda: MLP(cfg)).double()


def per_token(moe: MoE, x: torch.Tensor, top_k: int) -> torch.Tensor:
    """y_t = sum over the top-k experts of weight * expert(x_t), one token at a time: the
    softmax of the router's logits, the k largest, renormalised over them when k > 1."""
    rows = []
    for t in x.reshape(-1, x.shape[-1]):
        probs = torch.softmax(t @ moe.router.weight.T, dim=-1)
        order = sorted(range(len(probs)), key=lambda i: -float(probs[i].detach()))[:top_k]
        total = sum(probs[i] for i in order) if top_k > 1 else 1.0
        y = sum(probs[i] / total * moe.experts[i](t[None])[0] for i in order)
        rows.append(y)
    return torch.stack(rows).view_as(x)


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_the_layer_equals_a_per_token_loop_in_float64(top_k):
    moe, ref = layer(top_k), layer(top_k)
    x = torch.randn(3, 5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    weights = torch.randn(3, 5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    y, logits = moe(xa)
    want = per_token(ref, xb, top_k)
    assert torch.allclose(y, want, rtol=1e-12, atol=1e-12)
    assert logits.shape == (15, 4)
    (y * weights).sum().backward()
    (want * weights).sum().backward()
    for (name, p), q in zip(moe.named_parameters(), ref.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, rtol=1e-10, atol=1e-12), name
    assert torch.allclose(xa.grad, xb.grad, rtol=1e-10, atol=1e-12)


def test_an_expert_no_token_chose_still_gets_a_zero_gradient():
    moe = layer(2)
    with torch.no_grad():  # positive inputs: expert 3's logit is always the lowest
        moe.router.weight.copy_(torch.tensor([[1.0], [1.1], [1.2], [-5.0]]).expand(4, 8))
    x = torch.rand(2, 6, 8, dtype=torch.float64) + 0.1
    y, logits = moe(x)
    routed = set(logits.topk(2).indices.flatten().tolist())
    assert routed == {1, 2}  # experts 0 and 3 get no token
    y.square().sum().backward()
    for e, expert in enumerate(moe.experts):
        for name, p in expert.named_parameters():
            assert p.grad is not None, (e, name)  # in the graph either way
            assert bool(p.grad.any()) == (e in routed), (e, name)


def test_router_logits_come_per_layer_in_row_major_token_order():
    model = moe_gpt().eval()
    ids = torch.randint(0, 37, (2, 7), generator=torch.Generator().manual_seed(3))
    out = model(ids, output_router_logits=True)
    assert torch.equal(out.logits, model(ids))
    assert len(out.router_logits) == 2 and all(r.shape == (14, 4) for r in out.router_logits)
    for row in range(2):  # each row alone gives its rows of the batch's router logits
        alone = model(ids[row : row + 1], output_router_logits=True).router_logits
        for layer_logits, own in zip(out.router_logits, alone, strict=True):
            assert torch.allclose(layer_logits[row * 7 : (row + 1) * 7], own, atol=1e-6)
    # the routing pass skips the head and gives the same logits
    for a, b in zip(model.router_logits(ids), out.router_logits, strict=True):
        assert torch.equal(a, b)
    dense = GPT(GPTConfig(vocab_size=37, seq_len=16, n_layer=2, n_head=2, n_embd=32))
    assert dense(ids, output_router_logits=True).router_logits == ()


def test_the_moe_blocks_are_exact_under_activation_checkpointing():
    model, again = moe_gpt(), moe_gpt()
    again.set_activation_checkpointing(True)
    ids = torch.randint(0, 37, (2, 9), generator=torch.Generator().manual_seed(4))
    for m in (model, again):
        out = m(ids, output_router_logits=True)
        (out.logits.square().mean() + sum(r.square().mean() for r in out.router_logits)).backward()
    for (name, p), q in zip(model.named_parameters(), again.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-8), name


def hand_moe_count(V, T, L, C, E, k):
    """Per block: 2 LayerNorms 4C, attention 4C^2 + 4C, router E*C, k of the E experts each
    c_fc 4C^2 + 4C and c_proj 4C^2 + C; embeddings V*C + T*C, final LayerNorm 2C."""
    block = 4 * C + 4 * C * C + 4 * C + E * C + k * (8 * C * C + 5 * C)
    return V * C + T * C + L * block + 2 * C


def test_the_tiny_moe_preset_builds_with_its_parameter_counts():
    shape = BUILTIN_MODELS["tiny-moe"]
    assert shape == {"n_layer": 4, "n_head": 4, "n_embd": 128, "n_expert": 4, "expert_top_k": 2}
    model, info = build_model(preset="tiny-moe", vocab_size=513, seq_len=64)
    assert all(isinstance(b.mlp, MoE) and len(b.mlp.experts) == 4 for b in model.blocks)
    assert all(b.mlp.top_k == 2 for b in model.blocks)
    total = hand_moe_count(513, 64, 4, 128, 4, 4)
    assert model.num_params() == info.params == total
    assert model.active_params() == info.active_params == hand_moe_count(513, 64, 4, 128, 4, 2)
    assert info.config["n_expert"] == 4 and info.config["router_aux_coef"] == 0.01
    _, dense = build_model(preset="tiny", vocab_size=513, seq_len=64)
    assert dense.active_params is None and "n_expert" in dense.config


def test_a_checkpoint_of_the_moe_gpt_rebuilds_the_same_model(tmp_path):
    model = moe_gpt(seed=5, coef=0.25)
    info = gpt_info(model, "test")
    (tmp_path / "config.json").write_text(json.dumps(info.config))
    torch.save(model.state_dict(), tmp_path / "model.pt")
    again, again_info = build_model(init_from=str(tmp_path))
    assert again.config == model.config and again.config.router_aux_coef == 0.25
    assert again_info.params == info.params and again_info.active_params == info.active_params
    ids = torch.randint(0, 37, (2, 6))
    assert torch.equal(again(ids), model(ids))


@pytest.mark.parametrize(
    "fields, said",
    [
        ({"n_expert": 2, "expert_top_k": 3}, "expert_top_k 3 must be between 1 and n_expert 2"),
        ({"n_expert": 2, "expert_top_k": 0}, "expert_top_k 0 must be between 1 and n_expert 2"),
        ({"n_expert": -1}, "GPTConfig.n_expert must be a whole number >= 0, got -1"),
        ({"n_expert": 4, "router_aux_coef": -0.1}, "router_aux_coef must be >= 0, got -0.1"),
    ],
)
def test_bad_expert_settings_are_refused_in_one_line(fields, said):
    with pytest.raises(ValueError) as err:
        GPTConfig(vocab_size=8, seq_len=8, n_layer=1, n_head=1, n_embd=8, **fields)
    assert said in str(err.value) and "\n" not in str(err.value)


def test_the_balance_modes_are_named_once():
    assert MOE_BALANCES == ("micro", "global", "global-previous")


def test_the_router_is_computed_in_fp32_from_bf16_inputs():
    moe = layer(2).float()
    x = torch.randn(1, 4, 8).bfloat16()
    weights, chosen = moe.to(torch.bfloat16).route(moe.router(x.reshape(-1, 8)))
    assert weights.dtype == torch.float32
    want = torch.softmax(moe.router(x.reshape(-1, 8)).float(), dim=-1).topk(2)
    assert torch.equal(chosen, want.indices)
    assert torch.allclose(weights, want.values / want.values.sum(-1, keepdim=True))


def test_the_first_block_is_a_block_even_with_more_experts_than_blocks():
    """fit's memory probe and activation checkpointing take the first block; a block's list
    of 8 experts is longer than the 2 blocks and must not be taken for it."""
    for n_expert in (8, 0):
        cfg = GPTConfig(
            vocab_size=37, seq_len=16, n_layer=2, n_head=2, n_embd=16, n_expert=n_expert
        )
        model = GPT(cfg)
        assert first_block(model) is model.blocks[0]
