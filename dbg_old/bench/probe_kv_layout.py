"""Probe: the split-KV decode kernel's time per layer against the KV cache's layout within a block,
token-major ([blocks, block_size, Hkv, D], the engine's) or head-major ([blocks, Hkv, block_size,
D], passed to the same stride-based kernel as a permuted view), block sizes and tile configs, at
the 0.6B shape's attention (16 heads, 8 KV heads, head_dim 128). One CUDA graph over L layers
(caches past L2); a large bf16 sum gives the device's read bandwidth in the same run. A negative
split count runs `_persistent_decode` instead: -s programs per SM, items (row, KV head) dealt
round-robin, config BLOCK_N x PREFETCH x STAGES (PREFETCH 1: the next item's first K/V tile into
L2 before this item's loop). Results: bench/RESULTS.md, seventeenth session.

    python3 bench/probe_kv_layout.py --batch 64 --ctx 512
    python3 bench/probe_kv_layout.py --batch 64 --ctx 512 --layouts token --configs 64x0x3,64x1x3 --splits=-2,-4
"""

from __future__ import annotations

import argparse

import bench_runtime  # noqa: F401  (puts the repository root on sys.path)
import torch
import triton
import triton.language as tl
from attention_kernels import graph_time, read_bandwidth

from engine import pdl
from engine.attention import triton_decode as td
from engine.attention import triton_kernels as tk

H, HKV, D = 16, 8, 128


@triton.jit
def _persistent_decode(
    q_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, seq_lens_ptr, out_ptr, sm_scale_log2, B,
    stride_cblk, stride_ctok, stride_chead, stride_bt,
    NKV: tl.constexpr, GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, PREFETCH_NEXT: tl.constexpr, LINE: tl.constexpr,
):  # fmt: skip
    # Items (row, KV head) dealt round-robin over a grid of a few programs per SM; one split.
    pid = tl.program_id(0)
    progs = tl.num_programs(0)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    h_mask = offs_h < GROUP
    for item in range(pid, B * NKV, progs):
        seq = item // NKV
        kv_head = item % NKV
        seq_len = tl.load(seq_lens_ptr + seq)
        bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
        if PREFETCH_NEXT:
            nxt = item + progs
            if nxt < B * NKV:
                first = tl.arange(0, BLOCK_N)
                off = tk.kv_offsets(bt_ptr + (nxt // NKV).to(tl.int64) * stride_bt, first, first < BLOCK_N, nxt % NKV,
                                     stride_cblk, stride_ctok, stride_chead, BLOCK_SIZE)
                lines = (tl.arange(0, HEAD_DIM // LINE) * LINE)[None, :]
                pdl.prefetch_l2(k_cache_ptr + off[:, None] + lines)
                pdl.prefetch_l2(v_cache_ptr + off[:, None] + lines)
        heads = kv_head * GROUP + offs_h
        q = tl.load(q_ptr + seq * (NKV * GROUP * HEAD_DIM) + heads[:, None] * HEAD_DIM + offs_d[None, :], mask=h_mask[:, None], other=0.0)
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
        for n0 in range(0, seq_len, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_mask = offs_n < seq_len
            kv_off = tk.kv_offsets(bt_row, offs_n, n_mask, kv_head, stride_cblk, stride_ctok, stride_chead, BLOCK_SIZE)
            k = tl.load(k_cache_ptr + kv_off[:, None] + offs_d[None, :], mask=n_mask[:, None], other=0.0)
            v = tl.load(v_cache_ptr + kv_off[:, None] + offs_d[None, :], mask=n_mask[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k)) * sm_scale_log2
            s = tl.where(n_mask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + seq * (NKV * GROUP * HEAD_DIM) + heads[:, None] * HEAD_DIM + offs_d[None, :], out.to(out_ptr.dtype.element_ty), mask=h_mask[:, None])


def case(batch: int, ctx: int, block: int, head_major: bool, shuffled: bool, config: tuple[int, int, int], splits: int) -> float:
    per_layer = batch * ctx * HKV * D * 2 * 2
    layers = max(2, min(64, int(3e9 // per_layer)))
    bps = -(-ctx // block)
    nb = batch * bps
    shape = (layers, 2, nb, HKV, block, D) if head_major else (layers, 2, nb, block, HKV, D)
    cache = torch.randn(shape, device="cuda").to(torch.bfloat16)
    if head_major:
        cache = cache.transpose(3, 4)  # [L, 2, nb, block, HKV, D] view, head-major storage
    order = torch.randperm(nb, device="cuda") if shuffled else torch.arange(nb, device="cuda")
    tables = order.int().view(batch, bps).contiguous()
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, H, D, device="cuda").to(torch.bfloat16)
    out = torch.empty_like(q)
    part_out = torch.empty(max(1, batch * H * splits * D), dtype=torch.float32, device="cuda")
    part_lse = torch.empty(max(1, batch * H * splits), dtype=torch.float32, device="cuda")

    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def step() -> None:
        for layer in range(layers):
            if splits < 0:  # the persistent probe kernel: -splits programs per SM, config[1]: prefetch
                kc, vc = cache[layer, 0], cache[layer, 1]
                _persistent_decode[(-splits * sms,)](
                    q, kc, vc, tables, seq_lens, out, D**-0.5 * 1.4426950408889634, batch,
                    kc.stride(0), kc.stride(1), kc.stride(2), tables.stride(0),
                    NKV=HKV, GROUP=H // HKV, BLOCK_H=16, HEAD_DIM=D, BLOCK_SIZE=block, BLOCK_N=config[0],
                    PREFETCH_NEXT=config[1] == 1, LINE=64, num_warps=4, num_stages=config[2],
                )  # fmt: skip
                continue
            td.decode_attention(q, cache[layer, 0], cache[layer, 1], tables, seq_lens, out, D**-0.5, splits, part_out, part_lse, config)

    t = graph_time(step) / layers
    torch.cuda.empty_cache()
    return t


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--layouts", default="token,head")
    p.add_argument("--tables", default="shuffled,in order")
    p.add_argument("--configs", default="64x4x3,32x4x3,64x4x4,128x4x2,64x8x3")
    p.add_argument("--blocks", default="16,32")
    p.add_argument("--splits", default="1,2")
    a = p.parse_args()
    bw = read_bandwidth()
    nbytes = a.batch * a.ctx * HKV * D * 2 * 2
    print(f"read bandwidth {bw / 1e9:.0f} GB/s; K+V per layer {nbytes / 1e6:.1f} MB = {nbytes / bw * 1e6:.1f} us at it")
    print("| block | layout | tables | config | splits | us/layer | of read bw |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for block in map(int, a.blocks.split(",")):
        for head_major in [lay == "head" for lay in a.layouts.split(",")]:
            for shuffled in [t == "shuffled" for t in a.tables.split(",")]:
                for cfg in a.configs.split(","):
                    config = tuple(map(int, cfg.split("x")))
                    for splits in map(int, a.splits.split(",")):
                        t = case(a.batch, a.ctx, block, head_major, shuffled, config, splits)
                        print(f"| {block} | {'head' if head_major else 'token'} | {'shuffled' if shuffled else 'in order'} | {cfg} | {splits} | {t * 1e6:.1f} | {nbytes / t / bw:.3f} |", flush=True)


if __name__ == "__main__":
    main()
