"""The decode attention of few rows at long context (engine/kernels/rope_decode.py, the kernel of
the batch decode and of `DecodeAttention`): microseconds a layer from one CUDA graph over layers
of a paged cache too big for L2, and the K/V bytes a layer must read over the copy bandwidth,
across split counts (programs an SM) and tile configs (BLOCK_N, warps, stages).

    python3 bench/kernels/rope_decode.py --steps 1@32768,4@32768,8@8192 --out $OUT/rd.json

A step `B@C`: B rows of C context tokens each, Qwen3's q/k norm and 128-wide heads, 8 KV heads
and `--heads` query heads (16: the 0.6B; 32: the 8B). The first split count and the first config
are the engine's (`TritonBackend.merged_decode_plan`, `batch_tile_config`). `--merge-splits M`
merges the partials M splits a load in place of the engine's (`merge_for` the step's rows).
`--block-sizes 16,64`: the cache's tokens a block (the engine's `--block-size`, 16 by default);
`--ordered-blocks`: each row's blocks in order, in place of shuffled.
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

from engine.kernels import pdl  # noqa: E402
from engine.kernels.rope_decode import batch_tile_config, kernel_consts, merge_for, rope_decode  # noqa: E402

KV_HEADS, HEAD_DIM = 8, 128
DTYPE = torch.bfloat16


def step(spec: str, heads: int, splits_per_sm: list[int], configs: list[tuple[int, int, int]], bw: float, reps: int,
         merge: int = 0, block_size: int = 16, ordered: bool = False) -> list[dict[str, Any]]:  # fmt: skip
    """One `B@C` step at every (split count, config): a row each. The cache in blocks of
    `block_size` tokens, each row's in order (`ordered`) or shuffled."""
    rows, ctx = (int(x) for x in spec.split("@"))
    dev = torch.device("cuda")
    per_layer = rows * ctx * KV_HEADS * HEAD_DIM * 2 * DTYPE.itemsize  # K and V a layer reads
    layers = max(2, min(28, int(3e9 // per_layer)))
    per_seq = -(-ctx // block_size)
    cache = torch.randn(layers, 2, rows * per_seq, block_size, KV_HEADS, HEAD_DIM, device=dev).to(DTYPE)
    order = torch.arange(rows * per_seq, device=dev) if ordered else torch.randperm(rows * per_seq, device=dev)
    tables = order.int().view(rows, per_seq)
    slots = (tables[:, (ctx - 1) // block_size].long() * block_size + (ctx - 1) % block_size).contiguous()
    seq_lens = torch.full((rows,), ctx, dtype=torch.int32, device=dev)
    positions = torch.full((rows,), ctx - 1, dtype=torch.int64, device=dev)
    cos_sin = torch.randn(ctx, HEAD_DIM, device=dev)
    qkv = torch.randn(1, rows, (heads + 2 * KV_HEADS) * HEAD_DIM, device=dev).to(DTYPE)
    norm = torch.ones(HEAD_DIM, device=dev, dtype=DTYPE)
    out = torch.empty(rows, heads, HEAD_DIM, device=dev, dtype=DTYPE)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    merge = merge or merge_for(rows)
    found = []
    for per_sm in splits_per_sm:
        splits = max(1, min(-(-ctx // 16), per_sm * sms // (rows * KV_HEADS)))
        part_out = torch.empty(rows * heads * splits * HEAD_DIM, device=dev)
        part_lse = torch.empty(rows * heads * splits, device=dev)
        counts = torch.zeros(rows * KV_HEADS, dtype=torch.int32, device=dev)
        for config in configs:
            consts = kernel_consts(heads, KV_HEADS, HEAD_DIM, 1, 0, False, True, block_size, DTYPE.itemsize,
                                   pdl.enabled(dev), config, merge)  # fmt: skip

            def calls(splits: int = splits, plan: tuple = (part_out, part_lse, counts), consts: dict = consts) -> None:
                for layer in range(layers):
                    rope_decode((norm, norm, 1e-6), qkv, None, (cache[layer, 0], cache[layer, 1]), positions, cos_sin,
                                (slots, tables, seq_lens), out, HEAD_DIM**-0.5, (splits, *plan), consts)  # fmt: skip

            us = time_graph(calls, layers, reps)
            found.append(dict(step=spec, heads=heads, block_size=block_size, ordered=ordered, splits_per_sm=per_sm, splits=splits,
                              merge_splits=merge, config="x".join(map(str, config)), us_per_layer=us,
                              of_copy=per_layer / (us * 1e-6) / bw))  # fmt: skip
            say(f"  {spec} h{heads} blocks of {block_size} {per_sm}/SM ({splits} splits) {found[-1]['config']}: {us:.1f} us, "
                f"{found[-1]['of_copy']:.3f} of copy")  # fmt: skip
    return found


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", default="1@32768,4@32768,8@8192")
    p.add_argument("--heads", default="16,32")
    p.add_argument("--splits-per-sm", default="3,6,12", help="programs an SM the split count aims at; the first is the engine's")
    p.add_argument("--configs", default="", help="BLOCK_NxWARPSxSTAGES,... after the engine's")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--merge-splits", type=int, default=0,
                   help="partials a load of the last split's merge (a power of two; 0: the engine's for the step's rows)")
    p.add_argument("--block-sizes", default="16", help="the cache's tokens a block, comma-separated (the engine's: 16)")
    p.add_argument("--ordered-blocks", action="store_true", help="each row's blocks in order (default: shuffled)")
    p.add_argument("--out")
    args = p.parse_args()
    if args.merge_splits < 0 or args.merge_splits & (args.merge_splits - 1):
        p.error("--merge-splits must be a power of two (or 0)")
    torch.manual_seed(0)
    bw = copy_bandwidth(torch.device("cuda"), 1024, 20)["bandwidth_bytes_per_s"]  # read + written, bench_engine's roofline
    configs = [batch_tile_config(HEAD_DIM, DTYPE.itemsize, max(int(s.split("@")[0]) for s in args.steps.split(",")))]
    configs += [tuple(int(x) for x in c.split("x")) for c in filter(None, args.configs.split(","))]
    found = []
    splits_per_sm = [int(x) for x in args.splits_per_sm.split(",")]
    for heads in (int(h) for h in args.heads.split(",")):
        for spec in args.steps.split(","):
            for block_size in (int(b) for b in args.block_sizes.split(",")):
                found += step(spec, heads, splits_per_sm, configs, bw, args.reps, args.merge_splits, block_size,
                              args.ordered_blocks)  # fmt: skip
                torch.cuda.empty_cache()
    print_table(f"rope_decode, {torch.cuda.get_device_name()}: a layer's K/V bytes over the copy bandwidth "
                f"({bw / 1e9:.0f} GB/s, read + written)",
                ["step", "heads", "block", "programs/SM", "splits", "merge a load", "config", "us a layer", "of copy"],
                [[r["step"], r["heads"], r["block_size"], r["splits_per_sm"], r["splits"], r["merge_splits"], r["config"],
                  round(r["us_per_layer"], 1), round(r["of_copy"], 3)] for r in found])  # fmt: skip
    if args.out:
        write_json(args.out, dict(device=torch.cuda.get_device_name(), copy_bandwidth=bw, rows=found))
    return 0


if __name__ == "__main__":
    sys.exit(main())
