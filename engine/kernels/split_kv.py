"""The pieces of a split-KV decode over the paged cache (layout: attention.py) that the
backend's decode kernel (attention_decode.py) and the batch decode's attention kernel
(engine/kernels/rope_decode.py, rope folded in) share: Triton functions inlined into those
kernels, not kernels.

A split is one contiguous chunk of one row's cached tokens for one KV head (`split_chunk`: an
even share rounded up to whole tiles, computed on the device from the row's seq_len). Its
program may pull the chunk's first K/V tile into L2 before its PDL wait (`prefetch_first_tile`),
runs the online softmax (base 2) over the chunk (`attend_tiles`), and writes either the output
itself (one split) or its normalized partial and log-sum-exp, which the last split of the row to
arrive merges (`write_split`, `merge_splits`). Graph-padding rows write zeros (`write_zeros`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from engine.kernels import pdl
from engine.kernels.attention import dot, kv_offsets

MERGE_SPLITS = 4  # partials a load of the in-kernel merge (merge_splits), unless a launch says otherwise


@triton.jit
def split_chunk(seq_len, num_splits, BLOCK_N: tl.constexpr):
    # Tokens per split for this row: an even share rounded up to whole tiles (0 when seq_len is 0).
    return tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N


@triton.jit
def prefetch_first_tile(
    k_cache_ptr, v_cache_ptr, bt_row_ptr, start, end, kv_head, stride_cblk, stride_ctok, stride_chead,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, LINE: tl.constexpr,
):  # fmt: skip
    # The K/V lines of tokens start..start+BLOCK_N-1 (below end) into L2, LINE elements a line:
    # what a PDL launch issues before its wait (a prefetch holds no value, so a row the kernel
    # before still writes cannot be read stale).
    first = start + tl.arange(0, BLOCK_N)
    first_off = kv_offsets(bt_row_ptr, first, first < end, kv_head, stride_cblk, stride_ctok, stride_chead, BLOCK_SIZE)
    lines = (tl.arange(0, HEAD_DIM // LINE) * LINE)[None, :]
    pdl.prefetch_l2(k_cache_ptr + first_off[:, None] + lines)
    pdl.prefetch_l2(v_cache_ptr + first_off[:, None] + lines)


@triton.jit
def tile_scores(
    q,  # [BLOCK_H, HEAD_DIM] in the cache's dtype
    k_cache_ptr, v_cache_ptr, bt_row_ptr, offs_n, n_mask, kv_head, sm_scale_log2, stride_cblk, stride_ctok,
    stride_chead, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    # One K/V tile of a sequence, its tokens offs_n [BLOCK_N] (n_mask: the ones loaded; the others
    # read as zeros): (s [BLOCK_H, BLOCK_N] = q . k * sm_scale_log2, v [BLOCK_N, HEAD_DIM]).
    offs_d = tl.arange(0, HEAD_DIM)
    kv_off = kv_offsets(bt_row_ptr, offs_n, n_mask, kv_head, stride_cblk, stride_ctok, stride_chead, BLOCK_SIZE)
    k = tl.load(k_cache_ptr + kv_off[:, None] + offs_d[None, :], mask=n_mask[:, None], other=0.0)
    v = tl.load(v_cache_ptr + kv_off[:, None] + offs_d[None, :], mask=n_mask[:, None], other=0.0)
    return dot(q, tl.trans(k), IEEE) * sm_scale_log2, v


@triton.jit
def softmax_step(m_i, l_i, acc, s, v, IEEE: tl.constexpr, DOT_SUM: tl.constexpr):
    # One tile of the online softmax (base 2): the state (m_i [BLOCK_H] running max, l_i [BLOCK_H]
    # sum of exp2, acc [BLOCK_H, D] unnormalized output) with the tile's scores s [BLOCK_H,
    # BLOCK_N] (-inf: masked keys) and values v [BLOCK_N, D]. DOT_SUM: a row's sum of p is an MMA
    # of the p that p @ v takes with ones [BLOCK_N, 16] (any of its 16 equal columns), an order
    # the instruction fixes, not the layout: kernels of other warp counts get the same bits;
    # else tl.sum over the layout's lanes and warps.
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    if DOT_SUM:
        row_sum = tl.max(dot(p.to(v.dtype), tl.full([s.shape[1], 16], 1.0, v.dtype), IEEE), 1)
    else:
        row_sum = tl.sum(p, 1)
    return m_new, l_i * alpha + row_sum, acc * alpha[:, None] + dot(p.to(v.dtype), v, IEEE)


@triton.jit
def attend_tiles(
    q,  # [BLOCK_H, HEAD_DIM] in the cache's dtype: one KV head's query heads
    k_cache_ptr, v_cache_ptr, bt_row_ptr, start, end, kv_head, sm_scale_log2, stride_cblk, stride_ctok, stride_chead,
    BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
    DOT_SUM: tl.constexpr,
):  # fmt: skip
    # The online softmax (base 2) of q over the cached tokens start..end-1 of one sequence, in
    # tiles of BLOCK_N (softmax_step's DOT_SUM): -> (m [BLOCK_H] running max, l [BLOCK_H] sum of
    # exp2, acc [BLOCK_H, D] unnormalized output); an empty range leaves (-inf, 0, 0).
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        s, v = tile_scores(q, k_cache_ptr, v_cache_ptr, bt_row_ptr, offs_n, n_mask, kv_head, sm_scale_log2,
                           stride_cblk, stride_ctok, stride_chead, HEAD_DIM, BLOCK_SIZE, IEEE)  # fmt: skip
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_i, l_i, acc = softmax_step(m_i, l_i, acc, s, v, IEEE, DOT_SUM)  # m finite: every tile holds a key
    return m_i, l_i, acc


@triton.jit
def write_zeros(out_ptrs, h_mask, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, USE_PDL: tl.constexpr):
    # A padding row's output (out_ptrs [BLOCK_H, HEAD_DIM]): zeros, written after the PDL wait
    # (no write before the kernel before, which may read out, has ended).
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    tl.store(out_ptrs, tl.zeros([BLOCK_H, HEAD_DIM], tl.float32).to(out_ptrs.dtype.element_ty), mask=h_mask[:, None])


@triton.jit
def write_split(
    m_i, l_i, acc,  # attend_tiles' result for this split
    out_ptrs,  # [BLOCK_H, HEAD_DIM] this KV head's query heads' output rows
    part_out_ptr, part_lse_ptr, count_ptr,  # as _decode_kernel's
    seq, kv_head, split, num_splits, num_valid, heads, h_mask,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, MERGE: tl.constexpr,
):  # fmt: skip
    # One split: the output itself (num_splits 1; seq_len 0 leaves l == 0 and acc == 0: zeros,
    # not NaN), else its normalized partial and log-sum-exp, merged here (MERGE > 0: that many
    # partials a load) by the last of the row's num_valid splits to arrive.
    if num_splits == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptrs, out.to(out_ptrs.dtype.element_ty), mask=h_mask[:, None])
    else:
        part = (seq * NUM_HEADS + heads) * num_splits + split  # [BLOCK_H]
        offs_d = tl.arange(0, HEAD_DIM)
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc / l_i[:, None], mask=h_mask[:, None])
        tl.store(part_lse_ptr + part, m_i + tl.log2(l_i), mask=h_mask)
        if MERGE > 0:
            merge_splits(
                part_out_ptr, part_lse_ptr, count_ptr + seq * tl.num_programs(1) + kv_head, out_ptrs,
                (seq * NUM_HEADS + heads) * num_splits, h_mask, num_valid, BLOCK_H, HEAD_DIM, MERGE,
            )  # fmt: skip


@triton.jit
def last_to_arrive(count_ptr, num):
    # This split counts itself done on count_ptr, after every thread's stores (CTA barrier, then
    # release); True for the last of `num` to arrive, which has acquired every split's stores and
    # zeroes the counter for the next use (every thread's loads after the acquire: CTA barrier).
    tl.debug_barrier()
    done = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu")
    last = done == num - 1
    if last:
        tl.debug_barrier()
        tl.store(count_ptr, 0)
    return last


@triton.jit
def merge_splits(
    part_out_ptr, part_lse_ptr, count_ptr,
    out_ptrs,  # [BLOCK_H, HEAD_DIM] this KV head's query heads' output rows
    base,  # [BLOCK_H] index of each head's split 0 in the partials
    h_mask, num_valid, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, PER_LOAD: tl.constexpr,
):  # fmt: skip
    # Called by every split after it stored its partial: the last of the num_valid splits to
    # arrive (last_to_arrive) merges them all into out, partials read from L2, PER_LOAD splits a
    # load ([BLOCK_H, PER_LOAD, HEAD_DIM]), rescaled by the running max between loads.
    # One split a load made the merge of one row at 32k tokens (49 splits) a quarter of its layer.
    # 16 a load is faster at 1-8 rows and 8k-32k tokens, but its registers (146 a thread) leave
    # the layers' DecodeAttention 3 programs an SM, not the 4 its one wave of 64 rows needs
    # (tests/test_bench_scripts.py; bench/history/2026-11-30.md, entry n).
    if last_to_arrive(count_ptr, num_valid):
        offs_d = tl.arange(0, HEAD_DIM)
        offs_s = tl.arange(0, PER_LOAD)
        m = tl.full([BLOCK_H], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
        for s0 in range(0, num_valid, PER_LOAD):
            idx = base[:, None] + s0 + offs_s[None, :]  # [BLOCK_H, PER_LOAD]
            ok = h_mask[:, None] & (s0 + offs_s < num_valid)[None, :]
            lse = tl.load(part_lse_ptr + idx, mask=ok, other=float("-inf"), cache_modifier=".cg")
            part = tl.load(part_out_ptr + idx[:, :, None] * HEAD_DIM + offs_d[None, None, :], mask=ok[:, :, None],
                           other=0.0, cache_modifier=".cg")  # fmt: skip
            m_new = tl.maximum(m, tl.max(lse, 1))  # -inf only in a masked head's row
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            scale = tl.exp2(m - m_safe)  # 0 on the first load
            w = tl.exp2(lse - m_safe[:, None])  # [BLOCK_H, PER_LOAD]; 0 where masked
            acc = acc * scale[:, None] + tl.sum(part * w[:, :, None], 1)
            total = total * scale + tl.sum(w, 1)
            m = m_new
        tl.store(out_ptrs, (acc / tl.where(total > 0, total, 1.0)[:, None]).to(out_ptrs.dtype.element_ty),
                 mask=h_mask[:, None])  # fmt: skip
