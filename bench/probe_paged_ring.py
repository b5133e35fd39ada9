"""Probe: does a decode attention that keeps STAGES K/V pages in flight at all times run the batch-64
attention nearer the copy bandwidth than the backend's split-KV kernel?

The backend's kernel (engine/attention/triton_decode.py, as the batch decode launches it: PDL,
one split per (row, KV head) at 64 rows) keeps one K and one V tile of 64 tokens in flight and
none while it computes; at 64 rows its programs end spread over ~10 us, the slow ones finishing
alone at the rate their own pipeline allows (bench/RESULTS.md, twenty-seventh and twenty-eighth
sessions). This probe's Gluon kernel (`ring_decode_kernel`) runs the same work, one program per
(row, KV head), but streams the row's pages through a ring of STAGES shared-memory slots filled
by TMA (one 16-token page of K and of V a slot, an mbarrier each): a slot is refilled with the
page STAGES ahead as soon as the page in it is consumed, so STAGES pages stay in flight while the
program computes.

The online softmax (base 2) runs per token slot of a page: m, l [GROUP, 16] and acc [GROUP, 16, D]
are elementwise in the page's tokens, so a page costs one reduction (q . k over D, across 16 lanes)
and no cross-warp traffic; the 16 slots merge once, at the end. q is pre-scaled by scale * log2(e).

Each variant runs L layers' caches from one CUDA graph (us per layer), its output checked against
a float32 torch reference on layer 0. Only the attention itself: no q/k norm, rope or K/V store.

    python3 bench/probe_paged_ring.py --rows 64 --context 530 --stages 2,4,6,8
    python3 bench/probe_paged_ring.py --compile-only --stages 4,6   # sm_90 registers and shared memory, no GPU
"""

from __future__ import annotations

import argparse
import math

import bench_runtime  # noqa: F401  (puts the repository root on sys.path)
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

PAGE: gl.constexpr = gl.constexpr(16)  # tokens of a cache block


@gluon.jit
def _issue(k_desc, v_desc, k_smem, v_smem, bars, block, slot, g, D: gl.constexpr):
    # Page `block` of KV head g (K and V, PAGE x D each) into ring slot `slot`.
    bar = bars.index(slot)
    mbarrier.expect(bar, 2 * PAGE * D * 2)
    tma.async_copy_global_to_shared(k_desc, [block * PAGE, g * D], bar, k_smem.index(slot))
    tma.async_copy_global_to_shared(v_desc, [block * PAGE, g * D], bar, v_smem.index(slot))


@gluon.jit
def ring_decode_kernel(
    q_ptr,  # [B, NKV * GROUP, D] bf16
    k_desc, v_desc,  # TMA descriptors over a layer's cache viewed [num_blocks * PAGE, NKV * D]
    bt_ptr, seq_lens_ptr,  # [B, max_blocks] int32, [B] int32
    out_ptr,  # [B, NKV * GROUP, D] bf16
    scale_log2, stride_bt,
    NKV: gl.constexpr, GROUP: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr, SMEM: gl.constexpr,
    USE_PDL: gl.constexpr, COMPUTE: gl.constexpr,
):  # fmt: skip
    # [GROUP, PAGE, D]: GROUP in every thread; a page's 16 tokens over 4 warps x 2 lanes (2 each);
    # D over 16 lanes x 8 (16-byte shared-memory reads).
    L3: gl.constexpr = gl.BlockedLayout([GROUP, 2, 8], [1, 2, 16], [1, 4, 1], [2, 1, 0])
    KV: gl.constexpr = gl.SliceLayout(0, L3)  # [PAGE, D]
    S: gl.constexpr = gl.SliceLayout(2, L3)  # [GROUP, PAGE]
    Q: gl.constexpr = gl.SliceLayout(1, L3)  # [GROUP, D]
    pid = gl.program_id(0)
    b = pid // NKV
    g = pid % NKV
    seq_len = gl.load(seq_lens_ptr + b)
    npages = (seq_len + PAGE - 1) // PAGE
    bt_row = bt_ptr + b * stride_bt

    k_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, PAGE, D], SMEM)
    v_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, PAGE, D], SMEM)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    fence_async_shared()
    for i in gl.static_range(STAGES):
        if i < npages:
            _issue(k_desc, v_desc, k_smem, v_smem, bars, gl.load(bt_row + i), i, g, D)
    if USE_PDL:  # the pages above are no kernel's output; q is the kernel before's (in the engine)
        gl.inline_asm_elementwise(
            "griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1
        )
        gl.inline_asm_elementwise(
            "griddepcontrol.launch_dependents; // $0",
            "=r",
            [],
            dtype=gl.int32,
            is_pure=False,
            pack=1,
        )

    heads = gl.arange(0, GROUP, layout=gl.SliceLayout(1, Q))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, Q))
    qo = ((b * NKV + g) * GROUP + heads)[:, None] * D + cols[None, :]  # [GROUP, D]
    q = gl.load(q_ptr + qo).to(gl.float32) * scale_log2
    q3 = gl.expand_dims(q, 1)  # [GROUP, 1, D]
    tok_s = gl.arange(0, PAGE, layout=gl.SliceLayout(0, S))
    tok_kv = gl.arange(0, PAGE, layout=gl.SliceLayout(1, KV))

    m = gl.full([GROUP, PAGE], float("-inf"), gl.float32, S)
    l_sum = gl.zeros([GROUP, PAGE], gl.float32, S)
    acc = gl.zeros([GROUP, PAGE, D], gl.float32, L3)
    nxt = gl.load(bt_row + STAGES, mask=STAGES < npages, other=0)
    for t in range(npages):
        slot = t % STAGES
        mbarrier.wait(bars.index(slot), (t // STAGES) & 1)
        if COMPUTE:  # else the stream alone: the slot refilled at once
            k = k_smem.index(slot).load(KV).to(gl.float32)
            v = v_smem.index(slot).load(KV).to(gl.float32)
        gl.thread_barrier()  # every warp has read the slot: it may be refilled
        if t + STAGES < npages:
            _issue(k_desc, v_desc, k_smem, v_smem, bars, nxt, slot, g, D)
            nxt = gl.load(bt_row + t + STAGES + 1, mask=t + STAGES + 1 < npages, other=0)
        if COMPUTE:
            valid_s = (t * PAGE + tok_s) < seq_len
            v = gl.where(
                gl.expand_dims((t * PAGE + tok_kv) < seq_len, 1), v, 0.0
            )  # stale rows past the end
            s = gl.sum(q3 * gl.expand_dims(k, 0), axis=2)  # [GROUP, PAGE]
            s = gl.where(gl.expand_dims(valid_s, 0), s, float("-inf"))
            m_new = gl.maximum(m, s)
            m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = gl.exp2(m - m_use)
            p = gl.exp2(s - m_use)
            l_sum = l_sum * alpha + p
            acc = acc * gl.expand_dims(alpha, 2) + gl.expand_dims(p, 2) * gl.expand_dims(v, 0)
            m = m_new

    # The PAGE token slots merged: out = sum_j acc_j 2^(m_j - M) / sum_j l_j 2^(m_j - M).
    mx = gl.max(m, axis=1)  # [GROUP]
    mx = gl.where(mx == float("-inf"), 0.0, mx)
    w = gl.exp2(m - gl.expand_dims(mx, 1))
    total = gl.convert_layout(gl.sum(l_sum * w, axis=1), gl.SliceLayout(1, Q))
    o = gl.sum(acc * gl.expand_dims(w, 2), axis=1)  # [GROUP, D]
    o = o / gl.expand_dims(gl.where(total > 0, total, 1.0), 1)
    gl.store(out_ptr + qo, o.to(gl.bfloat16))
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))


def smem_layout() -> gl.NVMMASharedLayout:
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)


def compile_only(stages: list[int], groups: list[int]) -> None:
    """Compile for sm_90 on this machine (no GPU): registers, shared memory, programs per SM."""
    from compile_offline import compile_sm90

    desc = f"tensordesc<bf16[16,128],{smem_layout()!r}>"
    types = dict(q_ptr="*bf16", k_desc=desc, v_desc=desc, bt_ptr="*i32", seq_lens_ptr="*i32", out_ptr="*bf16",
                 scale_log2="fp32", stride_bt="i32")  # fmt: skip
    for group in groups:
        for st, compute in [(st, c) for st in stages for c in (True, False)]:
            consts = dict(NKV=8, GROUP=group, D=128, STAGES=st, SMEM=smem_layout(), USE_PDL=True, COMPUTE=compute)
            r = compile_sm90(ring_decode_kernel, types, consts, dict(num_warps=4, launch_pdl=True),
                             ("k_desc", "v_desc", "stride_bt"))  # fmt: skip
            print(f"GROUP={group} STAGES={st} COMPUTE={compute}: {r['regs']} registers, {r['shared']} B shared; "
                  f"programs per SM {r['per_sm_regs']} (registers) / {r['per_sm_shared']} (shared)")


def reference(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, tables: torch.Tensor, seq_lens: torch.Tensor,
              scale: float) -> torch.Tensor:  # fmt: skip
    """float32 attention of q [B, H, D] over each row's cached tokens."""
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    nkv = kc.shape[2]
    for b in range(q.shape[0]):
        n = int(seq_lens[b])
        pos = torch.arange(n, device=q.device)
        blocks = tables[b, pos // kc.shape[1]].long()
        k = kc[blocks, pos % kc.shape[1]].float()  # [n, NKV, D]
        v = vc[blocks, pos % kc.shape[1]].float()
        k = k.repeat_interleave(q.shape[1] // nkv, dim=1)
        v = v.repeat_interleave(q.shape[1] // nkv, dim=1)
        s = torch.einsum("hd,nhd->hn", q[b].float(), k) * scale
        out[b] = torch.einsum("hn,nhd->hd", s.softmax(-1), v)
    return out


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--context", type=int, default=530)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--stages", default="2,4,6,8")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--tables", choices=("shuffled", "in-order"), default="shuffled")
    p.add_argument("--compile-only", action="store_true")
    args = p.parse_args()
    stages = [int(s) for s in args.stages.split(",")]
    if args.compile_only:
        compile_only(stages, [args.heads // args.kv_heads])
        return
    from attention_kernels import read_bandwidth
    from bench_linear import time_graph
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from engine.attention.triton import TritonBackend

    rows, ctx, H, HKV, D, L = args.rows, args.context, args.heads, args.kv_heads, 128, args.layers
    per = -(-ctx // 16)
    blocks = rows * per + 1
    cache = torch.randn(L, 2, blocks, 16, HKV, D, device="cuda").to(torch.bfloat16)
    order = (
        torch.randperm(rows * per, device="cuda")
        if args.tables == "shuffled"
        else torch.arange(rows * per, device="cuda")
    )
    tables = (order.int() + 1).view(rows, per).contiguous()
    seq_lens = torch.full((rows,), ctx, dtype=torch.int32, device="cuda")
    from engine.attention import AttentionMetadata

    meta = AttentionMetadata(
        query_start_loc=torch.arange(rows + 1, dtype=torch.int32, device="cuda"), seq_lens=seq_lens,
        block_tables=tables, slot_mapping=torch.full((rows,), -1, dtype=torch.int64, device="cuda"),
        query_start_loc_cpu=list(range(rows + 1)), seq_lens_cpu=[ctx] * rows, max_query_len=1, max_seq_len=ctx,
    )  # fmt: skip
    backend = TritonBackend(cache, D**-0.5, H, rows, ctx + 64)
    q = torch.randn(rows, H, D, device="cuda").to(torch.bfloat16)
    out = torch.empty_like(q)
    layout = smem_layout()
    descs = [
        (TensorDescriptor.from_tensor(cache[i, 0].view(-1, HKV * D), [16, D], layout),
         TensorDescriptor.from_tensor(cache[i, 1].view(-1, HKV * D), [16, D], layout))
        for i in range(L)
    ]  # fmt: skip
    scale_log2 = D**-0.5 * math.log2(math.e)
    ref = reference(q, cache[0, 0], cache[0, 1], tables, seq_lens, D**-0.5)

    def ring(st: int, layers: int, compute: bool = True) -> None:
        for i in range(layers):
            ring_decode_kernel[(rows * HKV,)](q, descs[i][0], descs[i][1], tables, seq_lens, out, scale_log2, tables.stride(0),
                                              NKV=HKV, GROUP=H // HKV, D=D, STAGES=st, SMEM=layout, USE_PDL=True,
                                              COMPUTE=compute, num_warps=4, launch_pdl=True)  # fmt: skip

    backend.decode(0, q, meta, out, pdl_launch=True)
    print(
        f"backend kernel on layer 0: max abs diff to float32 {(out.float() - ref).abs().max().item():.2e}"
    )
    for st in stages:
        out.zero_()
        ring(st, 1)
        print(
            f"ring STAGES={st} on layer 0: max abs diff to float32 {(out.float() - ref).abs().max().item():.2e}"
        )
    bw = read_bandwidth()
    nbytes = rows * ctx * HKV * D * 2 * 2
    print(
        f"\nread bandwidth {bw / 1e9:.0f} GB/s; K/V {nbytes / 1e6:.1f} MB a layer = {nbytes / bw * 1e6:.2f} us\n"
    )
    print(
        "| kernel | "
        + " | ".join(f"round {r + 1} us a layer" for r in range(args.rounds))
        + " | fraction of read bandwidth |"
    )
    print("| --- | " + " | ".join("---" for _ in range(args.rounds)) + " | --- |")
    for name, fn in [("backend split-KV (PDL)", lambda: [backend.decode(i, q, meta, out, pdl_launch=True) for i in range(L)])] + [
        (f"ring STAGES={st}", lambda st=st: ring(st, L)) for st in stages
    ] + [(f"ring STAGES={st}, no compute (the stream alone)", lambda st=st: ring(st, L, False)) for st in stages]:  # fmt: skip
        us = [time_graph(fn, L, 30) for _ in range(args.rounds)]
        print(
            f"| {name} | "
            + " | ".join(f"{u:.2f}" for u in us)
            + f" | {nbytes / bw / (min(us) * 1e-6):.3f} |"
        )


if __name__ == "__main__":
    with torch.inference_mode():
        main()
