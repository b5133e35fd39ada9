"""The decode step's lm_head at a few row counts: cuBLAS as the model calls it (F.linear) against
other ways of asking for the same [M, V] logits, microseconds per call from a CUDA graph and the
weight-read bandwidth that implies (the weight, 311 MB at Qwen3-0.6B's vocabulary, is past L2).
A probe for #13's batch-64 step (bench/RESULTS.md, thirty-second session).

    python3 bench/probe_lm_head.py --rows 1,64 --out $OUT/lm_head.json

`--persistent` adds a decode graph's logits with the greedy sampler's pieces
(engine/models/logits_linear.py, configs BNxBKxWARPSxSTAGESxPROGRAMS_PER_SM) and, as `+merge`,
each of those followed by the sampler's merge (lse_argmax.merge_pieces) against skinny_linear's
LOGITS_CONFIG followed by the sampler reading its logits (lse_argmax), the merged tokens and lse
checked against torch (bench/RESULTS.md, fifty-second and fifty-fourth sessions).
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
    return out


def sampled_variants(
    x: torch.Tensor, w: torch.Tensor, configs: list[tuple[int, ...]]
) -> dict[str, tuple[Callable[[], object], Callable[[], object], tuple[torch.Tensor, torch.Tensor]]]:
    """Name -> (the logits' call, the logits and the greedy sampler's call, its (lse, tokens)):
    skinny_linear then lse_argmax on its logits, and logits_linear's configs then merge_pieces."""
    from engine.models import logits_linear as ll
    from engine.models.skinny_linear import LOGITS_CONFIG, skinny_linear
    from engine.runner.lse_argmax import lse_argmax, merge_pieces

    m, v, dev = x.shape[0], w.shape[0], x.device
    logits = torch.empty(m, v, dtype=x.dtype, device=dev)
    temps = torch.ones(m, dtype=torch.float32, device=dev)
    outs = (torch.empty(m, dtype=torch.float32, device=dev), torch.empty(m, dtype=torch.int64, device=dev),
            torch.empty(m, 2, dtype=torch.float64, device=dev))  # fmt: skip
    publish = (torch.zeros(2, m, 2, dtype=torch.float64, device=dev), torch.zeros(1, dtype=torch.int32, device=dev),
               torch.zeros(1, dtype=torch.int32, device=dev))  # fmt: skip
    counts = torch.zeros(m, dtype=torch.int32, device=dev)

    def skinny() -> object:
        return skinny_linear(x, w, out=logits, prefetch=True, **LOGITS_CONFIG)

    out = {"skinny + lse_argmax": (skinny, lambda: (skinny(), lse_argmax(logits, temps, counts, out=outs, publish=publish)), outs[:2])}
    for bn, bk, wp, st, per_sm in configs:
        cfg = dict(block_n=bn, block_k=bk, num_warps=wp, num_stages=st)
        count = ll.pieces(v, dev, per_sm, bn)
        lse = (temps, *(torch.empty(m, count, dtype=dt, device=dev) for dt in (torch.float32, torch.float32, torch.int64)))

        def call(cfg=cfg, per_sm=per_sm, lse=lse) -> object:
            return ll.logits_linear(x, w, logits, lse, cfg, per_sm)

        out[f"logits_linear {bn}x{bk}x{wp}x{st}x{per_sm}"] = (call, lambda call=call, lse=lse: (call(), merge_pieces(lse[1:], outs, publish)), outs[:2])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,64")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--hidden", default="1024", help="','-separated: 1024 (Qwen3-0.6B), 4096 (Qwen3-8B)")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--configs", help="','-separated skinny tiles BNxBKxWARPSxSTAGES (default: CONFIGS)")
    ap.add_argument("--persistent", default="", help="','-separated logits_linear configs BNxBKxWARPSxSTAGESxPER_SM")
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
        if not args.persistent or m > 64:
            continue
        rounded = ref.to(torch.bfloat16).float()
        lse_ref, tok_ref = torch.logsumexp(rounded, -1), rounded.argmax(-1)
        pconfigs = [tuple(int(v) for v in c.split("x")) for c in args.persistent.split(",")]
        for name, (logits_call, sampled, (lse, tokens)) in sampled_variants(x, w, pconfigs).items():
            err = (logits_call().float() - ref).abs().max().item()
            sampled()
            lse_err, wrong = (lse - lse_ref).abs().max().item(), int((tokens != tok_ref).sum().item())
            us = time_graph(lambda c=logits_call: [c() for _ in range(8)], 8, args.reps)
            both = time_graph(lambda c=sampled: [c() for _ in range(8)], 8, args.reps)
            rows_out.append({"rows": m, "hidden": hidden, "variant": name, "us": us, "us_sampled": both, "max_abs_diff": err,
                             "lse_max_diff": lse_err, "wrong_tokens": wrong})  # fmt: skip
            say(f"hidden {hidden} rows {m:4d} {name:30s} {us:8.2f} us  with the sampler {both:8.2f} us  max|diff| {err:.2e}  "
                f"lse {lse_err:.2e}  wrong tokens {wrong}")  # fmt: skip
    write_json(args.out, {"rows": rows_out})


if __name__ == "__main__":
    main()
