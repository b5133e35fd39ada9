"""Fused ops (engine/kernels/fused_ops.py) before / after, on a GPU, in one run:

1. decode: an engine on a Qwen3-0.6B-shaped random bf16 checkpoint (engine_shapes.make_checkpoint)
   built twice, without the fused ops (`EngineConfig.fused_ops`) and with them; each replays its bs=1
   and bs=64 decode graphs over a random KV cache (context `--context`), timed with CUDA events;
   GPU kernels per eager forward and per layer (torch profiler); the two engines' logits compared.
2. ops: each fused op against its torch ops at a few token counts, both captured in CUDA graphs
   (triton.testing.do_bench_cudagraph, median).

    python3 bench/kernels/fused_ops.py --out $OUT/fused_ops.json
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import statistics
import sys
from typing import Any

import torch

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.dirname(BENCH), BENCH]

from bench_runtime import say, write_json  # noqa: E402
from device_timing import copy_bandwidth  # noqa: E402
from engine_shapes import FULL_SHAPE, make_checkpoint  # noqa: E402
from report import print_table  # noqa: E402

from engine.attention import AttentionMetadata  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.core.engine_core import EngineCore  # noqa: E402
from engine.memory.kv_budget import kv_block_bytes  # noqa: E402
from engine.models.layers import RMSNorm, SiluAndMul  # noqa: E402
from engine.models.rotary import RotaryEmbedding, apply_rotary  # noqa: E402


def decode_metadata(bs: int, context: int, block_size: int, num_blocks: int, device: torch.device) -> AttentionMetadata:
    """bs sequences of `context` tokens (the last one new), blocks drawn from a shuffled pool."""
    per_seq = -(-context // block_size)
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(bs))[: bs * per_seq].view(bs, per_seq)
    last = context - 1
    slots = perm[:, last // block_size] * block_size + last % block_size
    return AttentionMetadata(
        query_start_loc=torch.arange(bs + 1, dtype=torch.int32, device=device),
        seq_lens=torch.full((bs,), context, dtype=torch.int32, device=device),
        block_tables=perm.to(torch.int32).to(device),
        slot_mapping=slots.to(torch.int64).to(device),
        query_start_loc_cpu=list(range(bs + 1)),
        seq_lens_cpu=[context] * bs,
        max_query_len=1,
        max_seq_len=context,
    )


def replay_step(graphs: Any, bs: int, parts: list[list[int]], before: Any = None, after: Any = None) -> None:
    """Stage the decode step `parts` (a StepPlan's, engine/runner/graph_io.py) and replay the graph
    of batch bs, between the events `before` and `after` when given."""
    slot = graphs.io.stage_step(parts, [1.0] * bs, bs, bs)
    if before is not None:
        before.record()
    graphs.graphs[bs].replay()
    if after is not None:
        after.record()
    graphs.io.replayed(slot)


def kernels_per_layer(model: torch.nn.Module, forward: Any) -> int:
    """Kernels a decoder layer adds to `forward`: its count with the model's first two layers less
    its count with the first one (a model without layers has no decode path to compare)."""
    layers = model.model.layers
    counts = []
    try:
        for k in (1, 2):
            model.model.layers = layers[:k]
            counts.append(count_kernels(forward)[0])
    finally:
        model.model.layers = layers
    return counts[1] - counts[0]


def count_kernels(fn: Any) -> tuple[int, dict[str, int]]:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names: dict[str, int] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            names[e.name] = names.get(e.name, 0) + 1
    return sum(names.values()), names


@torch.inference_mode()
def decode(args: argparse.Namespace, fused: bool, bandwidth: float, ref: dict[int, torch.Tensor]) -> dict[str, Any]:
    core = EngineCore(EngineConfig(
        model=args.model_dir, device="cuda", dtype="bfloat16", num_kv_blocks=4096, max_num_seqs=256,
        cuda_graph_max_bs=256, max_model_len=2048, fused_ops=fused,
    ))  # fmt: skip
    runner, graphs = core.runner, core.runner.graphs
    assert graphs is not None and runner.model.fused == fused
    device = runner.device
    runner.kv_cache.normal_(generator=torch.Generator(device).manual_seed(0))
    mc = core.model_config
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    kv_token = kv_block_bytes(mc, 1, runner.dtype)
    out: dict[str, Any] = {"fused": fused, "batches": {}}
    for bs in args.batch_sizes:
        meta = decode_metadata(bs, args.context, runner.block_size, runner.num_kv_blocks, device)
        ids = torch.randint(0, mc.vocab_size, (bs,), generator=torch.Generator().manual_seed(bs))
        # The step as the runner stages it (engine/runner/graph_io.py): every replay's gather reads it.
        parts = [ids.tolist(), [args.context - 1] * bs, list(range(bs)), [], [], meta.slot_mapping.tolist(),
                 list(range(bs + 1)), meta.seq_lens.tolist(), meta.block_tables.flatten().tolist()]  # fmt: skip
        replay = functools.partial(replay_step, graphs, bs, parts)
        replay()
        torch.cuda.synchronize()
        logits = graphs.logits[:bs].float()
        row: dict[str, Any] = {}
        if bs in ref:
            r = ref[bs]
            row["logits_rel_err_vs_unfused"] = ((logits - r).abs().max() / r.abs().max()).item()
            row["argmax_agree"] = (logits.argmax(-1) == r.argmax(-1)).float().mean().item()
        else:
            ref[bs] = logits
        for _ in range(20):
            replay()
        times = []
        for _ in range(args.replays):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            replay(start, end)
            end.synchronize()
            times.append(start.elapsed_time(end))
        roofline_ms = (weight_bytes + kv_token * bs * args.context) / bandwidth * 1e3
        forward = functools.partial(graphs._forward, bs)  # eager, over the same static inputs
        total, names = count_kernels(forward)
        row |= {"replay_median_ms": statistics.median(times), "replay_min_ms": min(times), "roofline_ms": roofline_ms,
                "kernels_per_forward": total, "kernels_per_layer": kernels_per_layer(runner.model, forward),
                "kernel_names": names}
        out["batches"][bs] = row
        say(f"decode fused={fused} bs={bs}: replay {row['replay_median_ms']:.3f} ms (roofline {roofline_ms:.3f}), "
            f"{total} kernels/forward, {row['kernels_per_layer']:.1f}/layer"
            + (f", logits rel err vs unfused {row['logits_rel_err_vs_unfused']:.3g}, argmax agree "
               f"{row['argmax_agree']:.2f}" if "argmax_agree" in row else ""))
    del core, runner, graphs, forward
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return out


def op_cases(tokens: int) -> dict[str, tuple[Any, Any]]:
    """op name -> (torch ops, fused op), closures over fresh random bf16 inputs of `tokens` rows."""
    from engine.kernels import rope as rope_kernel

    dev, dt = "cuda", torch.bfloat16
    H, Hkv, D, N, inter = 16, 8, 128, 1024, 3072
    norm_t = RMSNorm(N, 1e-6).cuda().to(dt)
    norm_f = RMSNorm(N, 1e-6, fused=True).cuda().to(dt)
    qn, kn = RMSNorm(D, 1e-6).cuda().to(dt), RMSNorm(D, 1e-6).cuda().to(dt)
    for m in (norm_t, norm_f, qn, kn):
        m.weight.data.normal_(1.0, 0.2)
    rope = RotaryEmbedding(D, 4096, 1e6, None).cuda()
    x = torch.randn(tokens, N, device=dev, dtype=dt)
    res = torch.randn(tokens, N, device=dev, dtype=dt)
    qkv = torch.randn(tokens, (H + 2 * Hkv) * D, device=dev, dtype=dt)
    pos = torch.randint(0, 4096, (tokens,), device=dev)
    gu = torch.randn(tokens, 2 * inter, device=dev, dtype=dt)
    q, k = qkv[:, : H * D].view(tokens, H, D), qkv[:, H * D : (H + Hkv) * D].view(tokens, Hkv, D)

    def torch_rope() -> None:
        r = rope(pos)
        apply_rotary(qn(q), r.cos, r.sin)
        apply_rotary(kn(k), r.cos, r.sin)

    return {
        "rms_norm": (lambda: norm_t(x), lambda: norm_f(x)),
        "add_rms_norm": (lambda: norm_t(x, res), lambda: norm_f(x, res)),
        "qk_norm_rope": (torch_rope, lambda: rope_kernel.rotary(q, k, pos, rope.cos_sin_cache, qn.weight, kn.weight, 1e-6)),
        "silu_and_mul": (lambda: SiluAndMul()(gu), lambda: SiluAndMul(fused=True)(gu)),
    }


@torch.inference_mode()
def ops(args: argparse.Namespace) -> list[dict[str, Any]]:
    from triton.testing import do_bench_cudagraph

    rows = []
    for T in args.op_tokens:
        for name, (ref_fn, fused_fn) in op_cases(T).items():
            fused_fn()  # compile outside the timing
            t_ref = do_bench_cudagraph(ref_fn, rep=20, return_mode="median")
            t_fused = do_bench_cudagraph(fused_fn, rep=20, return_mode="median")
            rows.append({"op": name, "tokens": T, "torch_us": t_ref * 1e3, "fused_us": t_fused * 1e3})
            say(f"op {name} T={T}: torch {t_ref * 1e3:.1f} us, fused {t_fused * 1e3:.1f} us")
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", default="/tmp/siesta-bench-qwen3-0.6b")
    p.add_argument("--out", default="/tmp/fused_ops.json")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 64])
    p.add_argument("--op-tokens", type=lambda s: [int(x) for x in s.split(",")], default=[1, 64, 4096])
    p.add_argument("--replays", type=int, default=200)
    p.add_argument("--skip-ops", action="store_true")
    args = p.parse_args()
    device = torch.device("cuda")
    res: dict[str, Any] = {"device": torch.cuda.get_device_name(device), "context": args.context}
    make_checkpoint(args.model_dir, FULL_SHAPE, device, seed=0)
    bandwidth = copy_bandwidth(device, 1024, 20)["bandwidth_bytes_per_s"]
    res["copy_bandwidth_bytes_per_s"] = bandwidth
    ref: dict[int, torch.Tensor] = {}
    res["unfused"] = decode(args, False, bandwidth, ref)
    res["fused"] = decode(args, True, bandwidth, ref)
    if not args.skip_ops:
        res["ops"] = ops(args)
    write_json(args.out, res)
    rows = []
    for bs in args.batch_sizes:
        a, b = res["unfused"]["batches"][bs], res["fused"]["batches"][bs]
        rows.append([bs, a["replay_median_ms"], b["replay_median_ms"], a["replay_median_ms"] / b["replay_median_ms"],
                     a["roofline_ms"], a["kernels_per_layer"], b["kernels_per_layer"], b["logits_rel_err_vs_unfused"],
                     b["argmax_agree"]])
    print_table(f"fused ops, decode graph replay: {res['device']}, context {args.context}, bf16 Qwen3-0.6B shape",
                ["bs", "unfused ms", "fused ms", "unfused / fused", "roofline ms", "kernels a layer, unfused", "fused",
                 "logits rel err", "argmax agree"], rows)
    if "ops" in res:
        print_table("fused ops against torch's, CUDA graphs, median", ["op", "tokens", "torch us", "fused us"],
                    [[r["op"], r["tokens"], r["torch_us"], r["fused_us"]] for r in res["ops"]])
    return 0


if __name__ == "__main__":
    sys.exit(main())
