"""The decode step's persistent kernels under Nsight Compute (ncu): hardware counters and sampled
warp stalls, which the %globaltimer stamps of profile_fused_decode.py / profile_batch_decode.py
cannot give (where a phase's warps wait: memory, barrier polls, instruction fetch).

Two modes. Without --summarize: a workload for ncu, eager forwards of the one-kernel-per-layer
decode (--rows <= 4, models/fused_decode.py) or of the batch decode (models/batch_decode.py),
random KV cache and inputs as profile_fused_decode.py makes them. With --summarize: reads what
`ncu --page source --csv --print-source sass` exported and prints the stall reasons over the whole
kernel, per 4 KB of its code, and its top instructions.

    ncu --clock-control none --kernel-name regex:decoder_layer_kernel --launch-skip 33 --launch-count 1 \\
        --set full --import-source yes -o $OUT/layer -f python3 bench/ncu_decode.py --rows 1
    ncu --import $OUT/layer.ncu-rep --page details > $OUT/details.txt
    ncu --import $OUT/layer.ncu-rep --page source --csv --print-source sass > $OUT/source.csv
    python3 bench/ncu_decode.py --summarize $OUT/source.csv

(--launch-skip 33: past the first forward's 28 layers and five of the second's. ncu serializes
the launches, so there is no PDL overlap: compare phases, not layer times, with the stamps.)
"""

from __future__ import annotations

import argparse
import collections
import csv

import bench_runtime  # noqa: F401  (puts the repository root on sys.path)

SAMPLES = "Warp Stall Sampling (All Samples)"
BUCKET = 4096  # bytes of code per row of the region table


def workload(rows: int, forwards: int) -> None:
    """`forwards` eager model forwards of `rows` decode rows through the persistent decode path."""
    import torch
    from profile_fused_decode import decode_inputs, setup

    from engine.attention import ForwardContext
    from engine.models.batch_decode import BatchDecode
    from engine.models.fused_decode import MAX_ROWS, FusedDecode

    args = argparse.Namespace(shape="0.6b", rows=str(rows), context=512, variants="")
    model, _cache, backend, _rows, _variants = setup(args)
    with torch.inference_mode():
        ids, pos, meta = decode_inputs(rows, args.context, model.config.vocab_size)
        ctx = ForwardContext(backend, meta)
        if rows <= MAX_ROWS:
            model.model.fused_decode = FusedDecode(model, backend, rows)
        else:
            model.model.batch_decode = BatchDecode(model, backend, 1, rows)
        for _ in range(forwards):
            model(ids, pos, ctx)
        torch.cuda.synchronize()


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        return 0


def summarize(path: str, top: int) -> None:
    """Stall reasons of an exported SASS source page: totals, per code region, top instructions."""
    with open(path, newline="") as f:
        table = list(csv.reader(f))
    start = next(i for i, r in enumerate(table) if "Address" in r and "Source" in r)
    header, rows = table[start], [r for r in table[start + 1 :] if r and r[0].startswith("0x")]
    col = {name: i for i, name in enumerate(header)}
    reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    totals = collections.Counter({s: sum(_int(r[col[s]]) for r in rows) for s in reasons})
    total = sum(totals.values()) or 1
    base = int(rows[0][col["Address"]], 16)
    size = int(rows[-1][col["Address"]], 16) - base + 16
    print(f"### {len(rows)} instructions, {size / 1024:.1f} KB of code, {total} samples")
    print("| stall reason | samples | share |\n| --- | --- | --- |")
    for s, n in totals.most_common(8):
        print(f"| {s[6:]} | {n} | {100 * n / total:.1f} % |")
    main = [s for s, _ in totals.most_common(4)]
    print(f"\n| code from KB | executed | samples | {' | '.join(s[6:] for s in main)} |")
    print("| --- | --- | --- |" + " --- |" * len(main))
    regions: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    for r in rows:
        bucket = regions[(int(r[col["Address"]], 16) - base) // BUCKET]
        bucket["executed"] += _int(r[col["Instructions Executed"]])
        bucket["samples"] += _int(r[col[SAMPLES]])
        for s in main:
            bucket[s] += _int(r[col[s]])
    for k in sorted(regions):
        b = regions[k]
        print(f"| {k * BUCKET // 1024} | {b['executed']} | {b['samples']} | {' | '.join(str(b[s]) for s in main)} |")
    print("\n| KB | samples | instruction | top reason |\n| --- | --- | --- | --- |")
    for r in sorted(rows, key=lambda r: -_int(r[col[SAMPLES]]))[:top]:
        reason = max(reasons, key=lambda s: _int(r[col[s]]))
        where = (int(r[col["Address"]], 16) - base) / 1024
        print(f"| {where:.1f} | {_int(r[col[SAMPLES]])} | `{r[col['Source']].strip()[:60]}` | {reason[6:]} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=1, help="decode rows: <= 4 the fused decode, else the batch decode")
    p.add_argument("--forwards", type=int, default=3)
    p.add_argument("--summarize", metavar="CSV", help="an exported source page to summarize (no GPU needed)")
    p.add_argument("--top", type=int, default=15)
    args = p.parse_args()
    if args.summarize:
        summarize(args.summarize, args.top)
    else:
        workload(args.rows, args.forwards)


if __name__ == "__main__":
    main()
