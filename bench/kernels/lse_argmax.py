"""The sampler's one read of the logits (engine/kernels/lse_argmax.py) against the copy roofline
and torch: per row count and (columns per program, warps) config, microseconds per call from a
CUDA graph, the logits' read bandwidth over the copy bandwidth, and torch's log_softmax +
argmax on the same logits. Every config's tokens and lse are checked against torch's first.
Each graph re-reads the same logits, as the step reads what lm_head just wrote: from L2 where
they fit (up to ~64 rows of a 152k vocabulary).

    python3 bench/kernels/lse_argmax.py --rows 1,64,256 --configs 1024x4,4096x4,4096x8 --out $OUT/lse.json
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

from engine.kernels import lse_argmax as la  # noqa: E402


def bench_rows(rows: int, args: argparse.Namespace, configs: list[tuple[int, ...]], bw: float) -> list[dict[str, Any]]:
    """One table row per config at `rows` rows of random bf16 logits."""
    dev = torch.device("cuda")
    x = torch.randn(rows, args.vocab, device=dev).to(torch.bfloat16)
    t = torch.full((rows,), args.temperature, device=dev)
    counts = torch.zeros(rows, dtype=torch.int32, device=dev)
    ref_lse = torch.logsumexp(x.float() / t[:, None], -1)
    ref_tok = (x.float() / t[:, None]).argmax(-1)
    torch_us = time_graph(lambda: [(torch.log_softmax(x.float() / t[:, None], -1), x.argmax(-1)) for _ in range(args.per)], args.per, args.reps)
    out = []
    for cfg in configs:
        lse, tok, _ = la.lse_argmax(x, t, counts, config=cfg)
        ok = torch.equal(tok, ref_tok) and torch.allclose(lse, ref_lse, rtol=1e-5, atol=1e-5)
        us = time_graph(lambda cfg=cfg: [la.lse_argmax(x, t, counts, config=cfg) for _ in range(args.per)], args.per, args.reps)
        gbs = x.numel() * x.element_size() / us / 1e3
        out.append({"rows": rows, "config": cfg, "us": us, "read_gb_s": gbs, "of_copy": gbs * 1e9 / bw, "torch_us": torch_us, "correct": ok})
        say(f"rows {rows}, config {cfg}: {us:.2f} us{'' if ok else ' (WRONG)'}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,8,64,256")
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--configs", default=f"{la.CHUNK}x{la.WARPS},2048x4,4096x4,4096x8,8192x8")
    p.add_argument("--temperature", type=float, default=1.0, help="every row's (1.0 as greedy rows: no division)")
    p.add_argument("--per", type=int, default=20, help="calls per graph")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    bw = copy_bandwidth(torch.device("cuda"), 1024, 20)["bandwidth_bytes_per_s"]
    configs = [tuple(int(v) for v in c.split("x")) for c in args.configs.split(",")]
    results: list[dict[str, Any]] = []
    for rows in (int(r) for r in args.rows.split(",")):
        results += bench_rows(rows, args, configs, bw)
    write_json(args.out, {"device": torch.cuda.get_device_name(), "copy_bandwidth_bytes_per_s": bw, "rows": results})
    print_table(f"the sampler's read of the logits (lse_argmax): {torch.cuda.get_device_name()}, vocab {args.vocab}",
                ["rows", "config", "us per call", "read GB/s", "of copy bandwidth", "torch log_softmax + argmax us",
                 "torch / this"],
                [[r["rows"], f"{r['config'][0]}x{r['config'][1]}{'' if r['correct'] else ' (WRONG)'}", r["us"],
                  r["read_gb_s"], r["of_copy"], r["torch_us"], r["torch_us"] / r["us"]] for r in results])


if __name__ == "__main__":
    main()
