"""The benchmark scripts run on the device machine only, so CI checks what it can of them: each
parses its arguments (`--help`) without a GPU, and bench_memory.py without a GPU exits 2 with a
JSON file that says why, instead of a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("script", ["bench_engine.py", "bench_memory.py", "bench_fused_ops.py", "probe_vmm_driver.py"])
def test_benchmarks_parse_their_arguments_anywhere(script: str) -> None:
    p = _run(os.path.join("bench", script), "--help")
    assert p.returncode == 0, p.stderr
    assert "usage:" in p.stdout and "Traceback" not in p.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_bench_memory_without_a_gpu_says_why(tmp_path: str) -> None:
    out = os.path.join(tmp_path, "memory.json")
    p = _run(os.path.join("bench", "bench_memory.py"), "--out", out)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert "needs an NVIDIA GPU" in p.stdout
    with open(out) as f:
        assert "gpu" in json.load(f)["errors"]
