"""Probe: can a split-K Triton matmul read the Qwen3-8B layer weights faster than cuBLAS at 32-64
rows? The 8B decode step at batch 64 runs its linears on cuBLAS (skinny_linear.py stops at 16
rows), and the H200 profile of the forty-sixth session put qkv at 3.05 TB/s, o_proj at 2.94 and
down_proj (cuBLAS split-K plus its reduce) at 3.2, against ~4.2 for the copy. The skinny kernel
loses there because each of its programs re-reads all of x [M, K] from L2; split over K, each
reads only its K slice.

`engine/models/splitk_linear.py`'s kernel (which this probe's first version became) writes fp32
partial sums [KS, M, N], what a consumer that sums them reads (the fused RMSNorm does); `+ sum`
adds a torch sum of the partials into the model dtype, the cost of a separate reduce. Timed as bench_linear.py times (a CUDA graph over
512 MiB of distinct weight copies, median of replays), us per call and weight-read TB/s.

    python3 bench/probe_splitk_rows.py --rows 64 --shapes "8b qkv,8b o,8b down"
"""

from __future__ import annotations

import argparse
import itertools

import bench_runtime  # noqa: F401  (puts the repository root on sys.path)
import torch
import torch.nn.functional as F
from bench_linear import ROTATE_BYTES, SHAPES, time_graph

from engine.models.splitk_linear import _splitk_kernel


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="64")
    p.add_argument("--shapes", default="8b qkv,8b o,8b down")
    p.add_argument("--splits", default="1,2,4,8")
    p.add_argument("--block-n", default="32,64,128")
    p.add_argument("--configs", default="128x4x4,128x4x6,256x8x3,64x4x8", help="BLOCK_K x warps x stages")
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args()
    dev = torch.device("cuda")
    for name, m in itertools.product(args.shapes.split(","), (int(r) for r in args.rows.split(","))):
        n, k, _ = SHAPES[name]
        w_bytes = n * k * 2
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(max(1, ROTATE_BYTES // w_bytes))]
        ws = ws * max(1, 64 // len(ws))
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        ref = F.linear(x.float(), ws[0].float())
        t = time_graph(lambda: [F.linear(x, w) for w in ws], len(ws), args.reps)  # noqa: B023
        print(f"\n{name}, {m} rows ({w_bytes / 1e6:.1f} MB): cuBLAS {t:.2f} us = {w_bytes / t / 1e6:.2f} TB/s")
        xt = x.t()
        tt = time_graph(lambda: [torch.mm(w, xt) for w in ws], len(ws), args.reps)  # noqa: B023
        ttc = time_graph(lambda: [torch.mm(w, xt).t().contiguous() for w in ws], len(ws), args.reps)  # noqa: B023
        x2 = torch.randn(2 * m, k, device=dev, dtype=torch.bfloat16)
        t2 = time_graph(lambda: [F.linear(x2, w) for w in ws], len(ws), args.reps)  # noqa: B023
        print(f"cuBLAS transposed (w @ x.T) {tt:.2f} us = {w_bytes / tt / 1e6:.2f} TB/s, with the transpose back {ttc:.2f}; "
              f"cuBLAS at {2 * m} rows {t2:.2f} us")
        rows = []
        for ks, bn, cfg in itertools.product((int(s) for s in args.splits.split(",")), (int(b) for b in args.block_n.split(",")),
                                             args.configs.split(",")):  # fmt: skip
            bk, warps, stages = (int(v) for v in cfg.split("x"))
            if k % (ks * bk) or n % bn:
                continue
            part = torch.empty(ks, m, n, device=dev, dtype=torch.float32)

            def run(ks=ks, bn=bn, bk=bk, warps=warps, stages=stages, part=part) -> None:
                for w in ws:  # noqa: B023
                    _splitk_kernel[(n // bn, ks)](x, w, part, m, n, k, BLOCK_M=max(16, m), BLOCK_N=bn, BLOCK_K=bk, KS=ks,  # noqa: B023
                                                  USE_PDL=False, num_warps=warps, num_stages=stages)  # fmt: skip

            try:
                run()
            except Exception as e:  # out of shared memory and the like
                print(f"  ks={ks} bn={bn} {cfg}: {type(e).__name__}")
                continue
            _splitk_kernel[(n // bn, ks)](x, ws[0], part, m, n, k, BLOCK_M=max(16, m), BLOCK_N=bn, BLOCK_K=bk, KS=ks,
                                          USE_PDL=False, num_warps=warps, num_stages=stages)  # fmt: skip
            err = ((part.sum(0) - ref).abs().max() / ref.abs().max()).item()
            tk = time_graph(run, len(ws), args.reps)
            ts = time_graph(lambda run=run, part=part: (run(), [part.sum(0) for _ in ws]), len(ws), args.reps)  # noqa: B023
            rows.append((tk, ks, bn, cfg, ts, err))
        rows.sort()
        print("| K splits | BLOCK_N | BLOCK_K x warps x stages | programs | us | TB/s | vs cuBLAS | us + sum | max rel err |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for tk, ks, bn, cfg, ts, err in rows[:8]:
            print(f"| {ks} | {bn} | {cfg} | {n // bn * ks} | {tk:.2f} | {w_bytes / tk / 1e6:.2f} | {t / tk:.3f} | {ts:.2f} | {err:.1e} |")
        ws.clear()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    with torch.inference_mode():
        main()
