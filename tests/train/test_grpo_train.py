"""`gradaccum train --task grpo`: a run stopped mid-generation and resumed equals the run left
alone, bit for bit (the generation's completions and sampling log-probs are in the
checkpoint); a reward function that fails mid-run stops the run in one line naming the
checkpoint; bad --reward specs and settings are refused in one line before anything is
written. The tiny built-in GPT from its random start, a reward of its own (the count of a
distinct characters: varied rewards from the first window), short completions."""

import json
import os
import sys

import pytest
import torch
import yaml

from gradaccum.cli import main
from gradaccum.train import grpo, sft
from gradaccum.train.config import TrainConfig
from gradaccum.train.loop import train
from gradaccum.train.rundir.metrics import read_metrics

from .helpers import TIMING_FIELDS, one_line_error

REWARDS = """
calls = 0

def letters(prompts, completions, **columns):
    return [float(len(set(c))) for c in completions]

def fails_later(prompts, completions, **columns):
    global calls
    calls += 1
    if calls > 7:  # the probe, then 3 windows of 2 prompts
        raise ValueError("the grader went away")
    return [0.0] * len(completions)

def wrong_count(prompts, completions, **columns):
    return [1.0]

def share_of_a(prompts, completions, **columns):
    return [c.count("a") / max(len(c), 1) for c in completions]

def scores_zero(prompts, completions, **columns):
    return [0.0] * len(completions)
"""
STEPS = 4


@pytest.fixture
def rewards(tmp_path):
    path = tmp_path / "rewards_grpo.py"
    path.write_text(REWARDS)
    return str(path)


def config(out, rewards: str, **kw) -> TrainConfig:
    base = dict(task="grpo", model="tiny", out=str(out), seq_len=64, prompts_per_step=2, num_generations=4,
                max_completion_length=8, micro_batch=3, max_steps=STEPS, eval_every=0,
                save_every=1, lr=1e-2, eval_fraction=0, reward=f"{rewards}:letters")  # fmt: skip
    return TrainConfig(**{**base, **kw})


def records(out) -> list[dict]:
    found = read_metrics(os.path.join(out, "metrics.jsonl"))
    return [{k: v for k, v in r.items() if k not in TIMING_FIELDS + ("generation_s",)}
            for r in found]  # fmt: skip


@pytest.mark.slow  # trains past a few steps
def test_resume_mid_generation_is_bit_for_bit(tmp_path, rewards):
    # two steps per generation: stopped after step 1, the checkpoint holds the generation
    # whose second window step 2 trains on, with the sampling log-probs (the clip acts)
    kw = dict(steps_per_generation=2, beta=0.05)
    whole = train(config(tmp_path / "whole", rewards, **kw))
    assert whole["steps"] == STEPS
    stopped = train(config(tmp_path / "parts", rewards, **kw), should_stop=lambda s: s >= 1)
    assert stopped["steps"] == 1 and stopped["stopped"]
    resumed = train(config(tmp_path / "parts", rewards, resume=True, **kw))
    assert resumed["steps"] == STEPS
    one, two = records(tmp_path / "whole"), records(tmp_path / "parts")
    assert one == two and len(one) == STEPS
    assert all(r["reward_std"] > 0 for r in one)  # the rewards vary: a real gradient
    assert all(r["kl"] >= 0 for r in one) and one[-1]["kl"] > 0  # the policy moved
    assert max(r["clip_fraction"] for r in one[1::2]) > 0  # the second window of each generation
    a = torch.load(tmp_path / "whole" / "model.pt", weights_only=True)
    b = torch.load(tmp_path / "parts" / "model.pt", weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_progress_lines_name_every_reward_function_those_at_0_too(tmp_path, rewards, capsys):
    # a function that scored 0 was left out of the line: every one is there, 0.000 included
    both = f"{rewards}:letters,{rewards}:scores_zero"
    train(config(tmp_path / "run", rewards, reward=both, max_steps=1, eval_fraction=0.001,
                 save_every=0))  # fmt: skip
    printed = capsys.readouterr().out.splitlines()
    (step,) = [line for line in printed if line.startswith("step 1/1 ")]
    (held_out,) = [line for line in printed if line.startswith("step 1: eval loss")]
    (window,) = [r for r in records(tmp_path / "run") if "loss" in r]
    letters = window[f"reward_{rewards}:letters"]
    assert f"{rewards}:letters {letters:.3f}" in step and f"{rewards}:scores_zero 0.000" in step
    assert f"{rewards}:letters " in held_out and f"{rewards}:scores_zero 0.000" in held_out


def test_a_reward_failing_mid_run_stops_in_one_line_naming_the_checkpoint(
    tmp_path, rewards, capsys
):
    out = tmp_path / "run"
    argv = ["train", "--task", "grpo", "--model", "tiny", "--out", str(out), "--seq-len", "64",
            "--prompts-per-step", "2", "--num-generations", "4", "--max-completion-length", "4",
            "--max-steps", "6", "--eval-fraction", "0", "--save-every", "1",
            "--reward", f"{rewards}:fails_later"]  # fmt: skip
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"gradaccum: error: --reward {rewards}:fails_later: raised ValueError")
    assert "the checkpoint at step 3 is still there" in err and "--resume" in err


@pytest.mark.parametrize(
    "spec, words",
    [
        ("no_such_module_here:f", "no_such_module_here"),
        ("{rewards}:nothing", "nothing"),
        ("{rewards}:wrong_count", "returned 1 value"),
    ],
)
def test_a_bad_reward_is_refused_before_anything_is_written(tmp_path, rewards, capsys, spec, words):
    out = tmp_path / "run"
    spec = spec.format(rewards=rewards)
    argv = ["train", "--task", "grpo", "--out", str(out), "--reward", spec]
    line = one_line_error(capsys, argv, stdout_empty=False)
    assert line.startswith("gradaccum: error: --reward ") and words in line, line
    assert not out.exists()


@pytest.mark.parametrize(
    "argv, start",
    [
        (["--task", "grpo", "--packing", "window"], "--packing window: not with --task grpo"),
        (["--task", "grpo", "--tokens-per-step", "4096"], "--tokens-per-step 4096: a --task grpo"),
        (["--task", "grpo", "--micro-batch", "auto"], "--micro-batch auto: not with --task grpo"),
        (["--task", "sft", "--beta", "0.1"], "--beta 0.1: only with --task grpo"),
        (["--num-generations", "4"], "--num-generations 4: only with --task grpo"),
        (["--task", "grpo", "--num-generations", "1"], "--num-generations 1"),
        (["--task", "grpo", "--reward-weights", "2"], "--reward-weights 2: needs --reward"),
    ],
)
def test_settings_grpo_does_not_take(tmp_path, capsys, argv, start):
    out = tmp_path / "run"
    line = one_line_error(capsys, ["train", "--out", str(out), *argv], stdout_empty=False)
    assert line.removeprefix("gradaccum: error: ").startswith(start), line
    assert not out.exists()


def test_pretraining_data_is_refused_naming_grpo_and_what_it_reads(tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text("hello world\n")
    out = tmp_path / "run"
    argv = ["train", "--task", "grpo", "--data", str(text), "--out", str(out)]
    line = one_line_error(capsys, argv, stdout_empty=False)
    assert f"--data {text}: a .txt file is text or tokens for pretraining; --task grpo reads " \
        "a .jsonl" in line, line  # fmt: skip
    assert "--task sft" not in line and not out.exists()


@pytest.mark.slow  # 16 steps
def test_the_policy_learns_what_the_reward_asks(tmp_path, rewards):
    # From the random start a completion holds an "a" about once in 257 draws; the reward
    # is the share of "a" in it. Sixteen steps of GRPO make "a" the model's usual draw: the
    # loop's sampling, rewards, advantages and loss push the policy the reward's way.
    run = config(tmp_path / "run", rewards, reward=f"{rewards}:share_of_a", max_steps=16,
                 prompts_per_step=4, lr=1e-2, save_every=0, schedule="constant")  # fmt: skip
    train(run)
    steps = [r for r in records(tmp_path / "run") if "reward" in r]
    first, last = steps[0]["reward"], steps[-1]["reward"]
    assert first < 0.05 and last > 0.5, [round(r["reward"], 3) for r in steps]


def test_a_run_stopped_between_its_sft_stage_and_its_first_grpo_checkpoint_resumes(
    tmp_path, capsys
):
    # --out holds the finished SFT stage (out/sft) and nothing of GRPO's own (killed before
    # its first checkpoint): a rerun without --resume is told to add it, and --resume then
    # starts the GRPO stage from that model (it used to say there was no checkpoint)
    out = tmp_path / "run"
    train(TrainConfig(task="sft", model="tiny", out=str(out / "sft"), seq_len=64, max_steps=2,
                      eval_fraction=0, save_every=0))  # fmt: skip
    argv = ["train", "--task", "grpo", "--out", str(out), "--seq-len", "64",
            "--prompts-per-step", "2", "--num-generations", "2", "--max-completion-length", "4",
            "--max-steps", "1", "--eval-fraction", "0"]  # fmt: skip
    line = one_line_error(capsys, argv, stdout_empty=False)
    assert "holds a previous run; add --resume" in line, line
    assert main([*argv, "--resume"]) == 0
    steps = [r for r in records(out) if "loss" in r]
    assert [r["step"] for r in steps] == [1] and steps[0]["completions"] == 4
    assert (out / "model.pt").exists()


# ---- issue 38 item 5: a short run's evaluation is short --------------------------------------


def test_a_one_step_run_evaluates_its_share_of_the_held_out_prompts(tmp_path, capsys, monkeypatch):
    greedy, sampled = [], []
    real_greedy, real_sampled = sft.exact_match, grpo.evaluate_rewards

    def counting_greedy(model, examples, tokenizer, **kw):
        found = real_greedy(model, examples, tokenizer, **kw)
        greedy.append(found.total)  # the held-out prompts answered
        return found

    def counting_sampled(model, prompts, *args):
        sampled.append(len(prompts))
        return real_sampled(model, prompts, *args)

    monkeypatch.setattr(sft, "exact_match", counting_greedy)
    monkeypatch.setattr(grpo, "evaluate_rewards", counting_sampled)
    argv = ["train", "--task", "grpo", "--model", "tiny", "--max-steps", "1", "--seq-len", "64",
            "--prompts-per-step", "2", "--num-generations", "4", "--max-completion-length", "8",
            "--micro-batch", "4", "--out", str(tmp_path / "run")]  # fmt: skip
    assert main(argv) == 0
    # 1 step of the default run's 100: a hundredth of the built-in set's 500 held-out
    # examples and of the 256 prompts sampled, rounded up; at the start and at the end
    assert greedy == [5, 5] and sampled == [3, 3]
    out = capsys.readouterr().out
    assert (
        "eval   5 held-out prompts answered greedily, 3 x 4 completions sampled at each "
        "evaluation (a 1-step run's share of the held-out prompts; --eval-prompts N to change, "
        "0 for the held-out loss only)\n"
    ) in out


def test_a_run_as_long_as_the_default_evaluates_every_held_out_prompt():
    # docs/rl.md's figures: 500 greedy answers and 256 prompts x G sampled at each evaluation
    config = TrainConfig(task="grpo")
    assert grpo.eval_sizes(config, 100, 500) == (500, 256)
    assert grpo.eval_sizes(config, 160, 500) == (500, 256)
    assert grpo.eval_sizes(TrainConfig(task="grpo", eval_prompts=0), 100, 500) == (0, 0)
    assert grpo.eval_sizes(TrainConfig(task="grpo", eval_prompts=40), 1, 500) == (40, 40)


# ---- issue 38 item 3: a run's config.yaml from another folder --------------------------------

DIGITS = """
def digits(prompts, completions, **columns):
    return [float(sum(ch.isdigit() for ch in c)) for c in completions]
"""

SHORT_GRPO = ["--task", "grpo", "--model", "tiny", "--max-steps", "1", "--seq-len", "64",
              "--prompts-per-step", "2", "--num-generations", "4", "--max-completion-length",
              "8", "--micro-batch", "4", "--eval-prompts", "0"]  # fmt: skip


def test_a_reward_module_of_the_working_directory_is_found_from_config_yaml_anywhere(
    tmp_path, monkeypatch
):
    here, elsewhere = tmp_path / "here", tmp_path / "elsewhere"
    here.mkdir(), elsewhere.mkdir()
    (here / "rw_digits.py").write_text(DIGITS)
    monkeypatch.chdir(here)
    assert main(["train", *SHORT_GRPO, "--reward", "rw_digits:digits", "--out", "run"]) == 0
    settings = yaml.safe_load((here / "run" / "config.yaml").read_text())
    assert settings["rl"]["reward"] == f"{here}/rw_digits.py:digits"  # the file, absolute
    monkeypatch.chdir(elsewhere)
    monkeypatch.delitem(sys.modules, "rw_digits", raising=False)
    again = ["train", "--config", str(here / "run" / "config.yaml"), "--out", "again"]
    assert main(again) == 0
    assert read_metrics(str(elsewhere / "again" / "metrics.jsonl"))  # it trained


@pytest.mark.parametrize(
    "epochs, prompts_per_step, max_steps, steps",
    [(1, 2, None, 5), (2.5, 4, None, 7), (0.5, 3, None, 2), (2, 2, 3, 3), (0.01, 2, None, 1)],
)
def test_epochs_are_passes_over_the_prompts(epochs, prompts_per_step, max_steps, steps):
    # 10 prompts: E epochs are round(10 E) prompts of the stream, at --prompts-per-step a step
    # (1 -> 10/2 = 5; 2.5 -> 25/4 = 7 by ceil; 0.5 -> 5/3 = 2; 0.01 -> at least 1 prompt)
    cfg = TrainConfig(task="grpo", epochs=epochs, prompts_per_step=prompts_per_step,
                      max_steps=max_steps, micro_batch=4, num_generations=2)  # fmt: skip
    assert cfg.max_steps == max_steps  # --epochs leaves the task's default length out
    assert grpo.batch_request(cfg, 1, 10).max_steps == steps


@pytest.mark.slow
def test_an_epochs_run_trains_each_prompt_of_its_data_once_a_pass(tmp_path, rewards, capsys):
    data = tmp_path / "prompts.jsonl"
    rows = [{"prompt": f"say {c}{c}", "completion": c * 2} for c in "abcdef"]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = train(config(tmp_path / "run", rewards, data=str(data), epochs=1, max_steps=None,
                           save_every=0))  # fmt: skip
    assert summary["steps"] == summary["total_steps"] == 3  # 6 prompts, 2 a step
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("length")]
    assert line.startswith("length 3 step(s): 1 epoch(s) of 6 prompts (6 prompts read)"), line
