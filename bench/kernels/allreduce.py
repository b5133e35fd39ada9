"""What one tensor-parallel all-reduce costs inside a CUDA graph, per message size and method:
NCCL (`dist.all_reduce`, what the engine used first) against torch's symmetric-memory kernels
(`one_shot`: every rank reads every peer's buffer over NVLink and sums, one kernel with a barrier
on each side; `two_shot`: reduce-scatter then all-gather through the peers' buffers).

    python3 bench/kernels/allreduce.py --out $OUT/allreduce.json

One process per GPU (all visible GPUs), bf16 messages of `tokens x hidden`. Each method runs
`--ops` back-to-back all-reduces captured in one graph, the graph replayed `--replays` times;
the table gives device microseconds per all-reduce (median replay / ops) and NCCL's time over
each other method's. Every method's sum is checked against the exact one first. NVLink multicast
is never used (`TORCH_SYMM_MEM_DISABLE_MULTICAST=1` is set before torch starts CUDA).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from collections.abc import Callable
from typing import Any

os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.dirname(BENCH), BENCH]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from bench_runtime import write_json  # noqa: E402
from report import print_table  # noqa: E402

Method = Callable[[torch.Tensor, torch.Tensor], None]  # (local input, output) -> None


def methods(symm: torch.Tensor, group_name: str) -> dict[str, Method]:
    def nccl(x: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(x)
        dist.all_reduce(out)

    def one_shot(x: torch.Tensor, out: torch.Tensor) -> None:
        buf = symm[: x.numel()].view_as(x)
        torch.ops.symm_mem.one_shot_all_reduce_copy_out(buf, x, "sum", group_name, out)

    def two_shot(x: torch.Tensor, out: torch.Tensor) -> None:
        buf = symm[: x.numel()].view_as(x)
        buf.copy_(x)
        torch.ops.symm_mem.two_shot_all_reduce_out(buf, "sum", group_name, out)

    return {"nccl": nccl, "one_shot": one_shot, "two_shot": two_shot}


def time_graph(fn: Method, x: torch.Tensor, out: torch.Tensor, ops: int, replays: int) -> float:
    """Median device microseconds per all-reduce of `ops` captured back to back."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn(x, out)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(ops):
            fn(x, out)
    times = []
    for _ in range(replays):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / ops)
    return statistics.median(times)


def run_rank(rank: int, world: int, init: str, args: argparse.Namespace, out_path: str) -> None:
    import torch.distributed._symmetric_memory as symm_mem

    device = torch.device(f"cuda:{rank}")
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=init, rank=rank, world_size=world, device_id=device)
    group_name = dist.group.WORLD.group_name
    tokens = [int(t) for t in args.tokens.split(",")]
    numel_max = max(tokens) * args.hidden
    symm = symm_mem.empty(numel_max, dtype=torch.bfloat16, device=device)
    symm_mem.rendezvous(symm, group_name)
    rows: list[dict[str, Any]] = []
    for n in tokens:
        gen = torch.Generator(device=device).manual_seed(1000 * n + rank)
        x = torch.randn((n, args.hidden), device=device, generator=gen).to(torch.bfloat16)
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x)
        exact = torch.stack([p.float() for p in parts]).sum(0)
        row: dict[str, Any] = {"tokens": n, "bytes": x.numel() * 2}
        for name, fn in methods(symm, group_name).items():
            out = torch.empty_like(x)
            fn(x, out)
            torch.cuda.synchronize()
            err = (out.float() - exact).abs().max().item()
            row[f"{name}_max_err"] = err
            row[f"{name}_us"] = time_graph(fn, x, out, args.ops, args.replays)
        rows.append(row)
    if rank == 0:
        write_json(out_path, {"world_size": world, "hidden": args.hidden, "ops_per_graph": args.ops,
                              "device": torch.cuda.get_device_name(device), "torch": torch.__version__,
                              "nccl": ".".join(map(str, torch.cuda.nccl.version())), "rows": rows})
        print_table(f"all-reduce in a CUDA graph, {world} GPUs, bf16: device us per all-reduce",
                    ["tokens x hidden", "KiB", "NCCL", "one_shot", "two_shot", "NCCL / one_shot", "NCCL / two_shot",
                     "max err (one_shot)"],
                    [[r["tokens"], r["bytes"] // 1024, r["nccl_us"], r["one_shot_us"], r["two_shot_us"],
                      r["nccl_us"] / r["one_shot_us"], r["nccl_us"] / r["two_shot_us"], r["one_shot_max_err"]]
                     for r in rows])
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--tokens", default="1,8,32,64,128,256,512,1024,4096")
    p.add_argument("--ops", type=int, default=50)
    p.add_argument("--replays", type=int, default=20)
    args = p.parse_args()
    world = torch.cuda.device_count()
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(run_rank, args=(world, f"file://{d}/rendezvous", args, args.out), nprocs=world)


if __name__ == "__main__":
    main()
