"""grpo.sampling and GPT.decode against references that use neither: full forwards of the
whole row (the cache), a plain greedy loop of full forwards (sampling at a temperature near
0), and softmax of the first step's logits in float64 (the frequencies of sampled tokens)."""

from __future__ import annotations

import math

import pytest
import torch

from gradaccum.grpo.sampling import sample
from gradaccum.models.gpt import GPT, GPTConfig

VOCAB = 32


def tiny_gpt(n_expert: int = 0, seq_len: int = 24, spread: float = 0.0) -> GPT:
    """A 2-layer GPT of width 32. spread > 0: every parameter redrawn from N(0, spread^2), so
    the logits differ by O(1) (a fresh GPT's are almost uniform: no clear greedy choice)."""
    torch.manual_seed(0)
    cfg = GPTConfig(VOCAB, seq_len, n_layer=2, n_head=2, n_embd=32, n_expert=n_expert)
    model = GPT(cfg)
    if spread:
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, spread)
    return model


def spread_out(model: torch.nn.Module, spread: float, seed: int = 0) -> torch.nn.Module:
    """Every parameter (LoRA's B included, which starts at zero) redrawn from N(0, spread^2)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * spread)
    return model


def logits_of(model, ids: torch.Tensor) -> torch.Tensor:
    out = model(input_ids=ids)
    return out if isinstance(out, torch.Tensor) else out.logits


@torch.no_grad()
def greedy_by_hand(model, prompt: list[int], max_new: int, eos_id: int) -> list[int]:
    """Argmax decoding by a full forward of the whole row per new token, no cache."""
    row, new = list(prompt), []
    while len(new) < max_new:
        token = int(logits_of(model, torch.tensor([row]))[0, -1].argmax())
        row.append(token)
        new.append(token)
        if token == eos_id:
            break
    return new


@pytest.mark.parametrize("n_expert", [0, 4])
def test_cached_decode_equals_full_forward(n_expert):
    model = tiny_gpt(n_expert).eval()
    ids = torch.randint(0, VOCAB, (3, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids)
        # a prompt of 7, three tokens at once (the masked case), then one at a time
        logits, cache = model.decode(ids[:, :7], None, 0)
        torch.testing.assert_close(logits, full[:, :7], rtol=0, atol=1e-5)
        logits, cache = model.decode(ids[:, 7:10], cache, 7)
        torch.testing.assert_close(logits, full[:, 7:10], rtol=0, atol=1e-5)
        for pos in range(10, 20):
            logits, cache = model.decode(ids[:, pos : pos + 1], cache, pos)
            torch.testing.assert_close(logits[:, 0], full[:, pos], rtol=0, atol=1e-5)
    assert all(k.shape[2] == 20 for k, _ in cache)


def test_decode_refuses_positions_past_seq_len():
    model = tiny_gpt(seq_len=8)
    with pytest.raises(ValueError, match="seq_len 8"):
        model.decode(torch.zeros(1, 9, dtype=torch.long), None, 0)


def check_greedy(model, prompts, max_new, eos_id, limit=None):
    """sample at temperature 1e-4 equals greedy_by_hand for every completion of every prompt
    (two per prompt); the model's mode is kept."""
    model.train()
    got = sample(model, prompts, 2, max_new, 1e-4, eos_id, seed=3)
    assert model.training
    model.eval()
    for i, prompt in enumerate(prompts):
        budget = max_new if limit is None else min(max_new, limit - len(prompt))
        want = greedy_by_hand(model, prompt, budget, eos_id)
        assert got[2 * i] == want and got[2 * i + 1] == want, f"prompt {i}"
    return got


PROMPTS = [[1, 2, 3], [4, 5, 6], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]]


@pytest.mark.parametrize("n_expert", [0, 4])
def test_built_in_gpt_near_zero_temperature_is_greedy(n_expert):
    model = tiny_gpt(n_expert, seq_len=16, spread=0.5).eval()
    # EOS: a token greedy decoding of the first prompt makes third, so that row stops early
    eos = greedy_by_hand(model, PROMPTS[0], 3, eos_id=-1)[2]
    got = check_greedy(model, PROMPTS, 8, eos, limit=16)
    assert got[0][-1] == eos and len(got[0]) <= 3
    assert max(len(c) for c in got[6:]) <= 16 - 11  # the long prompt's budget clipped


def test_built_in_gpt_with_lora_is_greedy():
    from gradaccum.models import lora

    model = tiny_gpt(seq_len=16)
    lora.apply_lora(model, lora.LoraSpec(rank=2))
    spread_out(model, 0.5)  # nonzero B: the adapters change the logits
    check_greedy(model, PROMPTS[:3], 6, eos_id=0, limit=16)


def test_built_in_gpt_in_a_peft_model_is_greedy():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(
        tiny_gpt(seq_len=16), peft.LoraConfig(r=2, target_modules=["c_attn"])
    )
    spread_out(model, 0.5)
    check_greedy(model, PROMPTS[:3], 6, eos_id=0, limit=16)


def hf_model(arch: str):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if arch == "llama":
        config = transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=16,
        )
        return transformers.LlamaForCausalLM(config)
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_embd=32,
        n_layer=2,
        n_head=2,
        n_positions=16,
        bos_token_id=1,
        eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(config)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_hugging_face_near_zero_temperature_is_greedy(arch):
    model = spread_out(hf_model(arch), 0.3)
    eos = greedy_by_hand(model.eval(), PROMPTS[0], 3, eos_id=-1)[2]
    got = check_greedy(model, PROMPTS, 8, eos, limit=16)
    assert got[0][-1] == eos


def test_peft_hugging_face_near_zero_temperature_is_greedy():
    peft = pytest.importorskip("peft")
    model = hf_model("llama")
    model = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    spread_out(model, 0.3)
    check_greedy(model, PROMPTS[:3], 6, eos_id=0, limit=16)


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_same_seed_same_completions_and_global_rng_untouched(arch):
    model = tiny_gpt() if arch == "gpt" else hf_model("llama")
    torch.manual_seed(123)
    state = torch.get_rng_state()
    a = sample(model, PROMPTS[:3], 4, 6, 1.0, 0, seed=7)
    assert torch.equal(torch.get_rng_state(), state)
    b = sample(model, PROMPTS[:3], 4, 6, 1.0, 0, seed=7)
    c = sample(model, PROMPTS[:3], 4, 6, 1.0, 0, seed=8)
    assert a == b and a != c
    assert len(a) == 12 and all(1 <= len(x) <= 6 for x in a)
    assert all(0 not in x[:-1] for x in a)  # nothing kept after EOS


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic and its degrees of freedom, cells of expected count < 5 merged."""
    n = int(counts.sum())
    expected = probs * n
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum().view(1)])
    exp = torch.cat([expected[~small], expected[small].sum().view(1)])
    keep = exp > 0
    return float(((obs - exp)[keep] ** 2 / exp[keep]).sum()), int(keep.sum()) - 1


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_first_token_frequencies_follow_softmax(arch):
    """4,000 first tokens at temperature 2 against softmax(logits / 2) of the prompt's last
    position (float64): chi-square below its 99.9th percentile (the Wilson-Hilferty
    approximation). Sampling at temperature 1, or with top-k, would fail it by far. For the
    Hugging Face model its own generation_config suppresses half the vocabulary and penalises
    repeats, which sampling must ignore."""
    model = tiny_gpt(spread=0.15) if arch == "gpt" else spread_out(hf_model("llama"), 0.3)
    if arch != "gpt":
        model.generation_config.suppress_tokens = list(range(VOCAB // 2))
        model.generation_config.repetition_penalty = 10.0
    prompt, draws, temperature = [3, 1, 4], 4000, 2.0
    got = sample(model, [prompt], draws, 1, temperature, eos_id=0, seed=11)
    counts = torch.bincount(torch.tensor([c[0] for c in got]), minlength=VOCAB).double()
    with torch.no_grad():
        last = logits_of(model.eval(), torch.tensor([prompt]))[0, -1].double()
    stat, dof = chi_square(counts, torch.softmax(last / temperature, dim=-1))
    z = 3.09  # the standard normal's 99.9th percentile
    bound = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    assert dof > 10 and stat < bound, (stat, dof, bound)
    wrong_t, _ = chi_square(counts, torch.softmax(last, dim=-1))
    assert wrong_t > bound  # the test tells the temperature apart
    if arch != "gpt":
        assert model.generation_config.repetition_penalty == 10.0  # put back


def test_bad_arguments():
    model = tiny_gpt(seq_len=8)
    with pytest.raises(ValueError, match="at least one token"):
        sample(model, [[]], 2, 4, 1.0, 0, seed=0)
    with pytest.raises(ValueError, match="no room"):
        sample(model, [list(range(8))], 2, 4, 1.0, 0, seed=0)
    with pytest.raises(ValueError, match="temperature"):
        sample(model, [[1]], 2, 4, 0.0, 0, seed=0)
    linear = torch.nn.Linear(2, 2).train()
    with pytest.raises(TypeError, match="neither the built-in GPT nor a Hugging Face"):
        sample(linear, [[1]], 2, 4, 1.0, 0, seed=0)
    assert linear.training
