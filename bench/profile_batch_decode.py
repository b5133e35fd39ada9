"""Where the two-launches-per-layer decode (engine/models/batch_decode.py) spends a step: each
program of the persistent kernel stamps %globaltimer at the ends of its phases and barriers, and
this prints, per row count, the timeline of one launch between two attention calls (median over
the middle launches of the last program's stamp minus the end of the launch's PDL wait, the
moment the attention kernel before it ended), how long before that its programs were scheduled,
the time from its end to the next launch's wait ending (the attention kernel after it, as the
graph runs it), the attention kernels alone, and the model forward replayed from a CUDA graph
with and without `BatchDecode` (no logits, no sampler). The stamped forward is a graph too, as
the engine runs it: launched eagerly each launch would wait for the host and overlap nothing.

    python3 bench/profile_batch_decode.py --shape 0.6b --rows 8,16,32,64 --context 512

Every row has the same context, so the attention's last K/V tile holds (context + 1) % 64 tokens:
at 512, the new token alone. A change to which tokens the attention loop reads (the new one from
registers, say) can save that whole tile here and nowhere else; compare such changes at a
second context too (530: bench/RESULTS.md, twenty-second session).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import statistics
from collections.abc import Iterator

import bench_runtime  # noqa: F401  (puts the repository root on sys.path)
import torch
from bench_linear import time_graph
from bench_runtime import say, write_json
from profile_fused_decode import decode_inputs, parse, placement, setup

from engine.attention import ForwardContext
from engine.attention import triton_decode as td
from engine.models import batch_attention
from engine.models.batch_attention import rope_decode_kernel
from engine.models.batch_decode import BatchDecode, unsupported
from engine.models.grid_phases import STAMPS

POINTS = ["start", "o_proj", "barrier", "norm", "barrier", "gate_up", "barrier", "down", "barrier", "norm",
          "barrier", "qkv"]  # batch_kernel's stamps 0..11 (11: the launch's end)
WAITED = 12  # batch_kernel's stamp once its PDL wait is over


def _attention_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--attention-configs", default="",
        help="','-separated decode-kernel configs BLOCK_NxWARPSxSTAGES to time at each row count, alone and "
        "in the forward with the batch decode (e.g. '64x4x3,32x4x7': name the backend's own to compare)",
    )  # fmt: skip
    p.add_argument("--rounds", type=int, default=1, help="interleaved rounds over --attention-configs")


@contextlib.contextmanager
def decode_config(config: tuple[int, int, int]) -> Iterator[None]:
    """Every decode-kernel config chosen inside is `config` (BLOCK_N, warps, stages): the backend's
    launches, and a `BatchDecode` built inside (its attention kernel's constants)."""
    defaults = td.decode_config, batch_attention.batch_tile_config
    td.decode_config = batch_attention.batch_tile_config = lambda head_dim, elem_bytes: config
    try:
        yield
    finally:
        td.decode_config, batch_attention.batch_tile_config = defaults


def main() -> None:
    args = parse(
        __doc__, "8,16,32,64",
        "';'-separated BatchDecode keyword sets to compare, each 'key=int,...' (e.g. "
        "'bn=128;bk=256,stages=2'); the empty set is the default kernel",
        _attention_flag,
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
                batch = BatchDecode(model, backend, 1, max(rows_list), **knobs)
                batch.forward(ids, pos, ctx)
            except Exception as e:  # a variant that does not compile (shared memory, registers)
                say(f"{name}, rows {rows}: {type(e).__name__}: {str(e)[:300]}")
                continue
            model.model.batch_decode = None
            plain = time_graph(lambda: model(ids, pos, ctx), 1, args.reps) / 1e3  # noqa: B023
            model.model.batch_decode = batch
            fast = time_graph(lambda: model(ids, pos, ctx), 1, args.reps) / 1e3  # noqa: B023
            model.model.batch_decode = None
            layers = list(enumerate(model.model.layers))
            plan = backend.merged_decode_plan(rows)
            attention = time_graph(
                lambda: [batch.attention(i, layer, pos, meta, plan) for i, layer in layers], c.num_layers, args.reps  # noqa: B023
            )  # fmt: skip
            configs: dict[str, list[tuple[float, float]]] = {}
            for _, spec in itertools.product(range(args.rounds), filter(None, args.attention_configs.split(","))):
                with decode_config(tuple(int(v) for v in spec.split("x"))):
                    # A BatchDecode built under the config: its attention kernel takes it at construction.
                    other = BatchDecode(model, backend, 1, max(rows_list), **knobs)
                    alone = time_graph(lambda: [other.attention(i, layer, pos, meta, plan) for i, layer in layers],  # noqa: B023
                                       c.num_layers, args.reps)  # fmt: skip
                    model.model.batch_decode = other
                    forward = time_graph(lambda: model(ids, pos, ctx), 1, args.reps) / 1e3  # noqa: B023
                    model.model.batch_decode = None
                configs.setdefault(spec, []).append((alone, forward))
            if configs:
                kernels = [k for ks in rope_decode_kernel.device_caches.values() for k in ks[0].values()]
                say(f"rows {rows}: decode kernel variants (regs, shared): {[(k.n_regs, k.metadata.shared) for k in kernels]}")
                say(f"rows {rows}: by config, attention alone us per layer / forward ms, each round: " + "; ".join(
                    f"{k} " + ", ".join(f"{a:.2f} / {f:.3f}" for a, f in v) for k, v in configs.items()))  # fmt: skip
            stamps = torch.zeros(c.num_layers + 1, batch.programs, STAMPS.value, dtype=torch.int64, device="cuda")
            time_graph(lambda: batch.forward(ids, pos, ctx, timing=stamps), 1, 3)  # noqa: B023  (the last replay's stamps)
            every = stamps.double().cpu()
            waited = every[:, :, WAITED].min(1).values  # [launches]: each one's PDL wait over (the attention before ended)
            ends = every[:, :, len(POINTS) - 1].max(1).values  # [launches]: each one's last program's end
            t = every[1:-1, :, : len(POINTS)]  # the middle launches: every phase
            line = [statistics.median((t[:, :, i].max(1).values - waited[1:-1]).tolist()) / 1e3 for i in range(len(POINTS))]
            early = (waited - every[:, :, 0].min(1).values)[1:].tolist()  # scheduled this long before (not the first, plain launch)
            row = {"rows": rows, "variant": name, "regs": batch.compiled.n_regs, "spills": batch.compiled.n_spills,
                   "plain_ms": plain, "batch_ms": fast, "attention_us": attention, "timeline_us": line,
                   "between_us": statistics.median((waited[1:] - ends[:-1]).tolist()) / 1e3,
                   "started_early_us": statistics.median(early) / 1e3, "attention_configs_us": configs}  # fmt: skip
            results.append(row)
            say(f"{name}, rows {rows}: forward graph {plain:.3f} ms layer by layer, {fast:.3f} ms batch decode")
            say(f"{name}, rows {rows}: persistent kernels' placement: {placement(stamps)}")
    print(f"\n### batch decode, {args.shape}, context {args.context}: one launch's timeline (us, median over layers)\n")
    print("| variant, regs, spills | rows | " + " | ".join(POINTS[1:]) + " | launch | started early | attention after it "
          "| attention alone | forward plain ms | batch ms |")  # fmt: skip
    print("| --- " * (len(POINTS) + 7) + "|")
    for r in results:
        clock = [0.0] + r["timeline_us"][1:]  # from the wait's end; the first phase's stamp counts from there
        steps = [b - a for a, b in zip(clock, clock[1:], strict=False)]
        print(f"| {r['variant']}, {r['regs']}, {r['spills']} | {r['rows']} | " + " | ".join(f"{s:.2f}" for s in steps)
              + f" | {r['timeline_us'][-1]:.2f} | {r['started_early_us']:.2f} | {r['between_us']:.2f} | {r['attention_us']:.2f}"
              + f" | {r['plain_ms']:.3f} | {r['batch_ms']:.3f} |")
    if args.out:
        write_json(args.out, {"shape": args.shape, "context": args.context, "results": results})


if __name__ == "__main__":
    main()
