"""Where a decode step's device time goes outside its CUDA graph: CUDA events recorded on the
step's stream at the runner's seams, then bench_engine.py's decode section run as usual (every
flag is bench_engine.py's). Prints, per seam, the median device time between two events over the
last 30 steps (the timed ones of the last batch size), and every step's cycle.

    python3 bench/probe_step_intervals.py --shape 0.6b --decode-batch-sizes 64 --skip hf,throughput,graph_memory,mixed --out $OUT/e.json

The seams (engine/runner/model_runner.py's `run`, cuda_graph.py's `run`, the graph's replay, the
sampler's `sample`):
  run -> graphs.run      the step's upload (one host-to-device copy), its int32 cast, the pending
                         tokens' copy
  graphs.run -> replay   the graph's inputs and attention metadata copied into its static buffers
  replay -> replayed     the graph: the forward and the logits
  replayed -> sample     the sampler's upload (SamplingBatch.from_plan)
  sample -> sampled      the sampler's kernels and the results' copy to the host
  sampled -> next run    until the next step's first work
In a device-bound loop (host busy below the step) each interval is device time, idle included;
events recorded by the host late show up as host time instead (compare the host-busy figure).
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable
from typing import Any

import bench_runtime  # noqa: F401  (puts the repository root on sys.path)
import torch

from engine.runner import cuda_graph, model_runner, sampler

SEAMS = ["run", "graphs.run", "replay", "replayed", "sample", "sampled"]
_marks: list[tuple[str, torch.cuda.Event]] = []


def _mark(name: str) -> None:
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    _marks.append((name, event))


def _wrap(owner: Any, attr: str, before: str, after: str | None = None) -> None:
    original: Callable[..., Any] = getattr(owner, attr)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        _mark(before)
        out = original(*args, **kwargs)
        if after is not None:
            _mark(after)
        return out

    setattr(owner, attr, wrapped)


def _report() -> None:
    """Steps are full runs of SEAMS followed by the next step's `run`."""
    torch.cuda.synchronize()
    cycles, i = [], 0
    while i + len(SEAMS) < len(_marks):
        names = [n for n, _ in _marks[i : i + len(SEAMS) + 1]]
        if names == [*SEAMS, SEAMS[0]]:
            cycles.append([e for _, e in _marks[i : i + len(SEAMS) + 1]])
            i += len(SEAMS)
        else:
            i += 1
    if not cycles:
        print("no graph-replayed decode steps recorded", file=sys.stderr)
        return
    last = cycles[-30:]
    ends = [*SEAMS[1:], "next run"]
    parts = [
        f"{a} -> {b} {statistics.median(c[k].elapsed_time(c[k + 1]) * 1e3 for c in last):.1f}"
        for k, (a, b) in enumerate(zip(SEAMS, ends, strict=True))
    ]
    total = statistics.median(c[0].elapsed_time(c[-1]) * 1e3 for c in last)
    print(f"last {len(last)} steps, median us: " + ", ".join(parts) + f"; step {total:.1f}", file=sys.stderr)
    print("every step's cycle, us: " + " ".join(f"{c[0].elapsed_time(c[-1]) * 1e3:.0f}" for c in cycles), file=sys.stderr)


def main() -> None:
    _wrap(model_runner.ModelRunner, "run", "run")
    _wrap(cuda_graph.CudaGraphRunner, "run", "graphs.run")
    _wrap(torch.cuda.CUDAGraph, "replay", "replay", "replayed")
    _wrap(sampler.Sampler, "sample", "sample", "sampled")
    import bench_engine

    try:
        bench_engine.main()
    finally:
        _report()


if __name__ == "__main__":
    main()
