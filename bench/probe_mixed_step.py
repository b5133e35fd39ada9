"""Where a mixed step's time goes (bench_engine.py's section mixed under torch.profiler): every flag
is bench_engine.py's; run it with `--skip copy,graph_memory,decode,throughput,hf`. The engine's
host work is labelled (record_function) at its seams, each timed run of the section by its kind
(chunk, decode, mixed), and the last repetition's runs are written as gzipped Chrome traces beside
`--out` (`<out>.chunk.trace.json.gz`, `<out>.mixed.trace.json.gz` with decode and mixed) for `analyze_trace`, which also runs
here and prints, per kind:
  - per step: wall, the host's time in each label, the device's busy time (the union of its
    kernels' intervals) and its kernel count;
  - the device's idle gaps within the run, largest first, with the host label that was open when
    the gap's next kernel was launched.

    python3 bench/probe_mixed_step.py --shape 0.6b --skip copy,graph_memory,decode,throughput,hf \
        --mixed-reps 3 --mixed-warmup 2 --out $OUT/m.json
"""

from __future__ import annotations

import gzip
import json
import os
import sys
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import bench_runtime  # noqa: F401  (puts the repository root on sys.path)
import engine_mixed
import torch
from torch.profiler import ProfilerActivity, profile, record_function

from engine.attention import layer_replay
from engine.attention import triton as triton_backend
from engine.core import engine_core, scheduler
from engine.runner import model_runner, piecewise_graph, sampler

_LABELS = [  # (owner, attribute, label): the host seams of one engine step
    (engine_core.EngineCore, "step", "step"),
    (scheduler.Scheduler, "schedule", "schedule"),
    (model_runner.ModelRunner, "launch", "launch"),
    (model_runner.ModelRunner, "run", "run"),
    (piecewise_graph.PiecewiseGraphRunner, "run", "piecewise"),
    (layer_replay.LayerReplay, "__call__", "attention"),  # one layer's attention in a piecewise step
    (triton_backend.TritonBackend, "forward", "forward"),  # its first layer's (or any not relaunched)
    (torch.cuda.CUDAGraph, "replay", "replay"),
    (sampler.Sampler, "sample", "sample"),
    (engine_core.EngineCore, "_read", "read"),
]


def _label(owner: Any, attr: str, name: str) -> None:
    original: Callable[..., Any] = getattr(owner, attr)

    def labelled(*args: Any, **kwargs: Any) -> Any:
        with record_function(f"siesta:{name}"):
            return original(*args, **kwargs)

    setattr(owner, attr, labelled)


def _profile_last_reps(out: str, reps: int) -> None:
    """Wrap the mixed section's timed runs: the last chunk run (one profile) and the last decode and
    mixed runs (another) run under the profiler; each trace is written and analysed."""
    timed = engine_mixed._timed_run
    calls = [0]
    # `reps` runs of each kind (warm-up included): the chunk's come first, then decode and mixed alternate.
    state: dict[str, Any] = {}

    def run(core: Any, device: Any, steps: int, fresh: Any, decodes: list[Any]) -> float:
        calls[0] += 1
        kind = "chunk" if not decodes else "mixed" if fresh is not None else "decode"
        if calls[0] not in (reps, 3 * reps - 1, 3 * reps):
            return timed(core, device, steps, fresh, decodes)
        if kind != "mixed":
            state["prof"] = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            state["prof"].__enter__()
        with record_function(f"siesta_run:{kind}"):
            dt = timed(core, device, steps, fresh, decodes)
        if kind != "decode":
            state["prof"].__exit__(None, None, None)
            path = f"{out}.{kind}.trace.json"
            state.pop("prof").export_chrome_trace(path)
            with open(path, "rb") as src, gzip.open(path + ".gz", "wb") as dst:
                dst.write(src.read())
            os.remove(path)
            analyze_trace(path + ".gz")
        return dt

    engine_mixed._timed_run = run


def analyze_trace(path: str) -> None:
    """Per run kind: steps' host labels, device busy and the largest device gaps (see module doc)."""
    with gzip.open(path, "rt") as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    events = [e for e in events if e.get("cat") != "gpu_user_annotation"]  # the labels' device-side copies
    runs = sorted((e for e in events if e["name"].startswith("siesta_run:")), key=lambda e: e["ts"])
    kernels = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"])
    launches = {e["args"].get("correlation"): e for e in events if e.get("cat") == "cuda_runtime"}
    host = [e for e in events if e["name"].startswith("siesta:")]
    for run in runs:
        kind, t0, t1 = run["name"].split(":")[1], run["ts"], run["ts"] + run["dur"]
        steps = [e for e in host if e["name"] == "siesta:step" and t0 <= e["ts"] < t1]
        print(f"== {kind}: run {run['dur']:.0f} us, {len(steps)} steps", file=sys.stderr)
        for s in steps:
            s0, s1 = s["ts"], s["ts"] + s["dur"]
            sums: dict[str, float] = defaultdict(float)
            counts: dict[str, int] = defaultdict(int)
            for e in host:
                if s0 <= e["ts"] < s1 and e is not s:
                    sums[e["name"][7:]] += e["dur"]
                    counts[e["name"][7:]] += 1
            mine = [k for k in kernels if (c := launches.get(k["args"].get("correlation"))) and s0 <= c["ts"] < s1]
            busy = _union(mine)
            span = (mine[-1]["ts"] + mine[-1]["dur"] - mine[0]["ts"]) if mine else 0.0
            labels = ", ".join(f"{k} {v:.0f}/{counts[k]}" for k, v in sorted(sums.items(), key=lambda kv: -kv[1]))
            print(f"  step host {s['dur']:.0f} us; its kernels: {len(mine)}, busy {busy:.0f} us over a span of "
                  f"{span:.0f} us; host labels (us/calls): {labels}", file=sys.stderr)
        inside = [k for k in kernels if t0 <= k["ts"] < t1]
        gaps = []
        for a, b in zip(inside, inside[1:], strict=False):
            gap = b["ts"] - (a["ts"] + a["dur"])
            if gap > 0:
                c = launches.get(b["args"].get("correlation"))
                at = c["ts"] if c else None
                open_ = [e["name"][7:] for e in host if at is not None and e["ts"] <= at < e["ts"] + e["dur"]]
                gaps.append((gap, b["name"][:40], "/".join(open_)))
        gaps.sort(reverse=True)
        idle = sum(g for g, _, _ in gaps)
        busy = _union(inside)
        print(f"  device: busy {busy:.0f} us, idle between kernels {idle:.0f} us in {len(gaps)} gaps; largest:",
              file=sys.stderr)
        for g, name, where in gaps[:8]:
            print(f"    {g:.0f} us before {name} (launched in {where})", file=sys.stderr)
        by_name: dict[str, list[float]] = defaultdict(list)
        for k in inside:
            by_name[k["name"][:60]].append(k["dur"])
        top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:12]
        print("  kernels by device time (us total / count): " + "; ".join(
            f"{n} {sum(d):.0f}/{len(d)}" for n, d in top), file=sys.stderr)


def _union(kernels: list[dict[str, Any]]) -> float:
    total, end = 0.0, float("-inf")
    for k in sorted(kernels, key=lambda e: e["ts"]):
        s, e = k["ts"], k["ts"] + k["dur"]
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def main() -> None:
    import bench_engine

    args = bench_engine.parse_args(sys.argv[1:])
    if not args.out:
        raise SystemExit("--out is needed: the trace is written beside it")
    for owner, attr, name in _LABELS:
        _label(owner, attr, name)
    _profile_last_reps(args.out, args.mixed_warmup + args.mixed_reps)
    bench_engine.main(sys.argv[1:])


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--analyze":
        analyze_trace(sys.argv[2])
    else:
        main()
