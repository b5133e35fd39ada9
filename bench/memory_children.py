"""The reference measurements of bench_memory.py, each in a fresh CUDA process of its own (the
bench process never opens a CUDA context): an idle process's footprint, a pinned host-to-device
copy, torch_memory_saver's own CPU backup, and the driver's floor for a region's bytes
(memory_driver.py). Run as `python bench/memory_children.py MODE ...`; `spawn_child` does.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
CHILD = os.path.abspath(__file__)


def child_idle() -> None:
    import torch

    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    print("ready", flush=True)
    sys.stdin.read()  # until the parent closes our stdin


def child_h2d(nbytes: int, iters: int) -> dict[str, Any]:
    """A pinned host buffer copied to the device `iters` times, timed with CUDA events."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    src.fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    for _ in range(3):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    med = statistics.median(times)
    return {"bytes": nbytes, "iters": iters, "median_s": med, "min_s": min(times),
            "bandwidth_bytes_per_s": nbytes / med, "bandwidth_best_bytes_per_s": nbytes / min(times)}


def child_tms(nbytes: int, iters: int) -> dict[str, Any]:
    """torch_memory_saver's own weight offload: a bf16 tensor of `nbytes` in a region with
    `enable_cpu_backup=True`; pause (device -> host, then unmap) and resume (map, host -> device)
    timed `iters` times, the content checked against a copy outside the region each time."""
    import torch
    from torch_memory_saver import torch_memory_saver as tms

    kwargs: dict[str, Any] = {"tag": "w", "enable_cpu_backup": True, "cpu_backup_backend": "pinned"}
    try:
        with tms.region(**kwargs):
            w = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    except TypeError:  # an older torch_memory_saver without cpu_backup_backend
        kwargs.pop("cpu_backup_backend")
        with tms.region(**kwargs):
            w = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    w.normal_(generator=torch.Generator(device="cuda").manual_seed(0))
    ref = w.clone()  # outside the region: never paused
    torch.cuda.synchronize()
    cycles = []
    for _ in range(iters):
        f0 = torch.cuda.mem_get_info()[0]
        t = time.perf_counter()
        tms.pause("w")
        torch.cuda.synchronize()
        pause_s = time.perf_counter() - t
        f1 = torch.cuda.mem_get_info()[0]
        t = time.perf_counter()
        tms.resume("w")
        torch.cuda.synchronize()
        resume_s = time.perf_counter() - t
        f2 = torch.cuda.mem_get_info()[0]
        cycles.append({"pause_s": pause_s, "resume_s": resume_s, "bytes_freed": f1 - f0, "bytes_restored": f1 - f2,
                       "identical": bool(torch.equal(w, ref))})
    steady = cycles[1:] or cycles
    resume_med = statistics.median(c["resume_s"] for c in steady)
    return {"bytes": w.numel() * w.element_size(), "iters": iters, "region_kwargs": {k: v for k, v in kwargs.items() if k != "tag"},
            "cycles": cycles, "pause_median_s": statistics.median(c["pause_s"] for c in steady),
            "resume_median_s": resume_med, "restore_bandwidth_bytes_per_s": w.numel() * w.element_size() / resume_med,
            "all_identical": all(c["identical"] for c in cycles)}


def child_driver(nbytes: int, iters: int, wait_s: float, chunk: int | None = None) -> dict[str, Any]:
    """The driver's own cost for `nbytes` in handles of `chunk` bytes (default: one handle; as
    torch_memory_saver allocates a region): pause = unmap + release; resume = create + map + set
    access; each `iters` times right after the pause and `iters` times `wait_s` after it (pages
    scrubbed)."""
    import torch

    sys.path[:0] = [HERE, os.path.dirname(HERE)]  # bench/ and the repository root
    from memory_driver import Driver, cycle, mapped

    torch.zeros(1, device="cuda")
    drv = Driver(torch.cuda.current_device())
    size = nbytes - nbytes % drv.granularity
    handles = -(-size // chunk) if chunk else 1
    step = size // handles - (size // handles) % drv.granularity  # equal handles of about `chunk`
    region = mapped(drv, step * handles, step)
    out: dict[str, Any] = {"bytes": region.total, "wait_s": wait_s, "handles": handles}
    for name, gap in (("right_after", 0.0), ("after_wait", wait_s)):
        pauses, resumes = [], []
        for _ in range(iters):
            time.sleep(wait_s)  # the previous resume's pages settle
            unmap, release, *resume = cycle(region, gap)
            pauses.append(unmap + release)
            resumes.append(sum(resume))
            region.touch()
        out[name] = {"pause_median_s": statistics.median(pauses), "resume_median_s": statistics.median(resumes),
                     "pause_s": pauses, "resume_s": resumes}
    region.pause()
    return out


def run_child(argv: list[str]) -> int:
    """argv: MODE [NBYTES ITERS [WAIT_S]]; prints the result as one JSON line (idle: "ready")."""
    if not argv or argv[0] not in ("idle", "h2d", "tms", "driver"):
        print("usage: memory_children.py idle | h2d NBYTES ITERS | tms NBYTES ITERS | driver NBYTES ITERS WAIT_S [CHUNK]",
              file=sys.stderr)
        return 2
    mode = argv[0]
    if mode == "idle":
        child_idle()
        return 0
    nbytes, iters = int(argv[1]), int(argv[2])
    if mode == "driver":
        out = child_driver(nbytes, iters, float(argv[3]), int(argv[4]) if len(argv) > 4 else None)
    else:
        out = child_h2d(nbytes, iters) if mode == "h2d" else child_tms(nbytes, iters)
    print(json.dumps(out), flush=True)
    return 0


def spawn_child(mode: str, *args: Any, env: dict[str, str] | None = None, timeout: float = 240) -> dict[str, Any]:
    cmd = [sys.executable, CHILD, mode, *map(str, args)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if p.returncode != 0:
        raise RuntimeError(f"child {mode} exited with {p.returncode}:\n{p.stderr[-4000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    sys.exit(run_child(sys.argv[1:]))
