"""`--deterministic`'s attention (engine/kernels/attention_fixed.py): microseconds per call from a
CUDA graph for decode steps of B one-token rows and prefill steps of B x Q-token chunks at a
context, on the one-program path and, for steps of at most FEW_TOKENS tokens, the split path;
the K/V bytes a step must read over the copy bandwidth; and whether both paths give every row
the same bits (they must).

    python3 bench/kernels/attention_fixed.py --steps 1x1@512,1x1@32768,8x1@8192,64x1@512,4x512@2048 --out $OUT/af.json

`--split S` times pieces of S context tokens in place of SPLIT, `--block-n B` tiles of B keys in
place of BLOCK_N (the bits follow both: the paths still agree, checked); `--warps T,K,P` runs
the tile, token and split paths' programs with those warps (the bits do not follow them).

A step `BxQ@C`: B sequences of C context tokens each, the last Q of them this step's queries
(Q = 1: decodes), Qwen3's 128-wide heads (`--heads`, `--kv-heads`: the 0.6B's 16 and 8).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.dirname(BENCH), BENCH]

from bench_runtime import say, write_json  # noqa: E402
from device_timing import copy_bandwidth, time_graph  # noqa: E402
from report import print_table  # noqa: E402

from engine.kernels import attention_fixed as af  # noqa: E402

BLOCK_SIZE, HEAD_DIM = 16, 128


def step(spec: str, args: argparse.Namespace, bw: float, workspace: af.Workspace) -> dict[str, Any]:
    """One `BxQ@C` step on both paths: times, K/V bandwidth, whether the bits agree."""
    shape, context = spec.split("@")
    bs, q_per = (int(x) for x in shape.split("x"))
    ctx = int(context)
    dev = torch.device("cuda")
    per_seq = -(-ctx // BLOCK_SIZE)
    kv = torch.randn(2, bs * per_seq, BLOCK_SIZE, args.kv_heads, HEAD_DIM, device=dev, dtype=torch.bfloat16)
    tables = torch.arange(bs * per_seq, device=dev, dtype=torch.int32).view(bs, per_seq)
    seq_lens = torch.full((bs,), ctx, device=dev, dtype=torch.int32)
    qsl = torch.arange(bs + 1, device=dev, dtype=torch.int32) * q_per
    q = torch.randn(bs * q_per, args.heads, HEAD_DIM, device=dev, dtype=torch.bfloat16)
    outs = {path: torch.empty_like(q) for path in ("one", "split")}
    scale = HEAD_DIM**-0.5

    def run(path: str) -> None:
        af.fixed_split_attention(q, kv[0], kv[1], tables, seq_lens, qsl, outs[path], scale, max(bs, 1),
                                 workspace if path == "split" else None)  # fmt: skip

    paths = ["one", "split"] if bs * q_per <= af.FEW_TOKENS else ["one"]
    times = {path: time_graph(lambda path=path: [run(path) for _ in range(args.per)], args.per, args.reps) for path in paths}
    same = torch.equal(outs["one"], outs["split"]) if "split" in times else None
    # Every query token reads its context's K/V once per KV head (the kernels' cost model).
    kv_bytes = sum(ctx - q_per + 1 + j for j in range(q_per)) * bs * args.kv_heads * HEAD_DIM * 2 * 2
    best = min(times.values())
    row = {"step": spec, "tokens": bs * q_per, "us": times, "kv_bytes": kv_bytes,
           "of_copy": kv_bytes / (best * 1e-6) / bw, "bitwise_same": same}  # fmt: skip
    say(f"{spec}: " + ", ".join(f"{p} {t:.1f} us" for p, t in times.items()) + (f", bits same: {same}" if same is not None else ""))
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", default="1x1@512,1x1@8192,1x1@32768,8x1@512,16x1@8192,64x1@512,256x1@512,4x512@2048")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--max-model-len", type=int, default=40960, help="the split path's workspace: pieces of it")
    p.add_argument("--per", type=int, default=10, help="calls per graph")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--split", type=int, default=af.SPLIT,
                   help="context tokens a piece (a multiple of BLOCK_N): what the bits follow, to place SPLIT")
    p.add_argument("--block-n", type=int, default=af.BLOCK_N, help="keys a tile (a power of two): what the bits follow")
    p.add_argument("--warps", default=",".join(map(str, (af.TILE_WARPS, af.TOKEN_WARPS, af.PIECE_WARPS))),
                   help="T,K,P: warps a program of the tile, token and split paths")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    if args.block_n < 16 or args.block_n & (args.block_n - 1):
        p.error("--block-n must be a power of two >= 16")
    if args.split <= 0 or args.split % args.block_n:
        p.error(f"--split must be a positive multiple of {args.block_n}")
    # Read by fixed_split_attention and Workspace.allocate at each call.
    af.SPLIT, af.BLOCK_N = args.split, args.block_n
    af.TILE_WARPS, af.TOKEN_WARPS, af.PIECE_WARPS = (int(w) for w in args.warps.split(","))
    bw = copy_bandwidth(torch.device("cuda"), 1024, 20)["bandwidth_bytes_per_s"]
    workspace = af.Workspace.allocate(args.heads, HEAD_DIM, args.max_model_len, torch.device("cuda"))
    rows = [step(s, args, bw, workspace) for s in args.steps.split(",")]
    write_json(args.out, {"args": vars(args), "copy_bandwidth": bw, "rows": rows})
    print_table(f"fixed-split attention (--deterministic), {torch.cuda.get_device_name()}, {args.heads} heads / "
                f"{args.kv_heads} KV heads of {HEAD_DIM}, SPLIT {af.SPLIT}, BLOCK_N {af.BLOCK_N}, warps {args.warps}",
                ["step BxQ@context", "one-program us", "split us", "K/V read / copy bandwidth", "bits same"],
                [[r["step"], r["us"]["one"], r["us"].get("split"), r["of_copy"], r["bitwise_same"]] for r in rows])  # fmt: skip


if __name__ == "__main__":
    main()
