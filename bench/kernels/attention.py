"""Triton attention kernels against the device's own ceilings, measured in the same run.

Decode: one CUDA graph replays store_kv + split-KV decode (+ reduce) over L layers of a paged cache
(shuffled block tables) big enough to spill L2; time per layer = replay time / L. Achieved bandwidth
counts the bytes the step must move (K/V read, q read, out written, new K/V written, partials),
against a large device-to-device copy (bytes read + written). Rows sweep the decode tile config
and the split target. Prefill: TFLOP/s of the causal work, against torch's SDPA on contiguous
tensors (flash) with the same shapes.

    python3 bench/kernels/attention.py [--json results.json]
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any

import torch

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.dirname(BENCH), BENCH]

from bench_runtime import write_json  # noqa: E402
from device_timing import copy_bandwidth, event_time  # noqa: E402
from report import print_table  # noqa: E402

from engine.attention import AttentionMetadata  # noqa: E402
from engine.attention.triton import TritonBackend  # noqa: E402
from engine.kernels import attention as tk  # noqa: E402
from engine.kernels import attention_decode as td  # noqa: E402
from engine.kernels import attention_prefill as tp  # noqa: E402

H, HKV, D, BLOCK = 32, 8, 128, 16  # Llama-3-8B / Qwen-7B-like attention
DTYPE = torch.bfloat16
MAX_MODEL_LEN = 32768


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def graph_time(step: Callable[[], object]) -> float:
    """Median seconds of one replay of a CUDA graph of step() (run once eagerly first)."""
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return event_time(graph.replay)


def decode_case(batch: int, ctx: int, configs: list[tuple[int, ...]], split_targets: list[int],
                copy_bw: float) -> list[dict[str, Any]]:
    per_layer = batch * ctx * HKV * D * 2 * 2  # K and V bytes one layer reads
    layers = max(2, min(64, int(2e9 // per_layer)))
    blocks_per_seq = cdiv(ctx, BLOCK)
    num_blocks = batch * blocks_per_seq
    cache = torch.randn(layers, 2, num_blocks, BLOCK, HKV, D, device="cuda").to(DTYPE)
    backend = TritonBackend(cache, D**-0.5, H, max_num_seqs=max(batch, 256), max_model_len=MAX_MODEL_LEN)
    perm = torch.randperm(num_blocks, device="cuda").int()
    tables = perm.view(batch, blocks_per_seq)
    last = ctx - 1
    slots = (tables[:, last // BLOCK].long() * BLOCK + last % BLOCK).contiguous()
    meta = AttentionMetadata(
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device="cuda"),
        seq_lens=torch.full((batch,), ctx, dtype=torch.int32, device="cuda"),
        block_tables=tables,
        slot_mapping=slots,
        query_start_loc_cpu=list(range(batch + 1)),
        seq_lens_cpu=[ctx] * batch,
        max_query_len=1,
        max_seq_len=ctx,
    )
    q = torch.randn(batch, H, D, device="cuda").to(DTYPE)
    k = torch.randn(batch, HKV, D, device="cuda").to(DTYPE)
    v = torch.randn_like(k)
    out = torch.empty_like(q)
    rows = []
    variants = [(c, None) for c in configs] + [(configs[0], t) for t in split_targets]
    for config, target in variants:
        splits = backend.num_splits(batch)
        if target is not None:
            saved = backend.wave_programs
            backend.wave_programs = target * torch.cuda.get_device_properties(0).multi_processor_count
            splits = backend.num_splits(batch)
            backend.wave_programs = saved
        # The workspace is sized for the backend's own split rule; bigger sweeps get their own.
        part_out = torch.empty(max(1, batch * H * splits * D), dtype=torch.float32, device="cuda")
        part_lse = torch.empty(max(1, batch * H * splits), dtype=torch.float32, device="cuda")

        def step(config: tuple[int, ...] = config, splits: int = splits, part_out: torch.Tensor = part_out,
                 part_lse: torch.Tensor = part_lse) -> None:
            for layer in range(layers):
                kc, vc = cache[layer, 0], cache[layer, 1]
                tk.store_kv(k, v, kc, vc, meta.slot_mapping)
                td.decode_attention(q, kc, vc, meta.block_tables, meta.seq_lens, out, D**-0.5, splits, part_out, part_lse, config)

        t = graph_time(step) / layers
        nbytes = per_layer + 2 * batch * H * D * 2 + 2 * batch * HKV * D * 2
        if splits > 1:
            nbytes += 2 * batch * H * splits * (D + 1) * 4
        rows.append(
            dict(
                batch=batch, ctx=ctx, config="x".join(map(str, config)),
                split_target=target or "default", splits=splits, layers=layers,
                us_per_layer=t * 1e6, gbps=nbytes / t / 1e9, frac_copy=nbytes / t / copy_bw,
            )
        )  # fmt: skip
    return rows


def prefill_case(batch: int, q_len: int, ctx: int, config: tuple[int, ...] | None = None) -> dict[str, Any]:
    seq_len = ctx + q_len
    blocks_per_seq = cdiv(seq_len, BLOCK)
    num_blocks = batch * blocks_per_seq
    cache = torch.randn(1, 2, num_blocks, BLOCK, HKV, D, device="cuda").to(DTYPE)
    tables = torch.randperm(num_blocks, device="cuda").int().view(batch, blocks_per_seq)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda") * q_len
    seq_lens = torch.full((batch,), seq_len, dtype=torch.int32, device="cuda")
    q = torch.randn(batch * q_len, H, D, device="cuda").to(DTYPE)
    out = torch.empty_like(q)
    kc, vc = cache[0, 0], cache[0, 1]

    def ours() -> None:
        tp.prefill_attention(q, kc, vc, tables, seq_lens, qsl, out, D**-0.5, q_len, config)

    t = event_time(ours)
    flops = batch * 4 * H * D * (q_len * ctx + q_len * (q_len + 1) / 2)
    # torch flash on contiguous tensors, same shapes (a fresh prompt only: no offset mask there).
    qs = torch.randn(batch, H, q_len, D, device="cuda").to(DTYPE)
    ks = torch.randn(batch, H, seq_len, D, device="cuda").to(DTYPE)
    vs = torch.randn_like(ks)
    sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=ctx == 0)  # noqa: E731
    t_ref = event_time(sdpa)
    ref_flops = flops if ctx == 0 else batch * 4 * H * D * q_len * seq_len
    name = "x".join(map(str, config)) if config else "default"
    return dict(batch=batch, q_len=q_len, ctx=ctx, config=name, ms=t * 1e3, tflops=flops / t / 1e12, sdpa_tflops=ref_flops / t_ref / 1e12)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default=None)
    parser.add_argument("--quick", action="store_true", help="default config only")
    args = parser.parse_args()
    torch.manual_seed(0)
    name = torch.cuda.get_device_name()
    copy_bw = copy_bandwidth(torch.device("cuda"), 1024, 30)["bandwidth_bytes_per_s"]
    configs = [td.decode_config(D, 2)]
    if not args.quick:
        configs += [(32, 4, 3), (128, 4, 2)]
    targets = [] if args.quick else [2, 8]
    decode = []
    for batch, ctx in ((1, 1024), (64, 1024), (256, 1024), (1, 8192), (32, 8192)):
        decode += decode_case(batch, ctx, configs, targets, copy_bw)
        torch.cuda.empty_cache()
    prefill_configs = [None] if args.quick else [None, (128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (128, 32, 4, 3)]
    prefill = [prefill_case(4, 2048, 0, c) for c in prefill_configs] + [prefill_case(1, 1024, 7168)]
    if args.json:
        write_json(args.json, dict(device=name, copy_gbps=copy_bw / 1e9, decode=decode, prefill=prefill))
    print_table(f"split-KV decode: {name}, H={H} Hkv={HKV} D={D} block={BLOCK} {str(DTYPE)[6:]}, one CUDA graph over "
                f"the layers; copy {copy_bw / 1e9:.0f} GB/s (read + write)",
                ["batch", "ctx", "config", "split target", "splits", "us a layer", "GB/s", "of copy"],
                [[r["batch"], r["ctx"], r["config"], str(r["split_target"]), r["splits"], r["us_per_layer"], r["gbps"],
                  r["frac_copy"]] for r in decode])
    print_table("prefill, causal (sdpa: torch flash on contiguous K/V, no paging)",
                ["batch", "q_len", "ctx", "config", "ms", "TFLOP/s", "sdpa TFLOP/s"],
                [[r["batch"], r["q_len"], r["ctx"], r["config"], r["ms"], r["tflops"], r["sdpa_tflops"]] for r in prefill])


if __name__ == "__main__":
    main()
