"""Triton functions the fixed-split attention's kernels (attention_fixed.py) inline, not kernels:
where a program's query rows are (`locate`: a token's sequence and context; `tile_rows`: a
prefill tile's tokens), their queries (`query_rows`), the online softmax of rows of their own
ends (`walk_rows`), one query's (`walk_pieces`: every piece in one loop over the tiles), the
pieces' merge (`merge_piece`) and the split path's item (`piece_item`: some of a query's pieces,
the last to arrive merging them all). The rules they keep are attention_fixed.py's; every function is
the same arithmetic for a row wherever it runs.
"""

from __future__ import annotations

import triton
import triton.language as tl

from engine.kernels.grid_barrier import stamp, stamp_landed
from engine.kernels.split_kv import attend_tiles, last_to_arrive, softmax_step, tile_scores


@triton.jit
def merge_piece(m, total, acc, m_s, l_s, acc_s):
    # The running (max, sum of exp2, unnormalized output) with one more piece's, in base 2.
    m_new = tl.maximum(m, m_s)
    a = tl.exp2(m - m_new)
    b = tl.exp2(m_s - m_new)
    return m_new, total * a + l_s * b, acc * a[:, None] + acc_s * b[:, None]


@triton.jit
def empty_state(BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr):
    # An online softmax's state before its first key: (max -inf, sum 0, acc 0 [BLOCK_H, HEAD_DIM]).
    return (tl.full([BLOCK_H], float("-inf"), tl.float32), tl.zeros([BLOCK_H], tl.float32),
            tl.zeros([BLOCK_H, HEAD_DIM], tl.float32))  # fmt: skip


@triton.jit
def reset_where(ends, m_s, l_s, acc_s):
    # The piece state, empty again where `ends` (a scalar: a piece ended on this tile).
    return tl.where(ends, float("-inf"), m_s), tl.where(ends, 0.0, l_s), tl.where(ends, 0.0, acc_s)


@triton.jit
def walk_pieces(
    q, k_cache_ptr, v_cache_ptr, bt_row, context, kv_head, sm_scale_log2, stride_cblk, stride_ctok, stride_chead,
    BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N_: tl.constexpr,
    SPLIT_: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    # Every piece of one query's context 0..context-1 merged in ascending order: attend_tiles
    # over each piece from a fresh state, then merge_piece, in one loop over the tiles (the loads
    # run on across a piece's end). A tile never crosses a piece (BLOCK_N_ divides SPLIT_); the
    # state a piece ends with is folded in, and the fresh one taken, by selects on the tile that
    # ends it: the ops and the values of the loop of pieces, so its bits.
    m, total, acc = empty_state(BLOCK_H, HEAD_DIM)  # the sum of the pieces folded in
    m_s, l_s, acc_s = empty_state(BLOCK_H, HEAD_DIM)  # the piece running
    for n0 in range(0, context, BLOCK_N_):
        offs_n = n0 + tl.arange(0, BLOCK_N_)
        n_mask = offs_n < context
        s, v = tile_scores(q, k_cache_ptr, v_cache_ptr, bt_row, offs_n, n_mask, kv_head, sm_scale_log2,
                           stride_cblk, stride_ctok, stride_chead, HEAD_DIM, BLOCK_SIZE, IEEE)  # fmt: skip
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_s, l_s, acc_s = softmax_step(m_s, l_s, acc_s, s, v, IEEE, True)
        ends = ((n0 + BLOCK_N_) % SPLIT_ == 0) | (n0 + BLOCK_N_ >= context)
        m_n, total_n, acc_n = merge_piece(m, total, acc, m_s, l_s, acc_s)
        m = tl.where(ends, m_n, m)
        total = tl.where(ends, total_n, total)
        acc = tl.where(ends, acc_n, acc)
        m_s, l_s, acc_s = reset_where(ends, m_s, l_s, acc_s)
    return m, total, acc


@triton.jit
def locate(t, qsl_ptr, seq_lens_ptr, num_seqs, SEARCH: tl.constexpr, ONE_EACH: tl.constexpr):
    # Token t's sequence (the least i with query_start_loc[i + 1] > t; past the last sequence:
    # the last, and not live), and its context length (its position + 1; 0 when not live).
    # ONE_EACH (as many tokens as sequences, one each): sequence t, no search.
    if ONE_EACH:
        seq_len = tl.load(seq_lens_ptr + t)
        return t, seq_len > 0, seq_len
    lo = t * 0
    hi = t * 0 + num_seqs - 1
    for _ in tl.static_range(SEARCH):
        mid = (lo + hi) // 2
        right = tl.load(qsl_ptr + mid + 1) <= t
        lo = tl.where(right, mid + 1, lo)
        hi = tl.where(right, hi, mid)
    seq = tl.minimum(lo, num_seqs - 1)
    pos = tl.load(seq_lens_ptr + seq) - (tl.load(qsl_ptr + seq + 1) - t)  # -1 or less: padding
    live = (t < tl.load(qsl_ptr + num_seqs)) & (pos >= 0)
    return seq, live, tl.where(live, pos + 1, 0)


@triton.jit
def query_rows(q_ptr, t, g, live, stride_qt, stride_qh, GROUP: tl.constexpr, BLOCK_H: tl.constexpr,
               HEAD_DIM: tl.constexpr):  # fmt: skip
    # KV head g's GROUP query heads of token t as the rows of one [BLOCK_H, HEAD_DIM] tile (zeros
    # where not live): (heads [BLOCK_H], their mask, offs_d [HEAD_DIM], q).
    heads = g * GROUP + tl.arange(0, BLOCK_H)
    h_mask = tl.arange(0, BLOCK_H) < GROUP
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + t.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=h_mask[:, None] & live, other=0.0)  # fmt: skip
    return heads, h_mask, offs_d, q


@triton.jit
def tile_rows(pid, qsl_ptr, seq_lens_ptr, num_seqs, tokens, TOK: tl.constexpr, GROUP: tl.constexpr,
              BLOCK_H: tl.constexpr, SEARCH: tl.constexpr):  # fmt: skip
    # Program pid's tile: up to TOK consecutive query tokens of one sequence, row r holding token
    # r // GROUP's query head r % GROUP. Sequence s's tiles are numbered from
    # query_start_loc[s] // TOK + s (enough for its tokens at any alignment); the numbers past the
    # last sequence's take the padding rows after it. -> (seq, token [BLOCK_H] int64, head in
    # the group [BLOCK_H], rows written [BLOCK_H], context [BLOCK_H]: position + 1, 0 if not live).
    lo = pid * 0
    hi = lo + num_seqs
    for _ in tl.static_range(SEARCH):
        mid = (lo + hi + 1) // 2
        ok = tl.load(qsl_ptr + mid) // TOK + mid <= pid
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    seq = lo
    is_seq = seq < num_seqs
    first = tl.load(qsl_ptr + seq)
    last = tl.where(is_seq, tl.load(qsl_ptr + seq + 1, mask=is_seq, other=0), tokens)  # one past its tokens
    r = tl.arange(0, BLOCK_H)
    t = first + (pid - first // TOK - seq) * TOK + r // GROUP
    mine = (r < TOK * GROUP) & (t < last)
    pos = tl.load(seq_lens_ptr + seq, mask=is_seq, other=0) - (last - t)  # -1 or less: padding
    live = mine & is_seq & (pos >= 0)
    return seq, t.to(tl.int64), r % GROUP, mine, tl.where(live, pos + 1, 0)


@triton.jit
def walk_rows(
    q, k_cache_ptr, v_cache_ptr, bt_row, context, reach, kv_head, sm_scale_log2, stride_cblk, stride_ctok,
    stride_chead, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N_: tl.constexpr,
    SPLIT_: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    # walk_pieces for rows of their own contexts (context [BLOCK_H], reach their largest), as a
    # prefill tile's: the tiles run to reach, and row r's state changes only on the tiles that hold
    # one of its keys, by walk_pieces' step for a query of context[r] (a piece folded in where it
    # starts below context[r]), so its bits are those of a program of its own. A row's masked
    # keys still below reach hold its sequence's K/V (finite; p is 0).
    m, total, acc = empty_state(BLOCK_H, HEAD_DIM)  # the sum of the pieces folded in
    m_s, l_s, acc_s = empty_state(BLOCK_H, HEAD_DIM)  # the piece running
    for n0 in range(0, reach, BLOCK_N_):
        offs_n = n0 + tl.arange(0, BLOCK_N_)
        s, v = tile_scores(q, k_cache_ptr, v_cache_ptr, bt_row, offs_n, offs_n < reach, kv_head, sm_scale_log2,
                           stride_cblk, stride_ctok, stride_chead, HEAD_DIM, BLOCK_SIZE, IEEE)  # fmt: skip
        s = tl.where(offs_n[None, :] < context[:, None], s, float("-inf"))
        m_n, l_n, acc_n = softmax_step(m_s, l_s, acc_s, s, v, IEEE, True)  # NaN only on a row the tile skips
        on = n0 < context
        m_s = tl.where(on, m_n, m_s)
        l_s = tl.where(on, l_n, l_s)
        acc_s = tl.where(on[:, None], acc_n, acc_s)
        ends = ((n0 + BLOCK_N_) % SPLIT_ == 0) | (n0 + BLOCK_N_ >= reach)
        fold = ends & ((n0 // SPLIT_) * SPLIT_ < context)  # [BLOCK_H]: the rows the piece reached
        m_f, total_f, acc_f = merge_piece(m, total, acc, m_s, l_s, acc_s)
        m = tl.where(fold, m_f, m)
        total = tl.where(fold, total_f, total)
        acc = tl.where(fold[:, None], acc_f, acc)
        m_s, l_s, acc_s = reset_where(ends, m_s, l_s, acc_s)
    return m, total, acc


@triton.jit
def piece_item(
    t, g, slot, slots, seq, live, context, q_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, ws_m_ptr, ws_l_ptr, ws_acc_ptr,
    count_ptr, out_ptr, stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, stride_cblk, stride_ctok, stride_chead,
    sm_scale_log2, pieces,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N_: tl.constexpr, SPLIT_: tl.constexpr, IEEE: tl.constexpr,
    t_ptr=None, TIMING: tl.constexpr = False,
):  # fmt: skip
    # Item (t, g, slot) of `slots` for (token t, KV head g), t located by the caller (`locate`:
    # its sequence, whether it is live, its context): the token's pieces slot, slot + slots,
    # ... each from a fresh state into the workspace's rows (t, piece, head); the last of the
    # `slots` items of (t, g) to arrive merges every piece in ascending order into out (workspace
    # loads past L1: other programs' stores). The split path's program (attention_fixed.py
    # `_piece_kernel`), and a phase of the mode's persistent decode kernel (batch_kernel.py ATTEND).
    heads, h_mask, offs_d, q = query_rows(q_ptr, t, g, live, stride_qt, stride_qh, GROUP, BLOCK_H, HEAD_DIM)
    stamp_landed(t_ptr, 20, q, TIMING)  # bench only (grid_barrier.py): q landed
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    for p in range(slot, tl.cdiv(context, SPLIT_), slots):
        start = p * SPLIT_
        end = tl.minimum(start + SPLIT_, context)
        m_s, l_s, acc_s = attend_tiles(q, k_cache_ptr, v_cache_ptr, bt_row, start, end, g, sm_scale_log2,
                                       stride_cblk, stride_ctok, stride_chead, BLOCK_H, HEAD_DIM, BLOCK_SIZE,
                                       BLOCK_N_, IEEE, True)  # fmt: skip
        stamp_landed(t_ptr, 21, acc_s, TIMING)  # the piece's tiles done
        rows = (t.to(tl.int64) * pieces + p) * NUM_HEADS + heads  # [BLOCK_H]
        tl.store(ws_m_ptr + rows, m_s, mask=h_mask)
        tl.store(ws_l_ptr + rows, l_s, mask=h_mask)
        tl.store(ws_acc_ptr + rows[:, None] * HEAD_DIM + offs_d[None, :], acc_s, mask=h_mask[:, None])
    stamp(t_ptr, 18, TIMING)  # its pieces stored
    if last_to_arrive(count_ptr + t * NUM_HEADS + g, slots):
        stamp(t_ptr, 19, TIMING)  # the last of (t, g) to arrive, merging
        m = tl.full([BLOCK_H], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
        for p in range(0, tl.cdiv(context, SPLIT_)):
            rows = (t.to(tl.int64) * pieces + p) * NUM_HEADS + heads
            m_s = tl.load(ws_m_ptr + rows, mask=h_mask, other=0.0, cache_modifier=".cg")
            l_s = tl.load(ws_l_ptr + rows, mask=h_mask, other=0.0, cache_modifier=".cg")
            acc_s = tl.load(ws_acc_ptr + rows[:, None] * HEAD_DIM + offs_d[None, :], mask=h_mask[:, None], other=0.0,
                            cache_modifier=".cg")  # fmt: skip
            m, total, acc = merge_piece(m, total, acc, m_s, l_s, acc_s)
        result = acc / tl.where(total > 0, total, 1.0)[:, None]
        out_ptrs = out_ptr + t.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(out_ptrs, result.to(out_ptr.dtype.element_ty), mask=h_mask[:, None])
