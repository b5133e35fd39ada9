"""The batch-invariant GEMM (engine/kernels/invariant_matmul.py) against cuBLAS (F.linear) at the
linear shapes of Qwen3-0.6B and Qwen3-8B (qkv, o, gate_up, down, lm_head), bf16, M = 1..1024 rows:
what a row's batch-independent bits cost.

Each op is timed inside a CUDA graph of many calls cycling through as many distinct weight copies
as make 512 MiB (each call reads its weight from HBM, as consecutive layers do), median of
`--reps` replays (CUDA events). Columns: microseconds per call of each, the ratio ours / cuBLAS
(above 1: the invariant kernel is slower), the same with every tile loaded through pointers
(`tma=False`) and through TMA descriptors (`tma=True`; the rule takes pointers for short split
chunks) and whether both loads give the same bits, our TFLOP/s, whether the last row of the batch has the
bits it has alone (ours: it must; cuBLAS: often not) and the largest error against fp32 math on
the same bf16 inputs, relative to the largest output.

`--rounds R` times the variants R times, interleaved, and reports each one's median (one run's
drift, up to 14 % between two columns of the same kernel on 2026-11-30, hits them all alike).

Where the rule splits K over programs (fewer output tiles than SPLIT_BELOW_TILES), a second table
times the same tile with one program a tile (`split_below=0`: a walk over the chunks; the same
bits, checked): whether the split threshold is where it should be.

`--sweep` also times a grid of output tiles (rows, columns, warps, stages) at every (shape, M),
each with the rule's K chunks (the bits), a one-chunk weight's also at BLOCK_K 128 and 256 where
they divide K (the same bits; a grid tile whose stages do not fit is skipped), and prints per
(shape, M) the rule's ratio and the best tile's. The tile may follow M (`rows_tile`), the K order may not. A
grid tile the split threshold would run a program per chunk is timed both ways (its key ends in
"split" or "walk"): the tile and where its chunks run are chosen together.

    python3 bench/kernels/invariant_matmul.py --out $OUT/invariant_matmul.json [--rows 1,16,64,256,1024] [--sweep]
"""

from __future__ import annotations

import os
import statistics
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

SHAPES = {  # name -> (N, K): N output features (q | k | v and gate | up packed), K input
    "0.6b qkv": (4096, 1024),
    "0.6b o": (1024, 2048),
    "0.6b gate_up": (6144, 1024),
    "0.6b down": (1024, 3072),
    "0.6b lm_head": (151936, 1024),
    "8b qkv": (6144, 4096),
    "8b o": (4096, 4096),
    "8b gate_up": (24576, 4096),
    "8b down": (4096, 12288),
    "8b lm_head": (151936, 4096),
}
ROTATE_BYTES = 512 << 20
# (block_m, block_n, warps, stages) the sweep times beside the rule's tile, K order the rule's.
GRID = [(bm, bn, w, st) for bm in (16, 32, 64, 128) for bn in (32, 64, 128) for w, st in ((4, 4), (4, 6), (8, 4))
        if bm * bn <= 128 * 64 or w == 8] + [(128, 256, 8, 3), (256, 128, 8, 3)]  # fmt: skip


def bench_shape(name: str, m: int, sweep: bool, reps: int, rotate_bytes: int = ROTATE_BYTES,
                n_rounds: int = 1) -> dict[str, Any]:  # fmt: skip
    from engine.kernels.invariant_matmul import (
        SPLIT_BELOW_TILES,
        Arrivals,
        invariant_matmul,
        placement,
    )
    from engine.kernels.invariant_tiles import Config, chunking, config, rows_tile

    n, k = SHAPES[name]
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(m * 7 + n)
    copies = max(1, rotate_bytes // (n * k * 2))  # 1: the same weight every call
    ws = [(torch.randn(n, k, device=dev, generator=g) * 0.02).to(torch.bfloat16) for _ in range(copies)]
    flops = 2 * m * n * k
    calls = max(copies, 64 if flops < 1e11 else 8)  # enough calls that the graph's launch is not in the time
    ws = [ws[i % copies] for i in range(calls)]
    x = torch.randn(m, k, device=dev, generator=g).to(torch.bfloat16)
    out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)

    def cublas() -> None:
        for w in ws:
            F.linear(x, w)

    arrivals = Arrivals(dev)  # as the engine runs it: a split call's last chunk sums the chunks

    def ours(cfg: Config | None = None, tma: bool | None = None, split_below: int = SPLIT_BELOW_TILES) -> Callable[[], None]:
        def run() -> None:
            for w in ws:
                invariant_matmul(x, w, out=out, cfg=cfg, arrivals=arrivals, tma=tma, split_below=split_below)
        return run

    _, chunks, tiles, splits = placement(rows_tile(config(n, k), n, k, m), m, n, k)  # splits: a program per chunk

    # Correctness first: fp32 math on the same inputs, and the last row's bits alone and in the batch.
    ref = F.linear(x.float(), ws[0].float())
    got = invariant_matmul(x, ws[0])
    err = ((got.float() - ref).abs().max() / ref.abs().max()).item()
    invariant = torch.equal(got[-1], invariant_matmul(x[-1:], ws[0])[0])
    loads_alike = torch.equal(invariant_matmul(x, ws[0], tma=True), invariant_matmul(x, ws[0], tma=False))
    cublas_invariant = torch.equal(F.linear(x, ws[0])[-1], F.linear(x[-1:], ws[0])[0])
    del ref, got

    timed = {"cublas": cublas, "ours": ours(), "pointers": ours(tma=False), "tma": ours(tma=True)}
    if splits:
        timed["walk"] = ours(split_below=0)
    rounds: dict[str, list[float]] = {key: [] for key in timed}
    for _ in range(max(1, n_rounds)):  # the variants interleaved, round after round: a drift hits all
        for key, fn in timed.items():
            rounds[key].append(time_graph(fn, len(ws), reps))
    t = {key: statistics.median(v) for key, v in rounds.items()}
    t_cublas, t_ours = t["cublas"], t["ours"]
    row: dict[str, Any] = {"shape": name, "n": n, "k": k, "m": m, "config": list(config(n, k)), "cublas_us": t_cublas,
                           "ours_us": t_ours, "ratio": t_ours / t_cublas, "pointers_ratio": t["pointers"] / t_cublas,
                           "tma_ratio": t["tma"] / t_cublas, "rounds_us": rounds,
                           "loads_alike": loads_alike, "ours_tflops": flops / t_ours / 1e6,
                           "invariant": invariant, "cublas_invariant": cublas_invariant, "max_rel_err": err,
                           "tiles": tiles, "chunks": chunks}
    if splits:
        row["walk_ratio"] = t["walk"] / t_cublas
        row["walk_bits"] = torch.equal(invariant_matmul(x, ws[0], split_below=0), invariant_matmul(x, ws[0], arrivals=arrivals))
    if sweep:
        row["sweep"] = {}
        rule = config(n, k)
        row["tile"] = list(rows_tile(rule, n, k, m))
        deep = [bk for bk in (128, 256) if k % bk == 0] if chunking(k, rule)[1] == 1 else []  # K steps of the same bits
        for (bm, bn, w, st), bk in ((tile, bk) for tile in GRID for bk in [rule.block_k, *deep]):
            c = rule._replace(block_m=bm, block_n=bn, num_warps=w, num_stages=st, block_k=bk)
            ways = {"split": SPLIT_BELOW_TILES, "walk": 0} if placement(c, m, n, k)[3] else {"": SPLIT_BELOW_TILES}
            for way, below in ways.items():
                key = str((bm, bn, w, st) + ((f"k{bk}",) if bk != rule.block_k else ()) + ((way,) if way else ()))
                try:
                    row["sweep"][key] = time_graph(ours(c, split_below=below), len(ws), reps) / t_cublas
                except Exception as e:  # out of shared memory and the like
                    say(f"{name} m={m} {c} {way}: {type(e).__name__}")
    ws.clear()
    torch.cuda.empty_cache()
    return row


def sweep_table(rows: list[dict[str, Any]]) -> list[list[Any]]:
    """Per (shape, M): the rule's tile and its ours / cuBLAS, the grid's best tile and its."""
    table = []
    for r in rows:
        best = min(r["sweep"], key=r["sweep"].get) if r["sweep"] else None
        table.append([r["shape"], r["m"], str(tuple(r["tile"])), r["ratio"], best, r["sweep"].get(best)])
    return table


def main() -> None:
    args = linear_rows_args(__doc__, "1,16,64,256,1024", list(SHAPES), ROTATE_BYTES >> 20,
                            "distinct weight copies cycled through (0: one copy, which may stay in L2)",
                            "also time GRID's output tiles and print the best per (shape, M)", rounds=True)
    rows = []
    for name, m in shape_rows(args):
        r = bench_shape(name, m, args.sweep, args.reps, args.rotate_mib << 20, args.rounds)
        rows.append(r)
        say(f"{name} M={m}: cuBLAS {r['cublas_us']:.2f} us, invariant {r['ours_us']:.2f} us ({r['ratio']:.2f}x)")
        if args.out:  # after every row: a sweep cut short by a time limit keeps what it timed
            write_json(args.out, {"device": torch.cuda.get_device_name(), "rows": rows})
    device = torch.cuda.get_device_name()
    print_table(f"batch-invariant GEMM against cuBLAS, bf16, CUDA graphs: {device}",
                ["shape", "M", "cuBLAS us", "invariant us", "invariant / cuBLAS", "pointer loads / cuBLAS",
                 "TMA loads / cuBLAS", "TMA bits = pointers'", "invariant TFLOP/s", "row bits alone = in batch", "cuBLAS: same", "max rel err"],
                [[r["shape"], r["m"], r["cublas_us"], r["ours_us"], r["ratio"], r["pointers_ratio"], r["tma_ratio"], r["loads_alike"],
                  r["ours_tflops"], r["invariant"], r["cublas_invariant"], r["max_rel_err"]] for r in rows])  # fmt: skip
    split = [r for r in rows if "walk_ratio" in r]
    if split:
        print_table("where the rule splits K over programs: the same tile, one program a tile (split_below=0)",
                    ["shape", "M", "tiles", "chunks", "split / cuBLAS", "one program a tile / cuBLAS", "same bits"],
                    [[r["shape"], r["m"], r["tiles"], r["chunks"], r["ratio"], r["walk_ratio"], r["walk_bits"]] for r in split])  # fmt: skip
    if args.sweep:
        print_table("output tiles per (shape, M), invariant / cuBLAS, K chunks the rule's",
                    ["shape", "M", "rule's tile (bm, bn, bk, warps, stages, split)", "rule",
                     "best of the grid (bm, bn, warps, stages[, BLOCK_K][, split | walk])", "best"], sweep_table(rows))  # fmt: skip


if __name__ == "__main__":
    main()
