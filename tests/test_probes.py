"""The GPU probes without a GPU: phase_stamps.py's reading of a stamps tensor (what the batch
kernel's TIMING stamps write: grid_barrier.stamp), and each probe's exit when there is no GPU."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch
from bench_util import run_script

PROBE = os.path.join("bench", "probes", "phase_stamps.py")
NEED_A_GPU = ["phase_stamps.py", "weight_stream.py"]


def _probe():  # noqa: ANN202
    spec = importlib.util.spec_from_file_location("phase_stamps", PROBE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_read_gives_each_points_first_and_last_program_after_the_launchs_first_start() -> None:
    probe = _probe()
    layers, programs = 4, 3
    t = torch.zeros(layers + 1, programs, 32, dtype=torch.int64)
    for launch in range(layers + 1):
        base = 1_000_000 * (launch + 1)
        t[launch, :, 12] = torch.tensor([base + 100, base, base + 50])  # launch clock: program 1 first
        t[launch, :, 1] = torch.tensor([base + 2_100, base + 3_000, base + 2_600])  # o_proj
        t[launch, 0, 19] = base + 9_000  # one program merges
    got = probe.read(t)
    # the first and last launches are left out; ns -> us from the earliest start
    assert got[1] == [(2.1, 3.0)] * (layers - 1)
    assert got[19] == [(9.0, 9.0)] * (layers - 1)
    assert got[11] == [] and got[5] == []  # points no program stamped


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
@pytest.mark.parametrize("probe", NEED_A_GPU)
def test_without_a_gpu_it_exits_2_saying_why(probe: str, tmp_path: str) -> None:
    out = os.path.join(tmp_path, "probe.json")
    p = run_script(os.path.join("bench", "probes", probe), "--out", out)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert f"{probe} needs an NVIDIA GPU" in p.stdout
    with open(out) as f:
        assert "gpu" in json.load(f)["errors"]
