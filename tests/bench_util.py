"""What the benchmark tests (test_bench_suite.py, test_bench_scripts.py, test_occupancy.py) share:
where the scripts are, which ones there are, and how a test runs one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = Path(ROOT) / "bench"
SUITES = ["bench_engine.py", "bench_serving.py", "bench_flip.py", "bench_memory.py", "bench_replicas.py",
          "bench_tp.py", "control_storm.py", "bench_speculative.py", "bench_deterministic.py"]
SCRIPTS = SUITES + sorted(f"{d}/{p.name}" for d in ("kernels", "probes") for p in (BENCH / d).glob("*.py"))


# A bound, not a speed check: the smoke runs take ~50-60 s alone on two cores and must survive a
# machine several times busier (another suite beside it, a busy loop on one of its cores).
SMOKE_TIMEOUT_S = 480


def run_script(*args: str, timeout: float = SMOKE_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
