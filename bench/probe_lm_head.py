"""The decode step's lm_head at a few row counts: cuBLAS as the model calls it (F.linear) against
other ways of asking for the same [M, V] logits, microseconds per call from a CUDA graph and the
weight-read bandwidth that implies (the weight, 311 MB at Qwen3-0.6B's vocabulary, is past L2).
A probe for #13's batch-64 step (bench/RESULTS.md, thirty-second session).

    python3 bench/probe_lm_head.py --rows 1,64 --out $OUT/lm_head.json

Each skinny tile config also runs with the greedy sampler's pieces in its epilogue (`+lse`, the
decode graphs' logits: bench/RESULTS.md, fifty-second session).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import bench_runtime  # noqa: F401  (puts the repository root on sys.path)
import torch
import torch.nn.functional as F
from bench_linear import time_graph
from bench_runtime import say, write_json

# skinny_linear's (block_n, block_k, warps, stages) tried at each row count
CONFIGS = [(32, 128, 4, 5), (64, 128, 4, 4), (64, 64, 4, 6), (128, 128, 8, 3), (128, 64, 8, 4), (64, 256, 4, 3), (64, 64, 8, 6),
           (64, 128, 8, 4)]


def variants(x: torch.Tensor, w: torch.Tensor, configs: list[tuple[int, int, int, int]]) -> dict[str, Callable[[], torch.Tensor]]:
    """Name -> a call that leaves the logits [M, V] (as a view where the layout differs)."""
    m = x.shape[0]
    out = {
        "F.linear": lambda: F.linear(x, w),
        "(w @ x.T).T": lambda: (w @ x.t()).t(),
    }
    if m >= 2:
        h = m // 2
        out["two halves"] = lambda: torch.cat([F.linear(x[:h], w), F.linear(x[h:], w)])
    if m <= 64:
        from engine.models.skinny_linear import skinny_linear

        for bn, bk, wp, st in configs:
            out[f"skinny {bn}x{bk}x{wp}x{st}"] = lambda bn=bn, bk=bk, wp=wp, st=st: skinny_linear(
                x, w, block_n=bn, block_k=bk, num_warps=wp, num_stages=st
            )
            # The same writing the greedy sampler's pieces (a decode graph's logits: `lse`).
            lse = _pieces(m, -(-w.shape[0] // bn), x.device)
            out[f"skinny {bn}x{bk}x{wp}x{st} +lse"] = lambda bn=bn, bk=bk, wp=wp, st=st, lse=lse: skinny_linear(
                x, w, block_n=bn, block_k=bk, num_warps=wp, num_stages=st, lse=lse
            )
    return out


def _pieces(m: int, pieces: int, dev: torch.device) -> tuple[torch.Tensor, ...]:
    """Greedy rows' temperatures [m] and [m, pieces] maxima, sums, argmaxes (skinny_linear's lse)."""
    f32 = dict(dtype=torch.float32, device=dev)
    return torch.ones(m, **f32), torch.empty(m, pieces, **f32), torch.empty(m, pieces, **f32), torch.empty(m, pieces, dtype=torch.int64, device=dev)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,64")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--hidden", default="1024", help="','-separated: 1024 (Qwen3-0.6B), 4096 (Qwen3-8B)")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--configs", help="','-separated skinny tiles BNxBKxWARPSxSTAGES (default: CONFIGS)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    configs = [tuple(int(v) for v in c.split("x")) for c in args.configs.split(",")] if args.configs else CONFIGS
    dev = torch.device("cuda")
    rows_out = []
    for m, hidden in ((int(r), int(h)) for h in args.hidden.split(",") for r in args.rows.split(",")):
        w = (torch.randn(args.vocab, hidden, device=dev) * 0.02).to(torch.bfloat16)
        nbytes = w.numel() * w.element_size()
        x = torch.randn(m, hidden, device=dev).to(torch.bfloat16)
        ref = F.linear(x, w).float()
        for name, call in variants(x, w, configs).items():
            try:
                call()
            except Exception as e:  # noqa: BLE001  (a probe: a config that does not fit is a row)
                say(f"hidden {hidden} rows {m:4d} {name:16s} failed: {type(e).__name__}")
                continue
            err = (call().float() - ref).abs().max().item()
            us = time_graph(lambda call=call: [call() for _ in range(8)], 8, args.reps)
            rows_out.append({"rows": m, "hidden": hidden, "variant": name, "us": us, "tb_s": nbytes / us / 1e6, "max_abs_diff": err})
            say(f"hidden {hidden} rows {m:4d} {name:16s} {us:8.2f} us  {nbytes / us / 1e6:5.2f} TB/s  max|diff| {err:.2e}")
    write_json(args.out, {"rows": rows_out})


if __name__ == "__main__":
    main()
