"""The colocated RL loop of examples/rl_colocate.py, run for real on the CPU: a trainer process
and a server, weights pushed through shared memory, outputs checked against transformers on the
trainer's updated weights (the example raises on any mismatch). Weights travel as shared memory
(update_weights_from_tensor) or over a gloo group (update_weights_from_distributed)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from server_util import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("push", ["tensor", "distributed"])
def test_colocated_loop_on_cpu(qwen3_dir: str, push: str) -> None:
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "rl_colocate.py"), "--model", qwen3_dir, "--device", "cpu",
         "--steps", "2", "--port", str(free_port()), "--push", push],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    steps = [line for line in done.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 2 and "flip" in steps[0]
    assert "rl_colocate: OK" in done.stdout
