"""Fused MoE (engine/kernels/fused_moe.py) at the Qwen3-30B-A3B layer shape (hidden 2048,
moe_intermediate 768, 128 experts, top-8, bf16), on a GPU, against:

- the bytes-read roofline: the distinct experts a call's tokens route to (counted), each read
  once (gate_up 2I x H and down H x I, bf16), plus x and out, at the copy bandwidth measured in
  the same run (device_timing.copy_bandwidth);
- a plain torch reference (engine/models/moe.py's loop over the experts that have tokens; its
  per-expert counts come to the host, so it runs eagerly, timed with CUDA events);
- the dense bf16 matmul rate measured in the same run (a [T*k, H] x [H, 3I] GEMM's FLOP/s is the
  ceiling a grouped GEMM of T*k rows can hope for): the prefill target is a ratio of it.

fused_moe runs as a decode step runs it: inside a CUDA graph, `--layers` weight copies with their
own routings cycled (so the experts come from HBM, not from L2, as consecutive layers do),
median of `--reps` replays. The routing is softmax top-8 of random logits (near-uniform: the
most distinct experts for T). `topk_softmax` is timed apart (its own graph), and at T <= 4 the
one-launch router (moe_router.py `router_topk`, a [128, 2048] router per layer copy) at its
default K splits and at one, and at 1, 2, 4 and 8 warps a program.

`--sweep` (T <= 4, the one-tile-a-pair path): every (gate_up block_n, down block_n, block_k,
stages) of a small grid is timed too, and the best is printed beside the default rule.

    python3 bench/kernels/moe.py --out $OUT/moe.json [--tokens 1,8,64,256,2048] [--sweep]
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
from typing import Any

import torch

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.dirname(BENCH), BENCH]

from bench_runtime import say, write_json  # noqa: E402
from device_timing import copy_bandwidth, event_time, matmul_tflops, time_graph  # noqa: E402
from report import print_table  # noqa: E402

HIDDEN, INTER, EXPERTS, TOP_K = 2048, 768, 128, 8
SWEEP = list(itertools.product((16, 32, 64), (32, 64, 128), (128, 256), (3, 4, 6)))  # up bn, down bn, bk, stages


def dense_tflops(rows: int, reps: int) -> float:
    """bf16 FLOP/s of one [rows, H] x [H, 3I] matmul (cuBLAS), in TFLOP/s."""
    return matmul_tflops(max(rows, 16), HIDDEN, 3 * INTER, torch.device("cuda"), reps)


def bench_router(T: int, reps: int, copies: int) -> dict[str, Any]:
    """Microseconds of router_topk (the GEMV and top-k in one launch) at its default K splits and
    at one, and at its default splits with 1, 2, 4 and 8 warps; a graph cycling `copies` routers."""
    from engine.kernels.fused_moe import shared_workspace
    from engine.kernels.moe_router import WARPS, router_topk, splits

    dev, dt = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(T)
    x = torch.randn(T, HIDDEN, device=dev, dtype=dt, generator=g)
    gates = [(torch.randn(EXPERTS, HIDDEN, device=dev, generator=g) * HIDDEN**-0.5).to(dt) for _ in range(copies)]
    ws = shared_workspace(T, EXPERTS, TOP_K, HIDDEN, INTER, dt, dev)
    out = (torch.empty(T, TOP_K, device=dev), torch.empty(T, TOP_K, dtype=torch.int32, device=dev))

    def run(split: int, warps: int | None = None) -> float:
        return time_graph(lambda: [router_topk(x, w, TOP_K, True, ws, out=out, split=split, warps=warps) for w in gates],
                          copies, reps)  # fmt: skip

    by_warps = {w: run(splits(HIDDEN), w) for w in sorted({1, 2, 4, 8, WARPS})}
    row = {"router_splits": splits(HIDDEN), "router_us": by_warps[WARPS], "router_one_split_us": run(1),
           "router_warps_us": by_warps}  # fmt: skip
    say(f"T={T}: router {row['router_us']:.2f} us; by warps {row['router_warps_us']}")
    return row


def sweep_tokens(T: int, x: torch.Tensor, layers: list[tuple[torch.Tensor, torch.Tensor]], routes: list, outs: list,
                 ws: Any, reps: int) -> dict[str, Any]:  # fmt: skip
    """The fastest tiles of the one-tile-a-pair path at T tokens over SWEEP: (us, config)."""
    from engine.kernels.fused_moe import fused_moe
    from engine.kernels.moe_tiles import GemmConfig

    best: tuple[float, tuple[int, ...]] | None = None
    for up_n, down_n, bk, stages in SWEEP:
        cfg = (GemmConfig(16, up_n, bk, 4, stages), GemmConfig(16, down_n, bk, 4, stages))

        def calls(cfg: tuple[GemmConfig, GemmConfig] = cfg) -> None:
            for (w13, w2), (w, ids), out in zip(layers, routes, outs, strict=True):
                fused_moe(x, w13, w2, w, ids, out=out, workspace=ws, configs=cfg)

        try:
            us = time_graph(calls, len(layers), reps)
        except Exception as e:  # out of shared memory and the like
            say(f"T={T} {(up_n, down_n, bk, stages)}: {type(e).__name__}")
            continue
        if best is None or us < best[0]:
            best = (us, (up_n, down_n, bk, stages))
    return {} if best is None else {"best_us": best[0], "best_cfg": best[1]}


def bench_tokens(T: int, layers: list[tuple[torch.Tensor, torch.Tensor]], bandwidth: float, reps: int,
                 sweep: bool = False) -> dict[str, Any]:  # fmt: skip
    from engine.kernels.fused_moe import fused_moe, shared_workspace, topk_softmax
    from engine.kernels.moe_tiles import pair_tiles_apply
    from engine.models.moe import reference_moe

    dev, dt = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(T)
    x = torch.randn(T, HIDDEN, device=dev, dtype=dt, generator=g)
    logits = [torch.randn(T, EXPERTS, device=dev, generator=g) for _ in layers]
    routes = [topk_softmax(lg, TOP_K, True) for lg in logits]
    outs = [torch.empty(T, HIDDEN, device=dev, dtype=dt) for _ in layers]
    ws = shared_workspace(T, EXPERTS, TOP_K, HIDDEN, INTER, dt, dev)
    distinct = statistics.mean(ids.unique().numel() for _, ids in routes)
    expert_bytes = 3 * HIDDEN * INTER * 2
    roofline_us = (distinct * expert_bytes + 2 * T * HIDDEN * 2) / bandwidth * 1e6

    def ours() -> None:
        for (w13, w2), (w, ids), out in zip(layers, routes, outs, strict=True):
            fused_moe(x, w13, w2, w, ids, out=out, workspace=ws)

    def routing() -> None:
        for lg in logits:
            topk_softmax(lg, TOP_K, True)

    ours_us = time_graph(ours, len(layers), reps)
    route_us = time_graph(routing, len(layers), reps)
    (w13, w2), (w, ids) = layers[0], routes[0]
    ref_us = 1e6 * event_time(lambda: reference_moe(x, w13, w2, w, ids), iters=max(3, reps // 4), warmup=1)
    ref = reference_moe(x, w13, w2, w, ids).float()
    err = ((outs[0].float() - ref).abs().max() / ref.abs().max()).item()
    flops = 2 * T * TOP_K * 3 * HIDDEN * INTER
    row = {"tokens": T, "distinct_experts": distinct, "fused_us": ours_us, "topk_softmax_us": route_us,
           "torch_us": ref_us, "roofline_us": roofline_us, "roofline_ratio": roofline_us / ours_us,
           "tflops": flops / ours_us / 1e6, "dense_tflops": dense_tflops(T * TOP_K, reps),
           "max_rel_err_vs_torch": err}  # fmt: skip
    row["dense_ratio"] = row["tflops"] / row["dense_tflops"]
    if pair_tiles_apply(T * TOP_K, EXPERTS):
        row.update(bench_router(T, reps, len(layers)))
        if sweep:
            row.update(sweep_tokens(T, x, layers, routes, outs, ws, reps))
    say(f"T={T}: fused {ours_us:.1f} us (roofline {roofline_us:.1f}, {distinct:.0f} experts), torch {ref_us:.1f} us, "
        f"{row['tflops']:.0f} TFLOP/s ({row['dense_ratio']:.2f} of dense), err {err:.3g}")
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None)
    p.add_argument("--tokens", type=lambda s: [int(t) for t in s.split(",")], default=[1, 8, 64, 256, 2048])
    p.add_argument("--layers", type=int, default=4, help="weight copies cycled in the graph (1.2 GB each)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--sweep", action="store_true", help="T <= 4: time every tile config of SWEEP")
    args = p.parse_args()
    dev = torch.device("cuda")
    bandwidth = copy_bandwidth(dev, 1024, 20)["bandwidth_bytes_per_s"]
    layers = []
    for i in range(args.layers):
        g = torch.Generator(device=dev).manual_seed(1000 + i)
        w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, device=dev, generator=g).mul_(HIDDEN**-0.5).to(torch.bfloat16)
        w2 = torch.randn(EXPERTS, HIDDEN, INTER, device=dev, generator=g).mul_(INTER**-0.5).to(torch.bfloat16)
        layers.append((w13, w2))
    rows = [bench_tokens(T, layers, bandwidth, args.reps, args.sweep) for T in args.tokens]
    if args.out:
        write_json(args.out, {"device": torch.cuda.get_device_name(), "copy_bandwidth_bytes_per_s": bandwidth,
                              "shape": [HIDDEN, INTER, EXPERTS, TOP_K], "rows": rows})  # fmt: skip
    print_table(f"fused MoE, Qwen3-30B-A3B layer (H {HIDDEN}, I {INTER}, E {EXPERTS}, top-{TOP_K}), bf16: "
                f"{torch.cuda.get_device_name()}",
                ["T", "experts read", "fused us (graph)", "roofline us", "roofline / fused", "topk_softmax us",
                 "torch us (eager)", "torch / fused", "TFLOP/s", "of dense", "rel err vs torch"],
                [[r["tokens"], r["distinct_experts"], r["fused_us"], r["roofline_us"], r["roofline_ratio"],
                  r["topk_softmax_us"], r["torch_us"], r["torch_us"] / r["fused_us"], r["tflops"], r["dense_ratio"],
                  r["max_rel_err_vs_torch"]] for r in rows])  # fmt: skip
    few = [r for r in rows if "router_us" in r]
    if few:
        print_table("few tokens: the one-launch router and the tiles' sweep",
                    ["T", "router us (splits)", "router us, one split", "fused us (default tiles)",
                     "best sweep us (up bn, down bn, bk, stages)"],
                    [[r["tokens"], f"{r['router_us']:.2f} ({r['router_splits']})", r["router_one_split_us"], r["fused_us"],
                      f"{r['best_us']:.2f} {r['best_cfg']}" if "best_us" in r else None] for r in few])  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
