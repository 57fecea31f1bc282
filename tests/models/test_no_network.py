"""No network at run time. On a CPU with AVX512-BF16 bitsandbytes' import asks the Hugging Face
kernel hub for a fused kernel (`kernels.get_kernel`): a lookup, a warning on every command, and
on a networked machine a download of code. Here a process of its own takes that CPU's path
(tests/avx512bf16.py, the detection itself forced) with every connection off the machine
refused and recorded (tests/network.py): a QLoRA run with evaluations makes no attempt and
prints no warning, while the same harness records the lookup of a bare `import bitsandbytes`
(what peft before 0.22 made at its own import, and peft or trl still make when they load a
4-bit layer)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")
pytestmark = pytest.mark.slow  # each test starts a process

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

HARNESS = """
import sys
from tests import avx512bf16, network
avx512bf16.install(kernels=True)
network.refuse()
try:
    exec(sys.argv[1])
finally:
    print("network attempts:", network.ATTEMPTS, file=sys.stderr)
"""
HUB_WORDS = ("kernels-community", "gemm_4bit_forward", "trust")


def _run(code: str, *argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-c", HARNESS, code, *argv],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip


def test_the_harness_sees_the_kernel_hub_lookup_nothing_stops():
    done = _run("import bitsandbytes")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "network attempts: []" not in done.stderr, done.stderr[-2000:]
    assert "huggingface.co" in done.stderr, done.stderr[-2000:]


def test_gradaccum_imports_bitsandbytes_with_no_lookup():
    """The same import, made the way gradaccum makes it (before peft, trl or a 4-bit layer of
    its own), reaches no network and prints none of the hub's words."""
    code = "from gradaccum.models.quantized import require_bitsandbytes; require_bitsandbytes(4)"
    done = _run(code + "; import peft")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "network attempts: []" in done.stderr, done.stderr[-2000:]
    assert not [w for w in HUB_WORDS if w in done.stdout + done.stderr], done.stderr[-2000:]


def test_a_qlora_run_with_evaluations_reaches_no_network(tmp_path):
    argv = ["train", "--task", "sft", "--lora-rank", "4", "--base-bits", "4", "--max-steps", "2"]
    argv += ["--eval-every", "1", "--seq-len", "64", "--examples-per-step", "8"]
    argv += ["--micro-batch", "4", "--out", str(tmp_path / "run")]
    code = "from gradaccum.cli import main; sys.exit(main(sys.argv[2:]))"
    done = _run(code, *argv)
    said = done.stdout + done.stderr
    assert done.returncode == 0, said[-3000:]
    assert "network attempts: []" in done.stderr, done.stderr[-2000:]
    assert not [w for w in HUB_WORDS if w in said], said[-3000:]


def test_a_process_the_suite_starts_is_refused_the_network_too():
    """tests/site/sitecustomize.py, on the PYTHONPATH conftest.py hands down, refuses a child
    process's connections off the machine and its look-ups of other names."""
    code = (
        "import socket\n"
        "for reach in (lambda: socket.create_connection(('192.0.2.1', 80), timeout=5),\n"
        "              lambda: socket.getaddrinfo('example.com', 443)):\n"
        "    try:\n"
        "        reach()\n"
        "    except OSError as err:\n"
        "        print('refused' if 'refused in the test suite' in str(err) else err)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["refused", "refused"], done.stdout + done.stderr
