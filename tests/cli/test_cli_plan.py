import json
import subprocess
import sys

import pytest

from gradaccum.cli import main

P7 = 6_738_415_616  # Llama 2 7B


def run_plan(capsys, *args):
    code = main(["plan", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_json_by_hand(capsys):
    code, out, err = run_plan(
        capsys,
        "--target-tokens",
        "4Mi",
        "--seq-len",
        "4k",
        "--micro-batch",
        "4",
        "--devices",
        "8",
        "--model",
        "llama2-7b",
        "--steps",
        "1_000",
        "--micro-step-time",
        "300ms",
        "--json",
    )
    assert code == 0 and err == ""
    d = json.loads(out)
    # 4,194,304 / (4 x 4,000 x 8) = 32.77 -> k = 33 -> 4 x 4,000 x 33 x 8 = 4,224,000 tokens
    assert d["seq_len"] == 4000 and d["world_size"] == 8
    assert d["accum_steps"] == 33
    assert d["global_batch_tokens"] == 4_224_000
    assert d["target_deviation"] == pytest.approx((4_224_000 - 4_194_304) / 4_194_304)
    assert d["step_time_s"] == pytest.approx(33 * 0.3)
    assert d["total_time_h"] == pytest.approx(1000 * 33 * 0.3 / 3600)
    assert d["flops_total"] == 6 * P7 * 1000 * 4_224_000
    assert d["memory"]["params_gb"] == pytest.approx(2 * P7 / 1e9)
    assert d["lr"] is None and d["device_hours"] == pytest.approx(8 * 1000 * 9.9 / 3600)
    assert d["warnings"] == []  # +0.7%: within the 1% that passes without a warning


def test_table_output(capsys):
    code, out, err = run_plan(
        capsys,
        "--target-sequences",
        "256",
        "--micro-batch",
        "6",
        "--gpus",
        "8",
        "--seq-len",
        "2048",
        "--model",
        "gpt2-124m",
        "--device-memory",
        "24GB",
    )
    assert code == 0 and err == ""
    assert "accumulation steps k" in out and "sequences / step" in out and "GB" in out
    assert "warning: global batch 240 sequences is -6.2%" in out


@pytest.mark.parametrize(
    "args, named",
    [
        (["--micro-batch", "0"], "--micro-batch 0"),
        (["--micro-batch", "-2"], "--micro-batch -2"),
        (["--target-tokens", "lots"], "--target-tokens lots"),
        (["--seq-len", "1.5k5"], "--seq-len 1.5k5"),
        (["--device-memory", "80XB"], "--device-memory 80XB"),
        (["--micro-step-time", "0ms"], "--micro-step-time 0ms"),
        (["--target-sequences", "256", "--micro-batch", "300"], "--micro-batch 300"),
        (["--model", "llama9"], "--model llama9"),
        (["--mfu", "1.2", "--peak-tflops", "989"], "--mfu 1.2"),
        (["--mfu", "0", "--peak-tflops", "989"], "--mfu 0"),
        (["--zero", "7"], "--zero"),
        (["--precision", "fp8"], "--precision"),
        (["--gpus", "0"], "--gpus 0"),
        (["--gpus", "1e12", "--target-tokens", "1M"], "--gpus 1T: at most 1,000,000 devices"),
        (["--devices", "1000001"], "--gpus 1000001: at most 1,000,000 devices"),
    ],
)
def test_bad_values_exit_2_with_one_line(capsys, args, named):
    code, out, err = run_plan(capsys, *args)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and named in err and "Traceback" not in err


def test_a_plan_without_gpus_says_one_device_was_assumed(capsys):
    # 1M tokens of 512-token sequences, one per micro-batch: k = round(1e6 / 512) = 1953
    # on the one device assumed, in the table, the notes and the JSON
    args = ["--target-tokens", "1M", "--seq-len", "512", "--micro-batch", "1"]
    code, out, _ = run_plan(capsys, *args)
    assert code == 0
    devices = next(line for line in out.splitlines() if line.startswith("│ devices"))
    assert "assumed: --gpus not given" in devices
    assert "note: one device assumed (--gpus not given)" in out
    d = json.loads(run_plan(capsys, *args, "--json")[1])
    assert d["world_size"] == 1 and d["world_size_assumed"] is True and d["accum_steps"] == 1953
    # given, even as 1, nothing is assumed
    code, out, _ = run_plan(capsys, *args, "--gpus", "1")
    assert "assumed" not in out
    d = json.loads(run_plan(capsys, *args, "--gpus", "4", "--json")[1])
    assert d["world_size_assumed"] is False and d["accum_steps"] == 488  # round(1953.125 / 4)


@pytest.mark.parametrize(
    "args, first, second",
    [
        (
            ["--target-tokens", "1M", "--target-sequences", "4"],
            "--target-tokens",
            "--target-sequences",
        ),
        (["--accum-steps", "4", "--target-tokens", "1M"], "--accum-steps", "--target-tokens"),
        (["--accum-steps", "4", "--target-sequences", "8"], "--accum-steps", "--target-sequences"),
        (["--micro-batch", "4", "--micro-tokens", "8k"], "--micro-batch", "--micro-tokens"),
        (["--params", "7B", "--model", "llama2-7b"], "--params", "--model"),
        (["--steps", "10", "--total-tokens", "1B"], "--steps", "--total-tokens"),
    ],
)
def test_conflicting_flags_name_both(capsys, args, first, second):
    code, out, err = run_plan(capsys, *args)
    assert code == 2 and err.count("\n") == 1
    assert first in err and second in err


@pytest.mark.slow
def test_subprocess_no_traceback_and_no_torch():
    script = (
        "import sys\n"
        "from gradaccum.cli import main\n"
        "code = main(['plan', '--model', 'llama2-7b', '--target-tokens', '4M', '--seq-len', "
        "'4096', '--gpus', '8', '--device-memory', '80GB', '--zero', '3', '--flash-attention', "
        "'--checkpointing', 'full', '--json'])\n"
        "assert 'torch' not in sys.modules, 'gradaccum plan imported torch'\n"
        "import gradaccum.plan, gradaccum.plan.memory, gradaccum.utils.sizes, gradaccum.plan.presets\n"
        "assert 'torch' not in sys.modules\n"
        "sys.exit(code)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["memory"]["fits"] is True

    bad = subprocess.run(
        [sys.executable, "-m", "gradaccum", "plan", "--micro-batch", "0"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [
        "gradaccum: error: --micro-batch 0: must be a whole number >= 1 or auto"
    ]


def test_a_negative_size_after_its_flag_is_named_not_mistaken_for_a_flag(capsys):
    code = main(["plan", "--target-tokens", "-4M", "--seq-len", "4096", "--micro-batch", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert "--target-tokens -4M: must not be negative" in err[0]


# ---- --batch-schedule -------------------------------------------------------------------

SMALL = ["--seq-len", "1024", "--micro-batch", "1", "--total-tokens", "40k"]


def plan_json(capsys, *args):
    code, out, err = run_plan(capsys, *args, "--json")
    assert code == 0 and err == ""
    return json.loads(out)


def test_step_wise_schedule_phases_by_hand(capsys):
    d = plan_json(capsys, "--batch-schedule", "0:4k,8k:16k", *SMALL, "--micro-step-time", "100ms")
    s = d["batch_schedule"]
    # 1 x 1024 tokens per micro-step on one device.
    # 4,000 / 1,024 = 3.9 -> k 4, 4,096 tokens a step; 8,000 tokens take ceil(1.95) = 2 steps.
    # 16,000 / 1,024 = 15.6 -> k 16, 16,384 a step; 40,000 - 8,192 = 31,808 take 2 steps.
    assert [(p["accum_steps"], p["tokens_per_step"], p["steps"]) for p in s["phases"]] == [
        (4, 4096, 2),
        (16, 16384, 2),
    ]
    assert [(p["start_tokens"], p["end_tokens"], p["tokens"]) for p in s["phases"]] == [
        (0, 8192, 8192),
        (8192, 40960, 32768),
    ]
    # time: steps x k x 100 ms
    assert [p["time_s"] for p in s["phases"]] == pytest.approx([2 * 4 * 0.1, 2 * 16 * 0.1])
    assert s["total_steps"] == 4 and s["total_time_s"] == pytest.approx(4.0)
    assert s["linear"] is False and s["lr_rule"] == "none"
    assert [p["lr_factor"] for p in s["phases"]] == [1.0, 1.0]
    # the plan's own rows: the batch of the first phase, the length and time of the whole run
    assert d["accum_steps"] == 4 and d["global_batch_tokens"] == 4096
    assert d["step_time_s"] == pytest.approx(0.4)
    assert d["steps"] == 4 and d["total_tokens"] == 40960
    assert d["total_time_h"] == pytest.approx(4.0 / 3600)


def test_linear_ramp_phases_by_hand(capsys):
    d = plan_json(
        capsys, "--batch-schedule", "linear:0:2k,8k:6k", *SMALL[:4], "--total-tokens", "24k"
    )
    # target(t) = 2,000 + t / 2 up to 8,000 tokens seen, 6,000 after; k = round(target / 1024)
    # t = 0: 2,000 -> k 2, one step to 2,048; target(2,048) = 3,024 -> k 3
    # t = 2,048: k 3, one step to 5,120; target(5,120) = 4,560 -> k 4
    # t = 5,120: k 4, one step to 9,216; past the ramp, 6,000 -> k 6
    # t = 9,216: k 6 (6,144 a step): ceil((24,000 - 9,216) / 6,144) = 3 steps, to 27,648
    phases = d["batch_schedule"]["phases"]
    assert [(p["accum_steps"], p["steps"], p["end_tokens"]) for p in phases] == [
        (2, 1, 2048),
        (3, 1, 5120),
        (4, 1, 9216),
        (6, 3, 27648),
    ]
    assert d["batch_schedule"]["linear"] is True
    assert d["batch_schedule"]["total_steps"] == 6 and d["total_tokens"] == 27648
    assert all(p["time_s"] is None for p in phases) and d["batch_schedule"]["total_time_s"] is None


@pytest.mark.parametrize("rule, first", [("sqrt", 0.5), ("linear", 0.25), ("none", 1.0)])
def test_schedule_lr_belongs_to_the_last_batch(capsys, rule, first):
    d = plan_json(
        capsys, "--batch-schedule", "0:4k,8k:16k", *SMALL, "--base-lr", "1e-3", "--lr-rule", rule
    )
    # phase batches 4,096 and 16,384 tokens: c = 1/4 in the first, 1 in the last
    phases = d["batch_schedule"]["phases"]
    assert [p["lr_factor"] for p in phases] == pytest.approx([first, 1.0])
    assert [p["lr"] for p in phases] == pytest.approx([1e-3 * first, 1e-3])
    assert d["lr"] == pytest.approx(1e-3 * first)  # the plan's row: the first phase


def test_schedule_time_from_flops_per_phase(capsys):
    d = plan_json(
        capsys,
        "--batch-schedule",
        "0:4k,8k:16k",
        *SMALL,
        "--gpus",
        "2",
        "--params",
        "1M",
        "--peak-tflops",
        "0.001",
        "--mfu",
        "50%",
    )
    # 2 devices x 1,024 tokens a micro-step: k 2 (4,096 tokens) then k 8 (16,384)
    for p in d["batch_schedule"]["phases"]:
        per_step = 6 * 1e6 * p["tokens_per_step"] / (2 * 1e9 * 0.5)
        assert p["time_s"] == pytest.approx(p["steps"] * per_step)
    assert d["batch_schedule"]["total_time_s"] == pytest.approx(6 * 1e6 * 40960 / 1e9)


def test_schedule_json_keys(capsys):
    d = plan_json(capsys, "--batch-schedule", "0:4k,8k:16k", *SMALL)
    s = d["batch_schedule"]
    assert {"linear", "lr_rule", "phases", "total_steps", "total_time_s"} <= set(s)
    assert set(s["phases"][0]) >= {
        "start_tokens",
        "end_tokens",
        "accum_steps",
        "tokens_per_step",
        "steps",
        "tokens",
        "time_s",
        "lr_factor",
    }
    assert plan_json(capsys, "--target-tokens", "4k", *SMALL)["batch_schedule"] is None


def test_schedule_table(capsys):
    code, out, err = run_plan(capsys, "--batch-schedule", "0:4k,8k:16k", *SMALL)
    assert code == 0 and err == ""
    plan_table, phase_table = out.split("batch schedule 0:4k,8k:16k: ")
    assert "2 phases" in plan_table and "batch rows: the first phase" in plan_table
    assert "tokens / step = 1 x 1,024 x k x 1, LR rule none" in phase_table
    rows = [line.split("│")[1:-1] for line in phase_table.splitlines() if line.startswith("│")]
    cells = [[c.strip() for c in row] for row in rows]
    # phase, from, to, k, tokens / step, steps, tokens, time ("-": no time known), LR x
    assert cells == [
        ["1", "0", "8.19k", "4", "4,096", "2", "8.19k", "-", "1"],
        ["2", "8.19k", "41k", "16", "16,384", "2", "32.8k", "-", "1"],
        ["total", "0", "41k", "", "", "4", "41k", "-", ""],
    ]


@pytest.mark.parametrize(
    "args, named",
    [
        (["--target-tokens", "1M"], "--target-tokens 1M conflicts with --batch-schedule"),
        (["--target-sequences", "8"], "--target-sequences 8 conflicts with --batch-schedule"),
        (["--accum-steps", "4"], "--accum-steps 4 conflicts with --batch-schedule"),
        (["--base-lr", "1e-3", "--base-batch-tokens", "1M"], "--base-batch-tokens 1M conflicts"),
    ],
)
def test_schedule_excludes_other_batches(capsys, args, named):
    code, out, err = run_plan(capsys, "--batch-schedule", "0:4k,8k:16k", *SMALL, *args)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert named in err and "Traceback" not in err


@pytest.mark.parametrize(
    "schedule, rest, named",
    [
        ("4k", SMALL, "--batch-schedule 4k: '4k' is not TOKENS_SEEN:TOKENS_PER_STEP"),
        ("1k:4k", SMALL, "--batch-schedule 1k:4k: the first point must start at 0"),
        ("0:4k,8k:lots", SMALL, "--batch-schedule"),
        ("0:4k,8k:16k", SMALL[:4], "--batch-schedule 0:4k,8k:16k: needs --total-tokens"),
        ("0:4k,8k:16k", ["--micro-batch", "1", "--total-tokens", "40k"], "needs --seq-len"),
        # 1,000 tokens per step is below one micro-batch of 1,024 tokens on one device
        ("0:4k,8k:1k", SMALL, "--batch-schedule 0:4k,8k:1k: its smallest target, 1,000"),
        # 4,000 tokens per step is below 1,024 tokens on each of 8 devices
        ("0:4k,8k:16k", [*SMALL, "--gpus", "8"], "(1,024 x 8 = 8,192 tokens)"),
    ],
)
def test_bad_schedules_exit_2_with_one_line(capsys, schedule, rest, named):
    code, out, err = run_plan(capsys, "--batch-schedule", schedule, *rest)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert named in err and "Traceback" not in err


@pytest.mark.parametrize("name", ["tiny", "small"])
@pytest.mark.parametrize("given", [[], ["--seq-len", "256", "--vocab", "1000"]])
def test_plan_counts_the_built_in_gpt_as_train_builds_it(capsys, name, given):
    # Without --seq-len and --vocab, the trainer's defaults: 128 positions, the built-in
    # corpus's vocabulary; the parameters counted on the model train builds.
    from gradaccum.data.corpus import MarkovCorpus
    from gradaccum.models.build import build_model
    from gradaccum.train.config import TrainConfig

    code, out, err = run_plan(capsys, "--model", name, *given, "--json")
    assert code == 0 and err == "", err
    seq_len = int(given[1]) if given else TrainConfig().seq_len
    vocab = int(given[3]) if given else MarkovCorpus().vocab_size
    model, _ = build_model(preset=name, vocab_size=vocab, seq_len=seq_len)
    assert json.loads(out)["params"] == sum(p.numel() for p in model.parameters())
