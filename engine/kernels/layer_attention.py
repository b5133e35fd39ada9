"""The attention phase of the one-kernel-per-layer decode (layer_kernel.py), and the merge of its
splits: Triton functions inlined into `decoder_layer_kernel`, not kernels.

Items (row m, KV head g, split s), at most one per program (rows * KV heads * splits <= P, so
item = program id). Before the barrier that ends the qkv phase, `attention_prologue` issues every
load of the item that needs no output of this layer: the row's metadata, its cos/sin, the first
KV tile of its chunk and the q/k norm's weights (one row: the attention phase 2.82 -> 2.56 us;
bench/history/2026-11-27.md); they land while the program waits. After it,
`attention_phase` normalizes (Qwen3) and rotates the GROUP query heads and the new key in
registers, with the roundings of rope._norm_rope_heads; split 0 stores the new K/V row into
the cache, and every split takes it from registers instead of the cache, so no barrier waits for
that store. Each split runs the online softmax (base 2) over its chunk of the row's context, in
tiles of ABN tokens; the chunk is an even share rounded up to whole tiles
(engine/kernels/split_kv.py's `split_chunk`). Every split writes its normalized output and
log-sum-exp (empty splits and rows of seq_len 0, graph padding, write zeros and -inf; padding
rows write no cache row), then counts itself done on its (row, KV head)'s counter; the last of
the row's splits to arrive merges them (`merge_last`) into the attention output, which o_proj
reads after the barrier. Merged once per (row, KV head), not by every o_proj item for the heads of
its K chunk as before (each merged 32 KB of partials that 31 others merged too; 0.6B, H100: one
row 2.5 %, four rows 7 % faster: bench/history/2026-11-27.md).
"""

from __future__ import annotations

import triton
import triton.language as tl

from engine.kernels.grid_barrier import stamp
from engine.kernels.grid_phases import rnd
from engine.kernels.split_kv import last_to_arrive, split_chunk


@triton.jit
def norm_weights(w_ptr, QK_NORM: tl.constexpr, HALF: tl.constexpr):
    # The q/k norm's weight halves [1, HALF] (QK_NORM; else placeholders norm_rope_w ignores).
    d = tl.arange(0, HALF)[None, :]
    if QK_NORM:
        return tl.load(w_ptr + d), tl.load(w_ptr + HALF + d)
    else:
        return d, d


@triton.jit
def norm_rope_w(x1, x2, w1, w2, cos, sin, eps, QK_NORM: tl.constexpr, HALF: tl.constexpr, DTYPE: tl.constexpr):
    # x1, x2 [R, HALF] fp32: the halves of R heads -> normed (Qwen3) by the weight halves w1, w2
    # [1, HALF] (norm_weights, loaded before any wait: they are the layer's) and rotated, in
    # DTYPE; the roundings of rope._norm_rope_heads.
    if QK_NORM:
        rstd = tl.math.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) * (1.0 / (2 * HALF)) + eps)[:, None]
        x1 = rnd(w1.to(tl.float32) * rnd(x1 * rstd, DTYPE), DTYPE)
        x2 = rnd(w2.to(tl.float32) * rnd(x2 * rstd, DTYPE), DTYPE)
    o1 = rnd(x1 * cos, DTYPE) - rnd(x2 * sin, DTYPE)
    o2 = rnd(x2 * cos, DTYPE) + rnd(x1 * sin, DTYPE)
    return o1.to(DTYPE), o2.to(DTYPE)


@triton.jit
def _kv_tile(k_cache_ptr, v_cache_ptr, bt_row, n0, end, cur, g, stride_cblk, stride_ctok, stride_chead,
             HALF: tl.constexpr, D: tl.constexpr, BLOCK_SIZE: tl.constexpr, ABN: tl.constexpr):
    # Cached K (two halves) and V rows of tokens n0..n0+ABN-1 below `end`, except the new one.
    offs_n = n0 + tl.arange(0, ABN)
    ok = (offs_n < end) & (offs_n != cur)
    page = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=ok, other=0).to(tl.int64)
    kv = (page * stride_cblk + (offs_n % BLOCK_SIZE) * stride_ctok + g * stride_chead)[:, None]
    d = tl.arange(0, HALF)[None, :]
    k1 = tl.load(k_cache_ptr + kv + d, mask=ok[:, None], other=0.0)
    k2 = tl.load(k_cache_ptr + kv + HALF + d, mask=ok[:, None], other=0.0)
    v = tl.load(v_cache_ptr + kv + tl.arange(0, D)[None, :], mask=ok[:, None], other=0.0)
    return k1, k2, v


@triton.jit
def _item(item, seq_lens_ptr, M, num_splits, NKV: tl.constexpr, ABN: tl.constexpr):
    # Attention item -> (row m, KV head g, split s, row's seq_len, the split's token range);
    # items past the last (m >= M) get seq_len 0 and an empty range.
    m = item // (NKV * num_splits)
    g = (item // num_splits) % NKV
    s = item % num_splits
    seq_len = tl.load(seq_lens_ptr + m, mask=m < M, other=0)
    chunk = split_chunk(seq_len, num_splits, ABN)
    start = s * chunk
    end = tl.minimum(start + chunk, seq_len)
    return m, g, s, seq_len, start, end


@triton.jit
def attention_prologue(
    pos_ptr, cos_sin_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, seq_lens_ptr, slot_ptr, qn_ptr, kn_ptr,
    M, num_splits, stride_cblk, stride_ctok, stride_chead, stride_bt,
    NKV: tl.constexpr, D: tl.constexpr, BLOCK_SIZE: tl.constexpr, ABN: tl.constexpr, DTYPE: tl.constexpr,
    QK_NORM: tl.constexpr,
):  # fmt: skip
    # This program's item and its loads that need nothing of this layer (module docstring).
    m, g, s, seq_len, start, end = _item(tl.program_id(0), seq_lens_ptr, M, num_splits, NKV, ABN)
    HALF: tl.constexpr = D // 2
    bt_row = bt_ptr + m.to(tl.int64) * stride_bt
    k1, k2, v = _kv_tile(k_cache_ptr, v_cache_ptr, bt_row, start, end, seq_len - 1, g, stride_cblk, stride_ctok,
                         stride_chead, HALF, D, BLOCK_SIZE, ABN)  # fmt: skip
    live = seq_len > 0  # a real row (m < M, not graph padding): programs without one load nothing
    pos = tl.load(pos_ptr + m, mask=live, other=0).to(tl.int64)
    d = tl.arange(0, HALF)[None, :]
    cos = rnd(tl.load(cos_sin_ptr + pos * D + d, mask=live, other=0.0), DTYPE)
    sin = rnd(tl.load(cos_sin_ptr + pos * D + HALF + d, mask=live, other=0.0), DTYPE)
    slot = tl.load(slot_ptr + m, mask=live, other=-1)
    qw1, qw2 = norm_weights(qn_ptr, QK_NORM, HALF)
    kw1, kw2 = norm_weights(kn_ptr, QK_NORM, HALF)
    return m, g, s, seq_len, start, end, k1, k2, v, cos, sin, slot, qw1, qw2, kw1, kw2


@triton.jit
def attention_phase(
    m, g, s, seq_len, start, end, k1, k2, v, cos, sin, slot, qw1, qw2, kw1, kw2,  # attention_prologue's
    qkv_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, part_o_ptr, part_lse_ptr,
    M, num_splits, eps, sm_scale_log2, stride_cblk, stride_ctok, stride_chead, stride_bt,
    NH: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr, QK_NORM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    ABN: tl.constexpr, DTYPE: tl.constexpr, t_ptr, TIMING: tl.constexpr,
    count_ptr, ao_ptr, GP: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    # count_ptr [M, NKV] int32 (zero between layers), ao_ptr [M, NH * D] DTYPE: merge_last's. GP:
    # GROUP rounded up to a power of two; BLOCK_S: at least num_splits.
    GROUP: tl.constexpr = NH // NKV
    BH: tl.constexpr = 16 if GROUP < 16 else GROUP  # tl.dot's smallest M
    HALF: tl.constexpr = D // 2
    QKV: tl.constexpr = (NH + 2 * NKV) * D
    hh = tl.arange(0, BH)
    h_ok = hh < GROUP
    d = tl.arange(0, HALF)[None, :]
    dd = tl.arange(0, D)[None, :]
    if m < M:
        heads = g * GROUP + hh
        m_i = tl.full([BH], float("-inf"), tl.float32)
        l_i = tl.zeros([BH], tl.float32)
        acc = tl.zeros([BH, D], tl.float32)
        if seq_len > 0:  # else graph padding: zeros, no cache write
            cur = seq_len - 1  # the new token: taken from registers, not the cache
            bt_row = bt_ptr + m.to(tl.int64) * stride_bt
            row = qkv_ptr + m * QKV
            qp = row + heads[:, None] * D + d
            kp = row + NH * D + g * D + d
            xq1 = tl.load(qp, mask=h_ok[:, None], other=0.0, cache_modifier=".cg").to(tl.float32)
            xq2 = tl.load(qp + HALF, mask=h_ok[:, None], other=0.0, cache_modifier=".cg").to(tl.float32)
            xk1 = tl.load(kp, cache_modifier=".cg").to(tl.float32)
            xk2 = tl.load(kp + HALF, cache_modifier=".cg").to(tl.float32)
            vc = tl.load(row + (NH + NKV) * D + g * D + dd, cache_modifier=".cg")  # [1, D]
            q1, q2 = norm_rope_w(xq1, xq2, qw1, qw2, cos, sin, eps, QK_NORM, HALF, DTYPE)
            k1c, k2c = norm_rope_w(xk1, xk2, kw1, kw2, cos, sin, eps, QK_NORM, HALF, DTYPE)
            stamp(t_ptr, 17, TIMING)
            if (s == 0) & (slot >= 0):
                dst = slot * stride_ctok + g * stride_chead
                tl.store(k_cache_ptr + dst + d, k1c)
                tl.store(k_cache_ptr + dst + HALF + d, k2c)
                tl.store(v_cache_ptr + dst + dd, vc)
            for n0 in range(start, end, ABN):
                if n0 != start:  # the first tile came with the prologue
                    k1, k2, v = _kv_tile(k_cache_ptr, v_cache_ptr, bt_row, n0, end, cur, g, stride_cblk,
                                         stride_ctok, stride_chead, HALF, D, BLOCK_SIZE, ABN)  # fmt: skip
                offs_n = n0 + tl.arange(0, ABN)
                is_cur = (offs_n == cur)[:, None]
                k1 = tl.where(is_cur, k1c, k1)
                k2 = tl.where(is_cur, k2c, k2)
                v = tl.where(is_cur, vc, v)
                stamp(t_ptr, 18, TIMING)
                sc = (tl.dot(q1, tl.trans(k1)) + tl.dot(q2, tl.trans(k2))) * sm_scale_log2
                sc = tl.where((offs_n < end)[None, :], sc, float("-inf"))
                stamp(t_ptr, 19, TIMING)
                m_new = tl.maximum(m_i, tl.max(sc, 1))
                alpha = tl.exp2(m_i - m_new)
                p = tl.exp2(sc - m_new[:, None])
                l_i = l_i * alpha + tl.sum(p, 1)
                stamp(t_ptr, 20, TIMING)
                acc = acc * alpha[:, None] + tl.dot(p.to(DTYPE), v)
                stamp(t_ptr, 21, TIMING)
                m_i = m_new
        # bench only (TIMING): inside the phase, q and k normed and rotated (17); in the loop's
        # last tile the tile ready (18), after q.k (19), the softmax (20) and p.v (21); after the
        # loop (14); after merge_last (15). (a profiler reads them per program).
        stamp(t_ptr, 14, TIMING)
        part = (m * NH + heads) * num_splits + s  # [BH]
        tl.store(part_o_ptr + part[:, None] * D + dd, acc / tl.where(l_i > 0, l_i, 1.0)[:, None], mask=h_ok[:, None])
        tl.store(part_lse_ptr + part, tl.where(l_i > 0, m_i + tl.log2(l_i), float("-inf")), mask=h_ok)
        merge_last(part_o_ptr, part_lse_ptr, count_ptr + m * NKV + g, ao_ptr + m * (NH * D) + g * GROUP * D,
                   (m * NH + g * GROUP) * num_splits, num_splits, GROUP, GP, D, BLOCK_S, DTYPE)  # fmt: skip
        stamp(t_ptr, 15, TIMING)  # bench only: counted, and merged if last


@triton.jit
def merge_last(
    part_o_ptr, part_lse_ptr, count_ptr, dst_ptr, base, num_splits,
    GROUP: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr, DTYPE: tl.constexpr,
):  # fmt: skip
    # Called by every split of a (row, KV head) once its partials are stored: the last of the
    # num_splits to arrive (split_kv.last_to_arrive, which zeroes the counter for the next layer)
    # merges them by their log-sum-exp into dst [GROUP * D] (DTYPE), the row's attention output of
    # the group's heads, partials read from L2 in one load (not split_kv.merge_splits' loop over
    # splits). base: index of the group's head 0, split 0 in the partials.
    if last_to_arrive(count_ptr, num_splits):
        j = tl.arange(0, GP)[:, None]
        r = tl.arange(0, BLOCK_S)[None, :]
        ok = (j < GROUP) & (r < num_splits)
        idx = base + j * num_splits + r  # [GP, BLOCK_S]
        dd = tl.arange(0, D)[None, :]
        lse = tl.load(part_lse_ptr + idx, mask=ok, other=float("-inf"), cache_modifier=".cg")
        po = tl.load(part_o_ptr + idx[:, :, None] * D + dd[None, :, :], mask=ok[:, :, None], other=0.0, cache_modifier=".cg")
        mx = tl.max(lse, 1)
        w = tl.exp2(lse - tl.where(mx == float("-inf"), 0.0, mx)[:, None])
        sw = tl.sum(w, 1)
        out = tl.sum(po * w[:, :, None], 1) / tl.where(sw > 0, sw, 1.0)[:, None]  # [GP, D]
        tl.store(dst_ptr + j * D + dd, out.to(DTYPE), mask=j < GROUP)
