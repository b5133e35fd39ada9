"""Probe: is the batch decode's split-KV attention bound by DRAM or by its programs' own chains?
The backend's decode kernel (as the batch decode launches it, with PDL) timed from one CUDA graph
of L launches at the 0.6B shape's attention (16 heads, 8 KV heads, head_dim 128), each launch
reading either its own layer's cache (K/V from DRAM: L layers past L2) or layer 0's again (K/V
from L2 when one layer's K/V fits in it). A 2 GiB bf16 read (attention_kernels.read_bandwidth)
gives the run's read bandwidth. `--stamps ROWS:CONTEXT` (a row count the batch decode runs as one
split: 34 or more on 132 SMs) also stamps every program (the kernel's TIMING: %globaltimer at its start, after
its PDL wait and at its end, and its %smid) and prints how the ends spread: by the number of
programs on the SM, within one SM, the latest and earliest programs. The stamps themselves add
~3.6 us per launch (bench/RESULTS.md, twenty-seventh session): read their spread, not their sum.

    python3 bench/probe_attention_l2.py --rows 64,32 --contexts 64,128,192,530
    python3 bench/probe_attention_l2.py --rows 64 --contexts 530 --stamps 64:530,64:64,64:2000
"""

from __future__ import annotations

import argparse

import bench_runtime  # noqa: F401  (puts the repository root on sys.path)
import torch
from attention_kernels import read_bandwidth
from bench_linear import time_graph
from bench_runtime import say
from profile_fused_decode import BLOCK, decode_inputs

from engine.attention import triton_decode as td
from engine.attention.triton import TritonBackend

H, HKV, D = 16, 8, 128


def stamps_report(rows: int, context: int, layers: int) -> None:
    """Per-program %globaltimer at start, after the PDL wait and at the end, and %smid, of the
    middle launches of a graph of `layers` decode launches (own caches): what spreads the ends."""
    blocks = rows * (-(-(context + 1) // BLOCK)) + 1
    cache = torch.randn(layers, 2, blocks, BLOCK, HKV, D, device="cuda").to(torch.bfloat16)
    backend = TritonBackend(cache, D**-0.5, H, rows, context + 64)
    _, _, meta = decode_inputs(rows, context, 1000)
    q = torch.randn(rows, H, D, device="cuda").to(torch.bfloat16)
    out = torch.empty_like(q)
    splits, _ = backend.decode_splits(rows, True)
    if splits != 1:  # the kernel stamps a program's end only where it has one split
        raise SystemExit(f"--stamps {rows}:{context}: the batch decode splits {rows} rows {splits} ways; stamps need one split")
    st = torch.zeros(layers, rows * HKV * splits, 4, dtype=torch.int64, device="cuda")

    def calls() -> None:
        for i in range(layers):
            td.decode_attention(q, cache[i, 0], cache[i, 1], meta.block_tables, meta.seq_lens, out, backend.scale, splits,
                                backend._part_out, backend._part_lse, pdl_launch=True, stamps=st[i])  # fmt: skip

    us = time_graph(calls, layers, 10)
    t = st[2:-2].double().cpu()
    say(f"stamps: rows {rows}, context {context}, {splits} split(s): {us:.2f} us per launch")
    for li in range(t.shape[0]):
        t0 = t[li, :, 0].min()
        start, wait, end, sm = t[li, :, 0] - t0, t[li, :, 1] - t0, t[li, :, 2] - t0, t[li, :, 3].long()
        per_sm = torch.bincount(sm, minlength=int(sm.max()) + 1)
        n = per_sm[sm]  # programs on this program's SM
        by_n = {int(k): float(end[n == k].median()) / 1e3 for k in n.unique()}
        sm_end = torch.zeros(len(per_sm), dtype=torch.float64).scatter_reduce(0, sm, end, "amax")
        sm_first = torch.full((len(per_sm),), 1e18, dtype=torch.float64).scatter_reduce(0, sm, end, "amin")
        within = float((sm_end - sm_first)[per_sm > 0].median()) / 1e3
        if li < 3 or li == t.shape[0] - 1:
            q_ = torch.quantile(end / 1e3, torch.tensor([0.0, 0.1, 0.5, 0.9, 1.0], dtype=torch.float64)).tolist()
            say(f"  launch {li + 2}: start max {float(start.max()) / 1e3:.2f} us, wait end median {float(wait.median()) / 1e3:.2f} "
                f"max {float(wait.max()) / 1e3:.2f}; ends min/p10/p50/p90/max " + "/".join(f"{v:.2f}" for v in q_)
                + f"; programs per SM {dict(zip(*torch.unique(per_sm[per_sm > 0], return_counts=True), strict=True))}"
                + f"; median end by programs on the SM {by_n}; spread of ends within one SM (median) {within:.2f} us")  # fmt: skip
            late = torch.argsort(end, descending=True)[:10].tolist()
            early = torch.argsort(end)[:5].tolist()
            for tag, ids in (("latest", late), ("earliest", early)):
                say(f"    {tag} (program: seq, kv head | start, wait end, end us | SM, programs on it): " + "; ".join(
                    f"{p % rows},{p // rows % HKV} | {float(start[p]) / 1e3:.1f},{float(wait[p]) / 1e3:.1f},{float(end[p]) / 1e3:.1f}"
                    f" | {int(sm[p])},{int(n[p])}" for p in ids))  # fmt: skip
            dur = (end - wait) / 1e3
            say(f"    duration after the wait: min {float(dur.min()):.2f} median {float(dur.median()):.2f} max {float(dur.max()):.2f}; "
                f"ends by kv head (median): " + ", ".join(f"{float(end.view(HKV, rows)[h].median()) / 1e3:.1f}" for h in range(HKV))
                + "; by seq block of 16: " + ", ".join(f"{float(end.view(HKV, rows)[:, b * 16:(b + 1) * 16].median()) / 1e3:.1f}" for b in range(rows // 16)))  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="64")
    p.add_argument("--contexts", default="64,128,192,530")
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--stamps", default="", help="rows:context pairs to stamp, ',' separated (e.g. 64:530)")
    args = p.parse_args()
    for pair in filter(None, args.stamps.split(",")):
        r, c = pair.split(":")
        stamps_report(int(r), int(c), args.layers)
    bw = read_bandwidth()
    say(f"read bandwidth {bw / 1e9:.0f} GB/s")
    print("| rows | context | K/V per layer (MB) | own layer's cache (us) | layer 0 again (us) | DRAM time at the read bandwidth (us) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for rows in (int(r) for r in args.rows.split(",")):
        for context in (int(c) for c in args.contexts.split(",")):
            blocks = rows * (-(-(context + 1) // BLOCK)) + 1
            cache = torch.randn(args.layers, 2, blocks, BLOCK, HKV, D, device="cuda").to(torch.bfloat16)
            backend = TritonBackend(cache, D**-0.5, H, rows, context + 64)
            _, _, meta = decode_inputs(rows, context, 1000)
            q = torch.randn(rows, H, D, device="cuda").to(torch.bfloat16)
            out = torch.empty_like(q)
            own = time_graph(lambda: [backend.decode(i, q, meta, out, pdl_launch=True) for i in range(args.layers)], args.layers, 30)  # noqa: B023
            same = time_graph(lambda: [backend.decode(0, q, meta, out, pdl_launch=True) for _ in range(args.layers)], args.layers, 30)  # noqa: B023
            nbytes = rows * (context + 1) * HKV * D * 2 * 2
            print(f"| {rows} | {context} | {nbytes / 1e6:.1f} | {own:.2f} | {same:.2f} | {nbytes / bw * 1e6:.2f} |")
            torch.cuda.empty_cache()


if __name__ == "__main__":
    with torch.inference_mode():
        main()
