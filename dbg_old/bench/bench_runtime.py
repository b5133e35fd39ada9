"""What every benchmark script shares: the run's clock and log line (`say`), device syncs, the
JSON results file rewritten atomically, and `run_section` (one section, its crash recorded).

Importing this module puts the repository root on sys.path, so that `engine` imports after it
work when a script runs as `python bench/<script>.py` (sys.path then holds bench/, not the root).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback
from typing import Any

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

GIB = 1 << 30
MIB = 1 << 20

T0 = time.perf_counter()


def say(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


def elapsed() -> float:
    return time.perf_counter() - T0


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def write_json(path: str, results: dict[str, Any]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(results, f, indent=2, default=str)
    os.replace(tmp, path)


def run_section(
    res: dict[str, Any], out: str, skip: Any, name: str, fn: Any, *a: Any, on_error: Any = None
) -> Any:
    """One benchmark section: skipped when asked; a crash is recorded under res["errors"] (and
    `on_error()` runs), not raised; the JSON is rewritten after every section."""
    if name in skip:
        say(f"{name}: skipped (--skip)")
        return None
    try:
        value = fn(*a)
    except Exception:
        res["errors"][name] = traceback.format_exc()
        say(f"{name}: FAILED\n{res['errors'][name]}")
        if on_error is not None:
            on_error()
        value = None
    res[name] = value
    write_json(out, res)
    return value


def timed_copy(dst: torch.Tensor, src: torch.Tensor) -> float:
    """Seconds of one `dst.copy_(src)`: CUDA events on a GPU, perf_counter on a CPU."""
    if dst.device.type != "cuda":
        t = time.perf_counter()
        dst.copy_(src)
        return time.perf_counter() - t
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    dst.copy_(src)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def table_number(x: float | None) -> str:
    """A table cell: '-' for none, ints as they are, else 4 significant-ish digits."""
    if x is None:
        return "-"
    if isinstance(x, int):
        return str(x)
    return f"{x:.4f}" if abs(x) < 1 else f"{x:.3f}" if abs(x) < 10 else f"{x:.1f}"
