"""What every benchmark script shares: the run's clock and log line (`say`), a free loopback port,
the JSON results file rewritten atomically, `run_section` (one section, its crash recorded,
not raised), a probe's exit without a GPU (`require_gpu`), and the flags of an in-process engine
benchmark's checkpoint (`checkpoint_args`).

Importing this module puts the repository root on sys.path, so that `engine` imports after it
work when a script runs as `python bench/<script>.py` (sys.path then holds bench/, not the root).
It imports no torch (`require_gpu` does, when called): the serving suite's client processes
import it too.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import sys
import time
import traceback
from collections.abc import Callable, Container, Iterator
from contextlib import contextmanager
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

GIB = 1 << 30
MIB = 1 << 20

T0 = time.perf_counter()


def elapsed() -> float:
    """Seconds since the script started (this module's import)."""
    return time.perf_counter() - T0


def say(msg: str) -> None:
    print(f"[{elapsed():7.1f}s] {msg}", flush=True)


def free_port() -> int:
    """A free TCP port on the loopback interface."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def engine_process_heap() -> Iterator[None]:
    """The heap as an engine process has it once built (engine/core/loop.py): what startup made,
    frozen, so the collector's full passes skip it. Without it an in-process `EngineCore` pays a full
    pass of its ~200,000 startup objects (about 0.1 s at 0.6B) every few rollout rounds, which the
    engine process never pays (bench/history/2026-11-30.md, entry q). Unfrozen on exit, so a core deleted
    afterwards can be collected."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def write_json(path: str, results: dict[str, Any]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(results, f, indent=2, default=str)
    os.replace(tmp, path)


def require_gpu(out: str, script: str) -> None:
    """A probe's start: without a CUDA GPU, write {"errors": {"gpu": ...}} to `out`, say so and exit 2."""
    import torch

    if not torch.cuda.is_available():
        write_json(out, {"errors": {"gpu": f"{script} needs an NVIDIA GPU"}})
        print(f"{script} needs an NVIDIA GPU")
        sys.exit(2)


def run_section(res: dict[str, Any], out: str, skip: Container[str], name: str, fn: Callable[..., Any], *a: Any,
                on_error: Callable[[], None] | None = None) -> Any:
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


def checkpoint_args(p: argparse.ArgumentParser) -> None:
    """`--out`, `--tiny`, `--shape`, `--model-dir`, `--seed` of a benchmark of one checkpoint
    (engine_shapes.checkpoint, on `checkpoint_spec(args)`)."""
    p.add_argument("--out", required=True)
    p.add_argument("--tiny", action="store_true", help="tiny Qwen3 on the CPU (numbers mean nothing)")
    p.add_argument("--shape", help="0.6b | 8b | DIR (default 0.6b; tiny with --tiny)")
    p.add_argument("--model-dir")
    p.add_argument("--seed", type=int, default=0)


def checkpoint_spec(args: argparse.Namespace) -> str:
    """The shape `checkpoint_args` name: --shape, else tiny with --tiny, else 0.6b."""
    return args.shape or ("tiny" if args.tiny else "0.6b")
