"""Probe: the batch decode's 64 rows as two independent halves of 32 on two streams, so that one
half's split-KV attention (bandwidth-bound) can run beside the other half's persistent layer
kernel (bound by its grid barriers and chains), against the 64 rows in one stream. Each half has
its own BatchDecode (scratch, barrier counter) and attention workspace use (one split: no shared
partials). Stream B can start late by a sleep kernel (`--stagger-us`) so the halves alternate.

    python3 bench/probe_two_halves.py --context 530 --stagger-us 0,15,30
"""

from __future__ import annotations

import bench_runtime  # noqa: F401  (puts the repository root on sys.path)
import torch
from bench_linear import time_graph
from bench_runtime import say
from profile_fused_decode import decode_inputs, parse, setup

from engine.attention import AttentionMetadata, ForwardContext
from engine.models.batch_decode import BatchDecode


def half(meta: AttentionMetadata, lo: int, hi: int) -> AttentionMetadata:
    n = hi - lo
    return AttentionMetadata(
        query_start_loc=torch.arange(n + 1, dtype=torch.int32, device="cuda"), seq_lens=meta.seq_lens[lo:hi].clone(),
        block_tables=meta.block_tables[lo:hi].clone(), slot_mapping=meta.slot_mapping[lo:hi].clone(),
        query_start_loc_cpu=list(range(n + 1)), seq_lens_cpu=meta.seq_lens_cpu[lo:hi], max_query_len=1,
        max_seq_len=meta.max_seq_len,
    )  # fmt: skip


def main() -> None:
    args = parse(__doc__, "64", "unused", lambda p: p.add_argument("--stagger-us", default="0,15,30"))
    model, cache, backend, rows_list, _ = setup(args)
    c = model.config
    rows = rows_list[0]
    mid = rows // 2
    ids, pos, meta = decode_inputs(rows, args.context, c.vocab_size)
    ctx = ForwardContext(backend, meta)
    parts = [(ids[lo:hi], pos[lo:hi], ForwardContext(backend, half(meta, lo, hi))) for lo, hi in ((0, mid), (mid, rows))]
    backend.num_splits = lambda b: 1  # noqa: E731  (the halves share no partials workspace)
    whole = BatchDecode(model, backend, 1, rows)
    halves = [BatchDecode(model, backend, 1, mid) for _ in range(2)]
    side = torch.cuda.Stream()
    # cycles of the sleep kernel per us (a guess at ~1.98 GHz; the table reports what it measured)
    cycles_per_us = 1980
    results = []
    with torch.inference_mode():
        ref = whole.forward(ids, pos, ctx).clone()
        t = time_graph(lambda: whole.forward(ids, pos, ctx), 1, args.reps) / 1e3
        results.append(("64 rows, one stream", t, 0.0))
        say(f"64 rows one stream: {t:.3f} ms")
        t = time_graph(lambda: [halves[i].forward(*parts[i]) for i in range(2)], 1, args.reps) / 1e3
        results.append(("two halves, one stream", t, 0.0))
        say(f"two halves one stream: {t:.3f} ms")
        for stagger in (float(s) for s in args.stagger_us.split(",")):
            outs = [None, None]

            def both(stagger=stagger, outs=outs):
                main_stream = torch.cuda.current_stream()
                side.wait_stream(main_stream)
                outs[0] = halves[0].forward(*parts[0])
                with torch.cuda.stream(side):
                    if stagger > 0:
                        torch.cuda._sleep(int(stagger * cycles_per_us))
                    outs[1] = halves[1].forward(*parts[1])
                main_stream.wait_stream(side)

            t = time_graph(both, 1, args.reps) / 1e3
            both()
            torch.cuda.synchronize()
            err = (torch.cat(outs).float() - ref.float()).abs().max().item()
            sleep = time_graph(lambda s=stagger: torch.cuda._sleep(int(s * cycles_per_us)), 1, 5) * 1e3 if stagger else 0
            results.append((f"two halves, two streams, B after a {stagger:.0f} us sleep (measured {sleep / 1e3:.1f} us)", t, err))
            say(f"two streams, stagger {stagger}: {t:.3f} ms, max |diff| {err:.2e}")
    print(f"\n### batch decode as two halves on two streams, {args.shape}, {rows} rows, context {args.context}\n")
    print("| variant | forward ms | max abs diff vs one stream |")
    print("| --- | --- | --- |")
    for name, t, err in results:
        print(f"| {name} | {t:.3f} | {err:.1e} |")


if __name__ == "__main__":
    main()
