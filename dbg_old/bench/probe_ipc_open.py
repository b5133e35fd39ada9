"""What opening and closing CUDA IPC handles costs when one or two processes do it at once.

A per-tensor `update_weights_from_tensor` push hands each rank one CUDA IPC handle per tensor of
the trainer (torch shares a tensor's caching-allocator segment; every tensor of 10 MB or more is a
segment of its own). At TP=2 the two ranks open and close theirs at the same time, each on its own
GPU. This probe answers whether those driver calls contend across processes:
- one: a process on GPU 0 unpickles (opens) a payload of COUNT tensors of MIB each, then frees
  them (closes);
- two GPUs: two processes do the same at once (a barrier), each its own payload on its own GPU;
- one GPU: two processes at once, both payloads on GPU 0.
Cases of the same bytes in fewer handles (and fewer bytes in as many) say whether a handle's cost
follows its count or its bytes.

Usage: python3 bench/probe_ipc_open.py [--cases 399x40,399x12,100x160] [--reps 3]
Prints a markdown table: per case and scenario, each process's open and close ms (median of reps).
Results: bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing as mp

MIB = 1 << 20


def payload(count: int, mib: int, device: str) -> tuple[list[torch.Tensor], bytes]:
    """COUNT tensors of MIB each on `device`, each its own allocation, and their pickle."""
    tensors = [torch.empty(mib * MIB, dtype=torch.uint8, device=device) for _ in range(count)]
    return tensors, bytes(ForkingPickler.dumps(tensors))


def receive(device: str, data: bytes, barrier: Any, out: Any) -> None:
    """Open every handle in `data`, wait for the device, then close them all; report both walls."""
    torch.cuda.set_device(device)
    torch.zeros(1, device=device)  # the context exists before the clock starts
    barrier.wait()
    t0 = time.perf_counter()
    tensors = ForkingPickler.loads(data)
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    del tensors
    gc.collect()
    torch.cuda.ipc_collect()
    torch.cuda.synchronize()
    out.put((device, (t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3))


def run(ctx: Any, jobs: list[tuple[str, bytes]]) -> list[tuple[str, float, float]]:
    """The receivers of `jobs` started together; their (device, open ms, close ms)."""
    barrier, out = ctx.Barrier(len(jobs)), ctx.Queue()
    procs = [ctx.Process(target=receive, args=(dev, data, barrier, out)) for dev, data in jobs]
    for p in procs:
        p.start()
    results = [out.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        if p.exitcode != 0:
            raise RuntimeError(f"a receiver exited with {p.exitcode}")
    return sorted(results)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="399x40,399x12,100x160", help="COUNTxMIB, comma-separated")
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    if torch.cuda.device_count() < 2:
        raise SystemExit("needs two CUDA GPUs")
    ctx = mp.get_context("spawn")
    print(f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}, torch {torch.__version__}")
    print("| case | scenario | process | open ms | close ms | open us per handle |")
    print("| --- | --- | --- | --- | --- | --- |")
    for case in args.cases.split(","):
        count, mib = (int(v) for v in case.split("x"))
        keep0, data0 = payload(count, mib, "cuda:0")
        keep1, data1 = payload(count, mib, "cuda:1")
        keep2, data2 = payload(count, mib, "cuda:0")
        scenarios = {
            "one": [("cuda:0", data0)],
            "two GPUs": [("cuda:0", data0), ("cuda:1", data1)],
            "one GPU": [("cuda:0", data0), ("cuda:0", data2)],
        }
        for name, jobs in scenarios.items():
            reps = [run(ctx, jobs) for _ in range(args.reps)]
            for i in range(len(jobs)):
                opens = statistics.median(r[i][1] for r in reps)
                closes = statistics.median(r[i][2] for r in reps)
                print(f"| {count} x {mib} MiB | {name} | {i} ({jobs[i][0]}) | {opens:.1f} | {closes:.1f} "
                      f"| {opens * 1e3 / count:.0f} |")
        del keep0, keep1, keep2
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
