"""`gradaccum verify --task grpo`: sampled completions of the built-in prompts through each loss
type against the float64 big batch, and the mistakes users hit on the same completions; the
float64 reference itself against tests/test_rl.py's loop over completions and tokens; bad
input in one line."""

from __future__ import annotations

import contextlib
import copy
import io
import json

import pytest
import torch

from gradaccum import rl
from gradaccum.cli import main
from gradaccum.data.sft.builtin import builtin_rows
from gradaccum.verification.grpo import GRPOWindow
from gradaccum.verification.grpo_check import reference_grads
from gradaccum.verification.grpo_ranks import rank_micro_batches, ranks_grads
from gradaccum.verification.reference import max_rel_error
from tests.reference import make_gpt, rel_error
from tests.test_rl import MAX_LEN, VOCAB, _stack, big_batch_by_hand, rl_window

SMALL = ["--prompts-per-step", "4", "--num-generations", "4", "--max-completion-length", "12"]
"""16 completions of at most 12 tokens: the window of these tests."""


def _verify(*argv) -> tuple[int, dict]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["verify", "--task", "grpo", *SMALL, *argv, "--json"])
    return code, json.loads(out.getvalue())


@pytest.fixture(scope="module")
def four_by_four():
    """Every loss type, k = 4 micro-batches of 4 completions (one group each)."""
    return _verify("--k", "4")


def test_every_loss_type_is_the_big_batch(four_by_four):
    code, got = four_by_four
    assert code == 0 and got["passed"] is True and got["task"] == "grpo"
    assert list(got["loss_types"]) == list(rl.LOSS_TYPES)
    for loss_type, row in got["loss_types"].items():
        assert row["max_rel_err"] <= 1e-5, loss_type


def test_the_window_is_the_built_in_prompts_with_lengths_4x_apart(four_by_four):
    _, got = four_by_four
    window = got["window"]
    # the byte tokenizer: a prompt is its UTF-8 bytes, nothing added
    prompts = [len(r["prompt"].encode()) for r in builtin_rows(seed=0, n=4)]
    assert window["prompt_lengths"] == prompts
    lengths = window["completion_lengths"]
    assert len(lengths) == 16 and window["micro_batches"] == [4, 4, 4, 4]
    assert max(lengths) >= 4 * min(lengths) and max(lengths) <= 12
    assert all(n <= s for n, s in zip(lengths, window["sampled_lengths"], strict=True))
    # what bnpo divides each micro-batch by: its completion tokens
    tokens = [sum(lengths[i : i + 4]) for i in range(0, 16, 4)]
    assert got["loss_types"]["bnpo"]["counts"] == tokens
    assert got["loss_types"]["dr_grpo"]["counts"] == [4 * 12] * 4


def test_the_mistakes_on_the_same_completions(four_by_four):
    _, got = four_by_four
    k = 4
    tokens = got["loss_types"]["bnpo"]["counts"]
    assert len(set(tokens)) > 1  # ragged token counts: the premise of the per-micro-batch mistake
    for loss_type, row in got["loss_types"].items():
        ways = row["wrong_ways"]
        # the window's gradient divided by k once more: off by exactly 1 - 1/k
        assert ways["window_over_k_again"] == pytest.approx(1 - 1 / k, abs=1e-6), loss_type
        # advantages from half groups are other numbers altogether
        assert ways["group_split"] >= 1e-2, loss_type
    for loss_type in ("bnpo", "dapo"):  # token counts differ between micro-batches
        assert got["loss_types"][loss_type]["wrong_ways"]["per_micro_batch_over_k"] >= 1e-2
    # grpo and dr_grpo count completions, 4 in every micro-batch: sum_m (1/4) sum_i / k is
    # sum_i / 16, the window's own normalisation, so the per-micro-batch path is exact here
    for loss_type in ("grpo", "dr_grpo"):
        assert got["loss_types"][loss_type]["wrong_ways"]["per_micro_batch_over_k"] <= 1e-5


def test_table_of_unequal_micro_batches_with_a_kl_term(capsys):
    argv = ["--k", "3", "--beta", "0.04", "--loss-type", "grpo"]
    code = main(["verify", "--task", "grpo", *SMALL, *argv])
    out = capsys.readouterr().out
    assert code == 0 and out.rstrip().splitlines()[-1].startswith("PASS")
    assert "16 completions sampled at temperature 1" in out and "KL (--beta 0.04)" in out
    assert "k = 3 micro-batches of 5..6 completions" in out
    line = next(x for x in out.splitlines() if x.strip().startswith("grpo"))
    assert line.split()[1:4] == ["6,", "5,", "5"]
    ours, verdict, per_micro, again, split = line.split()[-5:]
    assert verdict == "PASS" and float(ours) <= 1e-5
    # 6, 5 and 5 completions: each micro-batch's mean over k weighs a completion 1/18 or 1/15
    # where the window weighs it 1/16
    assert float(per_micro) >= 1e-2
    assert float(again) == pytest.approx(2 / 3, abs=5e-3)  # as printed, 3 digits


@pytest.mark.parametrize("loss_type", rl.LOSS_TYPES)
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_the_reference_is_the_loop_by_hand(loss_type, beta):
    """verify's float64 big batch against test_rl's, completion by completion and token by
    token, on-policy (the sampling log-probs the model's own, in float64: ratio 1)."""
    model = make_gpt(seed=1, vocab=VOCAB, seq_len=24)
    model64 = copy.deepcopy(model).double()
    rows = rl_window(seed=2, beta=bool(beta))
    for row in rows:
        ids = row["input_ids"]
        with torch.no_grad():
            logp = torch.log_softmax(model64(ids)[:, :-1], dim=-1)
        row["old_logprobs"] = logp.gather(2, ids[:, 1:, None]).squeeze(2)
    want = big_batch_by_hand(model, rows, loss_type, beta=beta)
    objective = {"epsilon": 0.2, "epsilon_high": 0.28, "beta": beta,
                 "max_completion_length": MAX_LEN, "temperature": 1.0}  # fmt: skip
    got = reference_grads(model64, _stack(rows), (loss_type,), objective)[loss_type]
    assert rel_error(got, want) <= 1e-9


def test_data_is_refused_naming_grpo_and_what_it_checks(capsys):
    code = main(["verify", "--task", "grpo", *SMALL, "--data", "prompts.jsonl"])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "--data prompts.jsonl: needs --task sft; --task grpo samples its window" in err, err
    assert "pretraining" not in err


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--packing", "padding-free"], "--packing padding-free: needs --task sft"),
        (["--num-generations", "1"], "--num-generations 1: must be"),
        (["--k", "17"], "--k 17: more micro-batches than the window's 16 completions"),
        (["--k", "3", "--micro-batch", "4"], "--k 3: --micro-batch 4 cuts the window's 16"),
        (["--seq-len", "10"], "--seq-len 10: below the longest prompt"),
        (["--world-size", "5"], "--world-size 5: more ranks than --prompts-per-step 4"),
        (["--world-size", "2", "--sync", "micro"], "--sync micro: --task grpo trains under DDP"),
        (["--moe-balance", "micro"], "--moe-balance micro: needs --task pretrain or sft"),
    ],
)
def test_bad_input_is_one_line(capsys, argv, words):
    code = main(["verify", "--task", "grpo", *SMALL, *argv])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert words in err


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--task", "sft", "--beta", "0.1"], "--beta 0.1: needs --task grpo"),
        (["--loss-type", "bnpo"], "--loss-type bnpo: needs --task grpo"),
    ],
)
def test_rl_flags_need_task_grpo(capsys, argv, words):
    code = main(["verify", *argv])
    _, err = capsys.readouterr()
    assert code == 2 and words in err


def test_the_ranks_take_whole_groups_as_training_deals_them():
    # 3 prompts x G 4 on 2 ranks: groups 0 and 2 on rank 0, group 1 on rank 1, micro-batches of 3
    completions = [[5 + i % 7] * (1 + i % 5) for i in range(12)]
    rows = [([1, 2], c) for c in completions]
    batch = rl.collate(rows, rl.group_advantages(torch.rand(12), 4, True), 0)
    window = GRPOWindow(batch, torch.rand(12), 4, [12], [2] * 3, [5] * 12,
                        [len(c) for c in completions], True, "bytes")  # fmt: skip
    ranks = rank_micro_batches(window, 2, 3)
    assert [[len(b["input_ids"]) for b in r] for r in ranks] == [[3, 3, 2], [3, 1]]
    one = window.micro_batches()[0]  # the window in one micro-batch: rows in order
    dealt = {0: [0, 1, 2, 3, 8, 9, 10, 11], 1: [4, 5, 6, 7]}
    for rank, want in dealt.items():
        got = torch.cat([b["advantages"] for b in ranks[rank]])
        assert torch.equal(got, one["advantages"][want])
        masks = [b["completion_mask"].sum(1) for b in ranks[rank]]
        assert torch.equal(torch.cat(masks), one["completion_mask"].sum(1)[want])


@pytest.mark.slow
def test_two_ranks_are_the_big_batch_and_a_count_of_their_own_is_not(four_by_four):
    """--world-size 2: rank 0 holds groups 0 and 2, rank 1 groups 1 and 3 (unequal token
    counts): every loss type within the tolerance of the float64 big batch; the same ranks
    normalising each micro-batch by its own count (the per-micro-batch mistake, DDP averaging
    the ranks) are not, for a loss type counting tokens."""
    code, got = _verify("--k", "4", "--world-size", "2")
    assert code == 0 and got["passed"] is True
    for loss_type, row in got["loss_types"].items():
        assert row["world_size"] == 2 and row["ranks_max_rel_err"] <= 1e-5, loss_type
        assert row["max_rel_err"] == four_by_four[1]["loss_types"][loss_type]["max_rel_err"]
    model = make_gpt()
    window = _small_window(model)
    objective = dict(epsilon=0.2, epsilon_high=None, beta=0.0, max_completion_length=12,
                     temperature=1.0)  # fmt: skip
    want = reference_grads(torch.nn.Module.to(copy.deepcopy(model), torch.float64),
                           window.batch, ("bnpo",), objective)["bnpo"]  # fmt: skip
    right = ranks_grads(model, window, 2, 4, ("bnpo",), objective, {"precision": "fp32"}, 0)
    wrong = ranks_grads(model, window, 2, 4, ("bnpo",), objective,
                        {"precision": "fp32", "normalize": "micro_batch_mean"}, 0)  # fmt: skip
    assert max_rel_error(right["bnpo"], want) <= 1e-5
    assert max_rel_error(wrong["bnpo"], want) > 1e-2


def _small_window(model) -> GRPOWindow:
    """4 prompts x G 4 of lengths 1..12, rewards from a seed: the completions drawn, not
    sampled (the check is of the arithmetic)."""
    g = torch.Generator().manual_seed(3)
    lengths = [int(n) for n in torch.randint(1, 13, (16,), generator=g)]
    rows = [([1, 2, 3], [4 + i % 9] * n) for i, n in enumerate(lengths)]
    rewards = torch.rand(16, generator=g)
    batch = rl.collate(rows, rl.group_advantages(rewards, 4, True), 0)
    return GRPOWindow(batch, rewards, 4, [4] * 4, [3] * 4, lengths, lengths, True, "bytes")
