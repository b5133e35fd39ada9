"""How fast one launch streams a Qwen3-0.6B layer's weights at one row, the bound under the
persistent decode kernels' four GEMV phases (engine/kernels/grid_phases.py): a GEMV y = W x
through tl.dot (x padded to tl.dot's 16 rows, as the engine's few-row kernels), one flattened
loop over (tile, K step) per program so the software pipeline streams across tiles, over a
[15360, 1024] bf16 weight (the layer's 31.5 MB), 16 copies rotating so every call reads HBM.

Prints the best configs (BN, BK, programs an SM, warps, stages) of a sweep, the persistent
kernel's few-row config, the same bytes as four launches (o, gate_up, down, qkv) and cuBLAS, and
a 256 MiB copy (bench_engine.py's roofline bandwidth) in the same run.

    python3 bench/probes/weight_stream.py --out $OUT/stream.json

Needs a GPU: without one it exits 2 saying so.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from typing import Any

import torch
import triton
import triton.language as tl

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.dirname(BENCH), BENCH]

from bench_runtime import require_gpu, write_json  # noqa: E402

LAYER = [(1024, 2048), (6144, 1024), (1024, 3072), (4096, 1024)]  # Qwen3-0.6B: o, gate_up, down, qkv
WHOLE = (15360, 1024)  # the same 31.5 MB as one weight
COPIES = 16
SWEEP = list(itertools.product((16, 32, 64), (128, 256), (1, 2), (4, 8), (3, 5)))
FEW_ROWS = (32, 128, 1, 4, 5)  # engine/decode/batch_consts.py: BN, FEW_BK, one program an SM, 4 warps, FEW_STAGES


@triton.jit
def stream_kernel(w_ptr, x_ptr, y_ptr, N, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, P: tl.constexpr):
    # Program pid: tiles pid, pid + P, ... of BN rows, each over K in BK steps, one loop.
    pid = tl.program_id(0)
    KSTEPS: tl.constexpr = K // BK
    mine = tl.cdiv(N // BN - pid, P)
    r16 = tl.arange(0, 16)[:, None]
    rows0 = tl.arange(0, BN)
    cols = tl.arange(0, BK)
    acc = tl.zeros([16, BN], tl.float32)
    for i in range(0, mine * KSTEPS):
        rows = (pid + (i // KSTEPS) * P) * BN + rows0
        kk = (i % KSTEPS) * BK
        w = tl.load(w_ptr + rows[:, None].to(tl.int64) * K + kk + cols[None, :])
        x = tl.load(x_ptr + kk + cols[None, :] + r16 * 0, mask=r16 < 1, other=0.0)  # [16, BK], row 0 real
        acc = tl.dot(x, tl.trans(w), acc)
        if i % KSTEPS == KSTEPS - 1:
            tl.store(y_ptr + rows[None, :] + r16 * 0, acc, mask=r16 < 1)
            acc = tl.zeros([16, BN], tl.float32)


def measure(reps: int) -> dict[str, Any]:
    import torch.nn.functional as F
    from device_timing import time_graph

    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count

    def gemv(w: torch.Tensor, x: torch.Tensor, y: torch.Tensor, bn: int, bk: int, per_sm: int, warps: int, stages: int) -> None:
        n, k = w.shape
        stream_kernel[(sms * per_sm,)](w, x, y, n, K=k, BN=bn, BK=bk, P=sms * per_sm, num_warps=warps, num_stages=stages)

    whole = [torch.randn(WHOLE, device=dev, dtype=torch.bfloat16) for _ in range(COPIES)]
    parts = [[torch.randn(n, k, device=dev, dtype=torch.bfloat16) for n, k in LAYER] for _ in range(COPIES)]
    xs = {k: torch.randn(k, device=dev, dtype=torch.bfloat16) for k in {k for _, k in LAYER}}
    y = torch.empty(WHOLE[0], device=dev, dtype=torch.float32)
    gemv(whole[0], xs[1024], y, *FEW_ROWS)
    error = float((y - whole[0].float() @ xs[1024].float()).abs().max())
    mb = WHOLE[0] * WHOLE[1] * 2 / 1e6
    sweep = []
    for cfg in SWEEP:
        us = time_graph(lambda cfg=cfg: [gemv(w, xs[1024], y, *cfg) for w in whole], COPIES, reps)
        sweep.append({"config": cfg, "us": us, "gb_s": mb * 1e3 / us})
    sweep.sort(key=lambda r: r["us"])
    best = sweep[0]["config"]
    four = {name: time_graph(lambda cfg=cfg: [gemv(w, xs[w.shape[1]], y, *cfg) for ws in parts for w in ws], COPIES, reps)
            for name, cfg in (("best", best), ("few_rows", FEW_ROWS))}  # fmt: skip
    rows = {k: v[None, :] for k, v in xs.items()}
    cublas = time_graph(lambda: [F.linear(rows[1024], w) for w in whole], COPIES, reps)
    cublas_four = time_graph(lambda: [F.linear(rows[w.shape[1]], w) for ws in parts for w in ws], COPIES, reps)
    a = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    copy_us = time_graph(lambda: b.copy_(a), 1, reps)
    return {"mb": mb, "max_abs_error": error, "sweep": sweep, "few_rows_us": next(r["us"] for r in sweep if r["config"] == FEW_ROWS),
            "four_launches_us": four, "cublas_us": cublas, "cublas_four_us": cublas_four,
            "copy_gb_s": 2 * a.numel() / copy_us / 1e3}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    require_gpu(args.out, "weight_stream.py")
    r = measure(args.reps)
    print(f"one launch of {r['mb']:.1f} MB at one row (max |error| {r['max_abs_error']:.2g}); best configs:")
    for s in r["sweep"][:8]:
        print(f"  {s['us']:.2f} us, {s['gb_s']:.0f} GB/s: BN, BK, programs an SM, warps, stages = {s['config']}")
    print(f"the persistent kernel's few-row config {FEW_ROWS}: {r['few_rows_us']:.2f} us")
    print(f"four launches (o, gate_up, down, qkv): {r['four_launches_us']['best']:.2f} us (best config), "
          f"{r['four_launches_us']['few_rows']:.2f} us (few-row config)")  # fmt: skip
    print(f"cuBLAS: one weight {r['cublas_us']:.2f} us, the four {r['cublas_four_us']:.2f} us")
    print(f"copy of 256 MiB: {r['copy_gb_s']:.0f} GB/s read + written")
    write_json(args.out, r)


if __name__ == "__main__":
    main()
