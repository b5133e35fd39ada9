"""The decode step's linears at few rows: cuBLAS (F.linear, + the fused SiLU-and-mul for gate_up)
against engine/kernels/skinny_linear.py, on the layer shapes of Qwen3-0.6B and Qwen3-8B (and 30B-A3B's attention), bf16.

Each op is timed as the decode step runs it: inside a CUDA graph, over as many distinct weight
copies as make 512 MiB (so every call reads its weight from HBM, not from L2, as consecutive
layers do), median of `--reps` replays; `--rotate-mib 0` times one copy, resident in L2 after the
first call (what an L2 prefetch of the next layer's weights could at best give). Columns: microseconds per call, the weight-read bandwidth
that implies, and the ratio cuBLAS time / skinny time; beside them `--deterministic`'s
batch-invariant GEMM (engine/kernels/invariant_matmul.py, its rules, split calls summed by
their last chunk; + the SiLU-and-mul for gate_up) and its ratio cuBLAS / invariant: which
few-rows kernel streams each weight fastest. With `--sweep`, every (block_n, block_k,
warps, stages) of a small grid is timed too, and the best is printed beside the default rule.

    python3 bench/kernels/linear.py --out $OUT/linear.json [--sweep]
"""

from __future__ import annotations

import itertools
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.dirname(BENCH), BENCH]

from bench_runtime import say, write_json  # noqa: E402
from device_timing import linear_rows_args, shape_rows, time_graph  # noqa: E402
from report import print_table  # noqa: E402

SHAPES = {  # name -> (N, K, silu_mul): N output features (2I packed for gate_up), K input
    "0.6b qkv": (4096, 1024, False),
    "0.6b o": (1024, 2048, False),
    "0.6b gate_up": (6144, 1024, True),
    "0.6b down": (1024, 3072, False),
    "8b qkv": (6144, 4096, False),
    "8b o": (4096, 4096, False),
    "8b gate_up": (24576, 4096, True),
    "8b down": (4096, 12288, False),
    # One rank's share at tensor parallel 2: q/k/v and gate/up split by columns, o and down by K.
    "8b/tp2 qkv": (3072, 4096, False),
    "8b/tp2 o": (4096, 2048, False),
    "8b/tp2 gate_up": (12288, 4096, True),
    "8b/tp2 down": (4096, 6144, False),
    # Qwen3-30B-A3B's attention (its experts: bench/kernels/moe.py).
    "30b-a3b qkv": (5120, 2048, False),
    "30b-a3b o": (2048, 4096, False),
}
ROTATE_BYTES = 512 << 20
GRID = list(itertools.product((16, 32, 64), (128, 256), (4, 8), (3, 5)))


def bench_shape(name: str, m: int, sweep: bool, reps: int, rotate_bytes: int = ROTATE_BYTES) -> dict[str, Any]:
    from engine.kernels import fused_ops
    from engine.kernels.invariant_matmul import invariant_matmul
    from engine.kernels.invariant_sums import Arrivals
    from engine.kernels.skinny_linear import skinny_linear

    n, k, silu = SHAPES[name]
    dev = torch.device("cuda")
    w_bytes = n * k * 2
    copies = max(1, rotate_bytes // w_bytes)  # 1: the same weight every call, resident in L2
    ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    ws = ws * max(1, 64 // copies)  # at least 64 calls per graph: its launch is not in the time
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)

    def cublas() -> None:
        for w in ws:
            y = F.linear(x, w)
            if silu:
                fused_ops.silu_and_mul(y)

    def skinny(**cfg: Any) -> Callable[[], None]:
        def run() -> None:
            for w in ws:
                skinny_linear(x, w, silu_mul=silu, **cfg)
        return run

    arrivals, inv_out = Arrivals(dev), torch.empty(m, n, device=dev, dtype=torch.bfloat16)

    def invariant() -> None:
        for w in ws:
            invariant_matmul(x, w, out=inv_out, arrivals=arrivals)
            if silu:
                fused_ops.silu_and_mul(inv_out)

    # Correctness against fp32 math on the same bf16 inputs.
    ref = F.linear(x.float(), ws[0].float())
    if silu:
        g, u = ref.chunk(2, dim=-1)
        ref = F.silu(g) * u
    got = skinny_linear(x, ws[0], silu_mul=silu).float()
    err = ((got - ref).abs().max() / ref.abs().max()).item()

    t_cublas = time_graph(cublas, len(ws), reps)
    t_default = time_graph(skinny(), len(ws), reps)
    t_invariant = time_graph(invariant, len(ws), reps)
    row: dict[str, Any] = {"shape": name, "m": m, "cublas_us": t_cublas, "skinny_us": t_default,
                           "cublas_gbs": w_bytes / t_cublas / 1e3, "skinny_gbs": w_bytes / t_default / 1e3,
                           "speedup": t_cublas / t_default, "invariant_us": t_invariant,
                           "invariant_speedup": t_cublas / t_invariant, "max_rel_err": err}
    if sweep:
        best = None
        for bn, bk, nw, ns in GRID:
            try:
                t = time_graph(skinny(block_n=bn, block_k=bk, num_warps=nw, num_stages=ns), len(ws), reps)
            except Exception as e:  # out of shared memory and the like
                say(f"{name} m={m} {(bn, bk, nw, ns)}: {type(e).__name__}")
                continue
            if best is None or t < best[0]:
                best = (t, (bn, bk, nw, ns))
        if best is not None:
            row["best_us"], row["best_cfg"] = best
            row["best_gbs"] = w_bytes / best[0] / 1e3
    ws.clear()
    torch.cuda.empty_cache()
    return row


def main() -> None:
    args = linear_rows_args(__doc__, "1,8,32,64", list(SHAPES), ROTATE_BYTES >> 20,
                            "distinct weight copies cycled through (0: one copy, which stays in L2: the bound of any prefetch)")
    rows = []
    for name, m in shape_rows(args):
        r = bench_shape(name, m, args.sweep, args.reps, args.rotate_mib << 20)
        rows.append(r)
        say(f"{name} M={m}: cuBLAS {r['cublas_us']:.2f} us, skinny {r['skinny_us']:.2f} us, invariant {r['invariant_us']:.2f} us")
    if args.out:
        write_json(args.out, {"device": torch.cuda.get_device_name(), "rows": rows})
    print_table(f"decode linears, bf16, CUDA graphs: {torch.cuda.get_device_name()}",
                ["shape", "M", "cuBLAS us", "GB/s", "skinny us", "GB/s", "cuBLAS / skinny", "invariant us",
                 "cuBLAS / invariant", "best sweep us (cfg)", "max rel err"],
                [[r["shape"], r["m"], r["cublas_us"], r["cublas_gbs"], r["skinny_us"], r["skinny_gbs"], r["speedup"],
                  r["invariant_us"], r["invariant_speedup"], f"{r['best_us']:.2f} {r['best_cfg']}" if "best_us" in r else None,
                  r["max_rel_err"]] for r in rows])


if __name__ == "__main__":
    main()
