"""The example loop the README points to runs as written (one process)."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_own_loop_example_runs_and_steps_once_per_window():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "own_loop.py")],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=True,
    ).stdout
    lines = [line for line in out.splitlines() if line.startswith("step ")]
    # 32 micro-batches in windows of 8: four optimizer steps, eight micro-steps each
    assert [line.split(":")[0] for line in lines] == ["step 1", "step 2", "step 3", "step 4"]
    assert all("8 micro-steps" in line for line in lines)
