"""Tensor parallelism's decode step: the same shape at tp_size 1 and 2 in one run, CUDA graphs on.

    python bench/bench_tp.py --shape 8b --out tp.json

Prints one table: per batch size, the step at TP=1, at TP=2, and their ratio (target at batch 1:
TP=2's step 0.65x of TP=1's or less; the weights each GPU reads halve, the all-reduces are new).
`--expert-parallel` (a mixture-of-experts shape) runs TP=2 again with whole experts per rank
(`--enable-expert-parallel`) and adds its step against TP=2's sliced experts.

    python bench/bench_tp.py --shape 30b-a3b --batch-sizes 1,64,256 --expert-parallel --out tp.json
"""

from __future__ import annotations

import argparse
import random
import sys

import torch
from bench_runtime import elapsed, say, write_json
from device_timing import free_memory
from engine_decode import decode_steps
from engine_graphs import count_graph_replays
from engine_shapes import checkpoint
from report import Rows, over, print_targets, run_footer

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore

TARGET_BS1 = 0.65


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--shape", default="8b")
    p.add_argument("--model-dir")
    p.add_argument("--batch-sizes", default="1,64")
    p.add_argument("--tp-sizes", default="1,2")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--decode-context", type=int, default=512)
    p.add_argument("--decode-steps", type=int, default=30)
    p.add_argument("--decode-warmup", type=int, default=3)
    p.add_argument("--mem-fraction", type=float, default=0.6)
    p.add_argument("--expert-parallel", action="store_true", help="also TP=2 with whole experts per rank")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ckpt = checkpoint(args.shape, args.model_dir, torch.device("cuda"), 0)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    steps: dict[int, dict[str, float]] = {}  # batch -> run ("1", "2", "2 ep") -> mean step (s)
    runs = [(str(t), int(t), False) for t in args.tp_sizes.split(",")] + ([("2 ep", 2, True)] if args.expert_parallel else [])
    for name, tp, ep in runs:
        core = EngineCore(EngineConfig(
            model=ckpt["path"], load_format=ckpt["load_format"], device="cuda", dtype="bfloat16",
            max_model_len=args.max_model_len, tp_size=tp, enable_expert_parallel=ep,
            max_num_seqs=max(batch_sizes), cuda_graph_max_bs=max(batch_sizes), mem_fraction=args.mem_fraction,
        ))
        try:
            replays = count_graph_replays(core)
            for bs in batch_sizes:
                out = decode_steps(core, args, bs, random.Random(bs), 0, 0, None, replays)
                steps.setdefault(bs, {})[name] = out["step_mean_s"]
                say(f"tp={name} bs={bs}: {out['step_mean_s'] * 1e3:.3f} ms, {out['graph_replayed_steps']}/{out['steps']} from graphs")
        finally:
            core.close()
            del core
            free_memory(torch.device("cuda"))
    rows = Rows()
    for bs, by_tp in steps.items():
        one, two, whole = by_tp.get("1"), by_tp.get("2"), by_tp.get("2 ep")
        ratio = over(two, one)
        held = bs == 1 and ratio is not None
        rows.add(f"decode step bs={bs}: TP=2 (ms); ref = TP=1", two and two * 1e3, one and one * 1e3, ratio,
                 f"<= {TARGET_BS1}" if bs == 1 else "-", ratio <= TARGET_BS1 if held else None)
        if whole is not None:
            rows.add(f"decode step bs={bs}: TP=2 whole experts (ms); ref = TP=2 sliced", whole * 1e3,
                     two and two * 1e3, over(whole, two))
    res = {"meta": {"out": args.out, "args": vars(args), "device_name": torch.cuda.get_device_name(0)},
           "shape": ckpt["shape"], "steps_s": steps, "table": rows, "errors": {}}
    write_json(args.out, res)
    print_targets(f"siesta tensor-parallel decode step: {res['meta']['device_name']}, {args.shape} shape, bf16, "
                  f"CUDA graphs, context {args.decode_context}", rows, footer=run_footer(res, elapsed()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
