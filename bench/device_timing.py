"""Timing on the device, shared by the suites, the kernel benchmarks and the probes: syncs and
frees, one timed copy, the copy bandwidth a roofline is measured against, the dense bf16 matmul
rate a FLOP/s target is measured against, the median time of an op replayed from a CUDA graph, and
a profile's kernels: their time by name, their share of the critical path and the idle gaps
between them."""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import torch
from bench_runtime import MIB, say


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


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


def copy_bandwidth(device: torch.device, mib: int, iters: int) -> dict[str, Any]:
    """Device-to-device copy of a bf16 tensor; bandwidth = (bytes read + bytes written) / the
    fastest of `iters` timed copies, STREAM's convention: on the H200 machines the median of 20
    moved 3973-4214 GB/s between runs on one machine while the best stayed 4194-4256
    (bench/history/2026-11-27.md), so a roofline on the median let the copy's noise pass or fail
    a target. The median stays in the result (`bandwidth_median_bytes_per_s`)."""
    n = mib * MIB // 2
    src = torch.randn(n, dtype=torch.float32, device=device).to(torch.bfloat16)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = [timed_copy(dst, src) for _ in range(iters)]
    nbytes = 2 * src.numel() * src.element_size()
    med = statistics.median(times)
    del src, dst
    free_memory(device)
    best = min(times)
    out = {"tensor_bytes": nbytes // 2, "iters": iters, "median_s": med, "min_s": best,
           "bandwidth_bytes_per_s": nbytes / best, "bandwidth_best_bytes_per_s": nbytes / best,
           "bandwidth_median_bytes_per_s": nbytes / med}
    say(f"copy: {mib} MiB bf16, best {best * 1e3:.3f} ms -> {nbytes / best / 1e9:.0f} GB/s (read + write; median "
        f"{nbytes / med / 1e9:.0f})")
    return out


def time_graph(calls: Callable[[], None], per: int, reps: int) -> float:
    """Median microseconds per op of a CUDA graph holding the `per` ops `calls()` launches (warmed
    up on a side stream first, so that compiles stay out of the capture)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        calls()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        calls()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(1e3 * a.elapsed_time(b) / per)
    return statistics.median(times)


def event_time(fn: Callable[[], object], iters: int = 20, warmup: int = 3) -> float:
    """Median seconds of fn() over iters runs, each between CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def matmul_tflops(m: int, k: int, n: int, device: torch.device, reps: int = 20) -> float:
    """bf16 TFLOP/s (2 m k n per call) of one [m, k] x [k, n] matmul into one output (torch's
    matmul: cuBLAS on a GPU): the median of `reps` replays of a CUDA graph of 20 calls on a GPU,
    the best of `reps` calls (perf_counter) elsewhere."""
    a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    b = torch.randn(k, n, device=device, dtype=torch.bfloat16)
    c = torch.empty(m, n, device=device, dtype=torch.bfloat16)
    if device.type == "cuda":
        us = time_graph(lambda: [torch.matmul(a, b, out=c) for _ in range(20)], 20, reps)
    else:
        times = []
        for _ in range(reps + 1):
            t = time.perf_counter()
            torch.matmul(a, b, out=c)
            times.append(time.perf_counter() - t)
        us = min(times[1:]) * 1e6
    return 2 * m * k * n / us / 1e6


def linear_rows_args(doc: str, rows: str, shapes: list[str], rotate_mib: int, rotate_help: str,
                     sweep_help: str | None = None, rounds: bool = False) -> argparse.Namespace:
    """The command line of a per-weight-shape linear benchmark (bench/kernels/linear.py and its
    kind): `--rows` per `--shapes` name, `--sweep` over tile configs, `--reps` graph replays,
    `--rotate-mib` of distinct weight copies cycled through, `--rounds` of the variants
    interleaved (`rounds`: a script that times several), `--out` JSON."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None)
    p.add_argument("--rows", default=rows)
    p.add_argument("--shapes", default=",".join(shapes))
    p.add_argument("--sweep", action="store_true", help=sweep_help)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--rotate-mib", type=int, default=rotate_mib, help=rotate_help)
    if rounds:
        p.add_argument("--rounds", type=int, default=1, help="time every variant this many times, interleaved; medians")
    return p.parse_args()


def shape_rows(args: argparse.Namespace) -> Iterator[tuple[str, int]]:
    """(shape name, rows) for every `--shapes` name and every `--rows` count, in that order."""
    for name in args.shapes.split(","):
        for m in (int(r) for r in args.rows.split(",")):
            yield name, m


def device_events(prof: Any) -> list[Any]:
    """A torch.profiler profile's device (CUDA) events: its kernels, copies and memsets."""
    return [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def kernel_times(events: list[Any]) -> list[tuple[str, int, float]]:
    """(name, launches, device us in all) of each kernel name (its first 90 characters), most time first."""
    kernels: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in events:
        k = kernels[e.name[:90]]
        k[0] += 1
        k[1] += e.device_time
    return sorted(((name, int(n), us) for name, (n, us) in kernels.items()), key=lambda r: -r[2])


def path_times(events: list[Any]) -> dict[str, float]:
    """Device us of each kernel name (its first 90 characters) on the critical path: the part of
    each launch's span past the end of every kernel that started before it. Under programmatic
    dependent launch a kernel starts while the one before runs and waits for it, so its own span
    counts that wait; this share does not. The shares plus the idle gaps add up to the profile's
    span."""
    path: dict[str, float] = defaultdict(float)
    end = float("-inf")  # the latest end so far
    for start, stop, name in sorted((e.time_range.start, e.time_range.end, e.name[:90]) for e in events):
        path[name] += max(0.0, stop - max(start, end))
        end = max(end, stop)
    return dict(path)


def idle_gaps(events: list[Any], steps: int) -> list[dict[str, Any]]:
    """Device idle time between consecutive kernels, grouped by (kernel before, kernel after),
    per step, largest first: where the device waits for the host or for a launch."""
    spans = sorted((e.time_range.start, e.time_range.end, e.name[:60]) for e in events)
    gaps: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0])
    end, before = spans[0][1], spans[0][2]
    for start, stop, name in spans[1:]:
        if start > end:
            g = gaps[(before, name)]
            g[0] += 1
            g[1] += start - end
        if stop > end:
            end, before = stop, name
    rows = sorted(gaps.items(), key=lambda kv: -kv[1][1])
    return [{"before": b, "after": a, "count_per_step": n / steps, "us_per_step": us / steps}
            for (b, a), (n, us) in rows[:20]]
