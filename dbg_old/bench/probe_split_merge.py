"""Probe: the split-KV decode with its splits merged inside the kernel (the last split of a
(row, KV head) to finish merges; no reduce launch), at more splits than one wave holds, against
the kernel as the backend runs it. Attention alone (a graph over the layers) and the model forward
with the batch decode, per row count and split count.

    python3 bench/probe_split_merge.py --rows 8,16,32,64 --context 530 --per-sm 2,3,4,6,8

Split counts come from programs per SM: splits = max(1, per_sm * SMs // (rows * Hkv)). Each
variant's output is compared with the backend's own kernel on the same cache state. The forward
takes the split count; its attention kernel (engine/models/batch_attention.py) always merges in
the kernel, so "reduce" variants differ from "merge" only in the attention-alone column.
"""

from __future__ import annotations

import bench_runtime  # noqa: F401  (puts the repository root on sys.path)
import torch
from bench_linear import time_graph
from bench_runtime import say
from profile_fused_decode import decode_inputs, parse, setup

from engine.attention import ForwardContext
from engine.attention import triton_decode as td
from engine.models.batch_decode import BatchDecode


def _flags(p) -> None:
    p.add_argument("--per-sm", default="2,3,4,6,8")
    p.add_argument("--no-pdl-too", action="store_true", help="also time each forward with use_pdl=0")


def main() -> None:
    args = parse(__doc__, "16,32,64", "unused", _flags)
    model, cache, backend, rows_list, _ = setup(args)
    c = model.config
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    per_sm = [int(s) for s in args.per_sm.split(",")]
    smax = max(max(1, t * sms // (r * c.num_kv_heads)) for t in per_sm + [4] for r in rows_list)
    backend._part_out = torch.empty(max(rows_list) * smax * c.num_heads * c.head_dim, dtype=torch.float32, device="cuda")
    backend._part_lse = torch.empty(max(rows_list) * smax * c.num_heads, dtype=torch.float32, device="cuda")
    counts = backend._counts
    table = []
    with torch.inference_mode():
        for rows in rows_list:
            ids, pos, meta = decode_inputs(rows, args.context, c.vocab_size)
            ctx = ForwardContext(backend, meta)
            q = torch.randn(rows, c.num_heads, c.head_dim, device="cuda").to(torch.bfloat16)
            own = backend.num_splits(rows)
            candidates = sorted({max(1, t * sms // (rows * c.num_kv_heads)) for t in per_sm})
            variants = [(own, False, 1)] + [(s, s > 1, 1) for s in candidates if s != own or s > 1]
            if args.no_pdl_too:
                variants += [(own, False, 0)] + [(s, True, 0) for s in candidates if s > 1]
            ref = torch.empty_like(q)
            batches = {1: BatchDecode(model, backend, 1, max(rows_list))}
            if args.no_pdl_too:
                batches[0] = BatchDecode(model, backend, 1, max(rows_list), use_pdl=0)
            for splits, merge, use_pdl in variants:
                batch = batches[use_pdl]
                td.decode_attention(q, cache[0, 0], cache[0, 1], meta.block_tables, meta.seq_lens, ref, backend.scale,
                                    own, backend._part_out, backend._part_lse)  # fmt: skip
                out = torch.empty_like(q)
                cnt = counts if merge else None

                def attn(splits=splits, cnt=cnt, out=out, q=q, meta=meta):
                    for i in range(c.num_layers):
                        td.decode_attention(q, cache[i, 0], cache[i, 1], meta.block_tables, meta.seq_lens, out, backend.scale,
                                            splits, backend._part_out, backend._part_lse, counts=cnt)  # fmt: skip

                alone = time_graph(attn, c.num_layers, args.reps)
                td.decode_attention(q, cache[0, 0], cache[0, 1], meta.block_tables, meta.seq_lens, out, backend.scale,
                                    splits, backend._part_out, backend._part_lse, counts=cnt)  # fmt: skip
                err = (out.float() - ref.float()).abs().max().item()
                left = int(counts.abs().sum().item())
                backend.decode_splits = lambda b, pdl_launch=False, v=(splits, merge): v  # noqa: E731
                model.model.batch_decode = batch
                fwd = time_graph(lambda: model(ids, pos, ctx), 1, args.reps) / 1e3  # noqa: B023
                model.model.batch_decode = None
                del backend.decode_splits
                name = f"{'merge' if merge else 'reduce' if splits > 1 else 'one split'} x{splits}" + ("" if use_pdl else ", no PDL")
                table.append((rows, name, alone, fwd, err, left))
                say(f"rows {rows} {name}: attention {alone:.2f} us/layer, forward {fwd:.3f} ms, max |diff| {err:.2e}, counters left {left}")
    print(f"\n### split-KV decode with in-kernel merge, {args.shape}, context {args.context}\n")
    print("| rows | variant | attention alone us/layer | forward ms | max abs diff vs backend | counters left |")
    print("| --- | --- | --- | --- | --- | --- |")
    for rows, name, alone, fwd, err, left in table:
        print(f"| {rows} | {name} | {alone:.2f} | {fwd:.3f} | {err:.1e} | {left} |")


if __name__ == "__main__":
    main()
