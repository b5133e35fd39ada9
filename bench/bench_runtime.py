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
