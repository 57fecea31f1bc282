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
    ],
)
def test_bad_values_exit_2_with_one_line(capsys, args, named):
    code, out, err = run_plan(capsys, *args)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and named in err and "Traceback" not in err


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
        "import gradaccum.plan, gradaccum.plan.memory, gradaccum.plan.sizes, gradaccum.plan.presets\n"
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
        "gradaccum: error: --micro-batch 0: must be greater than zero"
    ]


def test_a_negative_size_after_its_flag_is_named_not_mistaken_for_a_flag(capsys):
    code = main(["plan", "--target-tokens", "-4M", "--seq-len", "4096", "--micro-batch", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert "--target-tokens -4M: must not be negative" in err[0]
