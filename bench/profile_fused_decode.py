"""Where the one-kernel-per-layer decode (engine/models/fused_decode.py) spends a step: each
program stamps %globaltimer at the ends of the layer kernel's phases and barriers, and this
prints, per row count, the timeline of a layer (median over layers of the last program's stamp
minus the previous layer's end: its last program's last stamp; layer 0 from its first program's
start), how long a layer's programs start before the previous layer ends (PDL), and the step
replayed from a CUDA graph with and without the fused decode (the model forward only: no
logits, no sampler); then the attention phase's parts, from each program's own stamps.

The stamped forward is replayed from a CUDA graph too, as the engine runs it: launched eagerly,
each layer would start after the host's launch gap, with its prologue's loads on the first
column's clock and no PDL overlap (bench/RESULTS.md, forty-seventh session).

    python3 bench/profile_fused_decode.py --shape 0.6b --rows 1,8,16 --context 512
"""

from __future__ import annotations

import argparse
import itertools
import statistics
from collections.abc import Callable

import bench_runtime  # noqa: F401  (puts the repository root on sys.path)
import torch
from bench_linear import time_graph
from bench_runtime import say, write_json
from engine_shapes import checkpoint

from engine.attention import AttentionMetadata, ForwardContext
from engine.attention.triton import TritonBackend
from engine.config import ModelConfig
from engine.models import get_model_class
from engine.models.fused_decode import FusedDecode, unsupported
from engine.models.grid_phases import SM_SLOT, STAMPS
from engine.weights.loader import load_checkpoint

BLOCK = 16
POINTS = ["start", "norm", "barrier", "qkv", "barrier", "attention", "barrier", "o_proj", "barrier", "norm",
          "barrier", "gate_up", "barrier", "down"]
# Inside the attention phase, each program from stamp a to stamp b (layer_attention.py's points;
# 4: the qkv barrier left, 5: arrived at the next one): medians over the programs with an item.
ATTENTION_PARTS = [("q, k loaded, normed, rotated", 4, 17), ("K/V row stored, tile ready", 17, 18), ("q.k", 18, 19),
                   ("softmax", 19, 20), ("p.v", 20, 21), ("rest of the loop", 21, 14), ("partials stored", 14, 5)]


def load(path: str) -> torch.nn.Module:
    config = ModelConfig.from_hf(path)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = get_model_class(config.architecture)(config)
    torch.set_default_dtype(torch.float32)
    load_checkpoint(model, path)
    return model.eval()


def decode_inputs(rows: int, context: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    per = -(-(context + 1) // BLOCK)
    tables = torch.arange(rows * per, dtype=torch.int32, device="cuda").view(rows, per)
    slots = tables[:, context // BLOCK].long() * BLOCK + context % BLOCK
    meta = AttentionMetadata(
        query_start_loc=torch.arange(rows + 1, dtype=torch.int32, device="cuda"),
        seq_lens=torch.full((rows,), context + 1, dtype=torch.int32, device="cuda"),
        block_tables=tables, slot_mapping=slots, query_start_loc_cpu=list(range(rows + 1)),
        seq_lens_cpu=[context + 1] * rows, max_query_len=1, max_seq_len=context + 1,
    )  # fmt: skip
    ids = torch.randint(3, vocab, (rows,), device="cuda")
    return ids, torch.full((rows,), context, dtype=torch.int64, device="cuda"), meta


def placement(stamps: torch.Tensor) -> str:
    """How a persistent kernel's programs landed on SMs, from the SM each stamped
    (grid_phases.SM_SLOT) in `stamps` [launches, P, STAMPS]: per launch, the SMs that ran any and
    the most any one ran (one each is the kernels' premise: every program runs on its own SM)."""
    sm = stamps[:, :, SM_SLOT.value].long().cpu()
    used, most = [], []
    for launch in sm:
        counts = torch.bincount(launch)
        used.append(int((counts > 0).sum()))
        most.append(int(counts.max()))
    doubled = sum(m > 1 for m in most)
    return (f"{sm.shape[1]} programs on {min(used)}-{max(used)} SMs; launches with an SM running 2+ of them: "
            f"{doubled} of {len(most)} (most on one SM: {max(most)})")


def parse(doc: str, rows: str, variants_help: str, extra: Callable[[argparse.ArgumentParser], None] | None = None) -> argparse.Namespace:
    """The flags both persistent-decode profiles take (`extra` adds a script's own)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="0.6b")
    p.add_argument("--rows", default=rows)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--variants", default="", help=variants_help)
    if extra is not None:
        extra(p)
    p.add_argument("--out")
    return p.parse_args()


def setup(args: argparse.Namespace) -> tuple[torch.nn.Module, torch.Tensor, TritonBackend, list[int], list[dict[str, int]]]:
    """(model, random KV cache, Triton backend, row counts, variants) of the flags `parse` reads."""
    ck = checkpoint(args.shape, None, torch.device("cuda"), 0)
    model = load(ck["path"])
    c = model.config
    rows_list = [int(r) for r in args.rows.split(",")]
    blocks = max(rows_list) * (-(-(args.context + 1) // BLOCK)) + 1
    cache = torch.randn(c.num_layers, 2, blocks, BLOCK, c.num_kv_heads, c.head_dim, device="cuda").to(torch.bfloat16)
    backend = TritonBackend(cache, c.head_dim**-0.5, c.num_heads, max(rows_list), args.context + 64)
    variants = [dict((kv.split("=")[0], int(kv.split("=")[1])) for kv in v.split(",") if kv) for v in args.variants.split(";")]
    return model, cache, backend, rows_list, variants


def main() -> None:
    args = parse(
        __doc__, "1,8,16",
        "';'-separated FusedDecode keyword sets to compare, each 'key=int,...' (e.g. "
        "'num_warps=8;bk=128;bn=16,programs_per_sm=2'); the empty set is the default kernel",
        lambda p: p.add_argument("--stamps", help="directory: each run's raw stamps [layers, P, STAMPS] saved there (torch.save)"),
    )  # fmt: skip
    model, cache, backend, rows_list, variants = setup(args)
    c = model.config
    assert unsupported(model, backend) is None, unsupported(model, backend)
    results = []
    with torch.inference_mode():
        for knobs, rows in itertools.product(variants, rows_list):
            name = ",".join(f"{k}={v}" for k, v in knobs.items()) or "default"
            ids, pos, meta = decode_inputs(rows, args.context, c.vocab_size)
            ctx = ForwardContext(backend, meta)
            try:
                fused = FusedDecode(model, backend, max(rows_list), **knobs)
                fused.forward(ids, pos, ctx)
            except Exception as e:  # a variant that does not compile (shared memory, registers)
                say(f"{name}, rows {rows}: {type(e).__name__}: {str(e)[:300]}")
                continue
            model.model.fused_decode = None
            want = model(ids, pos, ctx).float()
            model.model.fused_decode = fused
            err = (model(ids, pos, ctx).float() - want).abs().max().item() / want.abs().max().item()
            model.model.fused_decode = None
            plain = time_graph(lambda: model(ids, pos, ctx), 1, args.reps) / 1e3  # noqa: B023
            model.model.fused_decode = fused
            fast = time_graph(lambda: model(ids, pos, ctx), 1, args.reps) / 1e3  # noqa: B023
            stamps = torch.zeros(c.num_layers, fused.programs, STAMPS.value, dtype=torch.int64, device="cuda")
            time_graph(lambda: fused.forward(ids, pos, ctx, timing=stamps), 1, 3)  # noqa: B023  (the last replay's stamps)
            if args.stamps:
                torch.save(stamps.cpu(), f"{args.stamps}/stamps_{name}_{rows}.pt")
            t_all = stamps.double().cpu()
            t = t_all[:, :, : len(POINTS)]
            first = t[:, :, 0].min(1).values  # [L]: each layer's first program's start
            ends = t[:, :, len(POINTS) - 1].max(1).values  # [L]: each layer's last program's end
            start = torch.cat([first[:1], ends[:-1]])  # a layer's clock starts where the one before ends
            line = [statistics.median((t[:, :, i].max(1).values - start).tolist()) / 1e3 for i in range(len(POINTS))]
            # Inside the attention phase: its item's KV loop done (14), its split counted, and merged
            # by the last split (15).
            sub = [statistics.median((t_all[:, :, i].max(1).values - start).tolist()) / 1e3 for i in (14, 15)]
            early = (ends[:-1] - first[1:]).tolist()  # a layer's programs started this long before the previous one ended
            items = t_all[:, : rows * c.num_kv_heads * fused.splits(rows)]  # [L, programs with an item, STAMPS]
            parts = [statistics.median((items[:, :, b] - items[:, :, a]).flatten().tolist()) / 1e3 for _, a, b in ATTENTION_PARTS]
            row = {"rows": rows, "variant": name, "regs": fused.compiled.n_regs, "spills": fused.compiled.n_spills,
                   "plain_ms": plain, "fused_ms": fast, "rel_err": err, "timeline_us": line, "attention_us": sub, "attention_parts_us": parts,
                   "started_early_us": statistics.median(early) / 1e3 if early else None}  # fmt: skip
            results.append(row)
            say(f"{name}, rows {rows}: forward graph {plain:.3f} ms layer by layer, {fast:.3f} ms fused, max error {err:.2e} of max |out|")
            say(f"{name}, rows {rows}: layer kernels' placement: {placement(stamps)}")
    print(f"\n### fused decode, {args.shape}, context {args.context}: one layer's timeline (us, median over layers)\n")
    print("| variant, regs, spills | rows | " + " | ".join(POINTS[1:]) + " | attention loop, and merge | layer | started early | forward plain ms | fused ms |")
    print("| --- " * (len(POINTS) + 6) + "|")
    for r in results:
        # The clock starts at 0 (the previous layer's end); timeline_us[0] is the latest program's
        # start on it, before 0 where the layer's programs were scheduled early (PDL).
        clock = [0.0] + r["timeline_us"][1:]
        steps = [b - a for a, b in zip(clock, clock[1:], strict=False)]
        # from the attention phase's start (the barrier before it left)
        loop, merge = (max(0.0, x - r["timeline_us"][4]) for x in r["attention_us"])
        early = "-" if r["started_early_us"] is None else f"{r['started_early_us']:.2f}"  # one layer: no layer before
        print(f"| {r['variant']}, {r['regs']}, {r['spills']} | {r['rows']} | " + " | ".join(f"{s:.2f}" for s in steps)
              + f" | {loop:.2f}, {merge:.2f} | {r['timeline_us'][-1]:.2f} | {early} | {r['plain_ms']:.3f} | {r['fused_ms']:.3f} |")
    print("\n### inside the attention phase (us, each program's own stamps, median over layers and programs)\n")
    print("| variant | rows | " + " | ".join(n for n, _, _ in ATTENTION_PARTS) + " |")
    print("| --- " * (len(ATTENTION_PARTS) + 2) + "|")
    for r in results:
        print(f"| {r['variant']} | {r['rows']} | " + " | ".join(f"{x:.2f}" for x in r["attention_parts_us"]) + " |")
    if args.out:
        write_json(args.out, {"shape": args.shape, "context": args.context, "results": results})


if __name__ == "__main__":
    main()
