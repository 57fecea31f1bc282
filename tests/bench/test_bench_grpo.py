"""`gradaccum bench --task grpo`: ours and TRL's GRPOTrainer on one window of sampled
completions, each update against float64 references computed here (one forward per
completion, its gradient weighted by hand), the table's JSON, bad flags. No timings asserted.

The weights, on-policy (ratio 1, so the clipped surrogate's gradient is -A_i grad logp_it):
completion i of n_i tokens, C completions and N tokens in the window, k micro-batches of b
completions, micro-batch m holding N_m tokens, L = max_completion_length:
  the big batch:  grpo 1 / (n_i C), bnpo and dapo 1 / N, dr_grpo 1 / (C L);
  TRL 1.16 (its `_compute_loss`, each micro-batch normalised then / k): grpo 1 / (n_i b k),
  bnpo 1 / (N_m k), dr_grpo 1 / (b L k), dapo 1 / N (num_items_in_batch, the window's).
With b k = C, TRL's grpo and dr_grpo are the big batch's; its bnpo is not when the N_m differ.
"""

from __future__ import annotations

import json

import pytest
import torch

from gradaccum.bench.grpo.config import GRPOBenchConfig
from gradaccum.bench.grpo.measure import build, update_check
from gradaccum.bench.grpo.window import (
    PROMPT_TOKENS,
    exact_gradient,
    make_window,
    ours_micro_batches,
    trl_micro_batches,
)
from gradaccum.utils.choices import LOSS_TYPES
from gradaccum.utils.errors import BadInput
from gradaccum.verification.reference import whole_rel_error
from tests.bench.test_bench_sft import cli

pytest.importorskip("trl")
pytest.importorskip("datasets")

SMALL = {"micro_batch": 4, "accum_steps": 3, "num_generations": 4, "max_completion_length": 16}
SMALL_FLAGS = ["--micro-batch", "4", "--accum-steps", "3", "--num-generations", "4",
               "--max-completion-length", "16", "--rounds", "1", "--windows", "1"]  # fmt: skip


@pytest.fixture(scope="module")
def llama_config(tmp_path_factory) -> str:
    """A tiny Llama (hidden 64, 2 layers) over the byte vocabulary, saved from its config."""
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaConfig(
        vocab_size=257, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
        eos_token_id=256, pad_token_id=256, bos_token_id=None, tie_word_embeddings=False,
    ).save_pretrained(path)  # fmt: skip
    return str(path)


@pytest.fixture(scope="module")
def setup(llama_config):
    """(cfg, model, window, per-completion float64 gradients of sum_t logp_it)."""
    cfg = GRPOBenchConfig(model_config=llama_config, rounds=1, windows=1, **SMALL)
    model = build(cfg, torch.device("cpu"))
    window = make_window(model, cfg, 0)
    return cfg, model, window, _logp_gradients(model, window)


def _logp_gradients(model, window) -> list[list[torch.Tensor]]:
    """grad of sum over completion i's tokens of log p(token | the tokens before), in
    float64, one completion per forward (no padding anywhere)."""
    import copy

    ref = copy.deepcopy(model).double()
    out = []
    for i, completion in enumerate(window.completions):
        ids = torch.tensor([window.prompts[i // window.num_generations] + completion])
        logp = torch.log_softmax(ref(ids).logits[0, :-1], dim=-1)
        picked = logp[PROMPT_TOKENS - 1 :].gather(1, ids[0, PROMPT_TOKENS:, None])
        ref.zero_grad()
        picked.sum().backward()
        out.append([p.grad.clone() for p in ref.parameters()])
    return out


def _weighted(setup, weights: list[float]) -> list[torch.Tensor]:
    """sum_i weight_i (-A_i) grad(sum_t logp_it): the gradient of a loss with these weights."""
    _, _, window, grads = setup
    total = [torch.zeros_like(g) for g in grads[0]]
    for w, a, g in zip(weights, window.advantages.tolist(), grads, strict=True):
        for t, gi in zip(total, g, strict=True):
            t.add_(gi, alpha=-a * w)
    return total


def _big_batch_weights(setup, loss_type: str) -> list[float]:
    cfg, _, window, _ = setup
    n, c = window.lengths, len(window.lengths)
    if loss_type == "grpo":
        return [1 / (ni * c) for ni in n]
    if loss_type == "dr_grpo":
        return [1 / (c * cfg.max_completion_length)] * c
    return [1 / sum(n)] * c


def _trl_weights(setup, loss_type: str) -> list[float]:
    cfg, _, window, _ = setup
    n, b, k = window.lengths, cfg.micro_batch, cfg.accum_steps
    if loss_type == "grpo":
        return [1 / (ni * b * k) for ni in n]
    if loss_type == "bnpo":
        micro_tokens = [sum(n[i - i % b : i - i % b + b]) for i in range(len(n))]
        return [1 / (nm * k) for nm in micro_tokens]
    if loss_type == "dr_grpo":
        return [1 / (b * cfg.max_completion_length * k)] * len(n)
    return [1 / sum(n)] * len(n)  # dapo: num_items_in_batch, the window's tokens


def test_the_window_varies_in_length_and_both_contestants_see_it(setup):
    cfg, _, window, _ = setup
    assert len(window.completions) == cfg.micro_batch * cfg.accum_steps
    assert max(window.lengths) >= 4 * min(window.lengths)
    assert max(window.lengths) <= cfg.max_completion_length
    ours = ours_micro_batches(window, cfg.micro_batch, "cpu")
    trl = trl_micro_batches(window, cfg.micro_batch, "cpu")
    assert [int(b["completion_mask"].sum()) for b in ours] == [
        int(b["completion_mask"].sum()) for b in trl
    ]
    assert int(trl[0]["num_items_in_batch"]) == window.tokens


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_ours_and_the_bench_reference_are_the_big_batch(setup, loss_type, tmp_path):
    cfg, model, window, _ = setup
    want = _weighted(setup, _big_batch_weights(setup, loss_type))
    reference = exact_gradient(model, window, loss_type, cfg)
    # 1e-6, not float64's 1e-15: Llama's RMSNorm computes in float32 whatever the weights' dtype
    assert whole_rel_error(reference, want) < 1e-6
    batches = ours_micro_batches(window, cfg.micro_batch, "cpu")
    assert update_check("gradaccum", model, batches, want, cfg, loss_type, str(tmp_path)) <= 1e-5


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_trl_normalises_each_micro_batch_then_divides_by_k(setup, loss_type, tmp_path):
    cfg, model, window, _ = setup
    big = _weighted(setup, _big_batch_weights(setup, loss_type))
    per_micro = _weighted(setup, _trl_weights(setup, loss_type))
    batches = trl_micro_batches(window, cfg.micro_batch, "cpu")
    assert update_check("trl", model, batches, per_micro, cfg, loss_type, str(tmp_path)) <= 1e-5
    off = update_check("trl", model, batches, big, cfg, loss_type, str(tmp_path))
    if loss_type == "bnpo":  # micro-batches of different token counts
        assert off >= 1e-2
    else:  # b k = C completions, or the window's token count: the big batch's weights
        assert off <= 1e-5


@pytest.mark.slow  # the bench with TRL's trainer
def test_the_table_and_json(llama_config, capsys):
    flags = ["--task", "grpo", "--model-config", llama_config, *SMALL_FLAGS]
    assert cli([*flags, "--loss-type", "bnpo", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    (row,) = data["results"]
    assert row["loss_type"] == "bnpo"
    assert row["gradaccum"]["update_rel_err"] <= 1e-5
    assert row["trl"]["update_rel_err"] >= 1e-2
    assert row["gradaccum"]["tokens_per_s"] > 0 and row["trl"]["tokens_per_s"] > 0
    assert data["config"]["prompts_per_step"] == 3
    assert data["config"]["completion_lengths"]["max"] <= 16


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--task", "grpo", "--num-generations", "5", "--micro-batch", "4"], "--num-generations"),
        (["--task", "grpo", "--prompts-per-step", "3"], "--prompts-per-step"),
        (["--task", "grpo", "--seq-len", "64"], "--seq-len"),
        (["--task", "grpo", "--packing", "window"], "--packing"),
        (["--task", "sft", "--loss-type", "bnpo"], "--loss-type"),
        (["--num-generations", "4"], "--num-generations"),
    ],
)
def test_bad_flags_are_one_line_naming_the_flag(argv, flag):
    with pytest.raises(BadInput) as err:
        cli(argv)
    assert str(err.value).startswith(flag) and "\n" not in str(err.value)


def test_without_trl_it_says_what_to_install(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "trl", None)
    with pytest.raises(BadInput, match=r"--task grpo: .*pip install 'gradaccum\[bench\]'"):
        cli(["--task", "grpo", "--rounds", "1"])
