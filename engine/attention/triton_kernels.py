"""Triton kernels for paged attention, and thin launchers. Only `engine.attention.triton` imports
this module, so a CPU install never imports Triton.

Cache of one layer: K and V each `[num_blocks, block_size, Hkv, D]`, contiguous; token j of a
sequence lives in block `block_table[j // block_size]`, row `j % block_size`. Query head h reads KV
head `h // (H // Hkv)` (GQA). Softmax runs in fp32 in base 2 (`exp2`, scores times scale*log2(e));
partial results carry their log-sum-exp in that base too.

Kernels:
- `_store_kv_kernel`: grid (T,); one program copies one token's K and V rows (all KV heads) into
  the cache at `slot_mapping[t]`, skipping slot -1.
- `_prefill_kernel`: grid (cdiv(max_query_len, BLOCK_M), B, H); one program attends BLOCK_M
  queries of one sequence and one head over that sequence's keys, causally with the offset of the
  cached prefix (context = seq_len - q_len). Eager only: its grid uses the host's max_query_len.
- `_decode_kernel` + `_decode_reduce_kernel`: split-KV decode (one query per sequence). Grid
  (B, Hkv, S): one program handles all H/Hkv query heads of one KV head, so each K/V tile is loaded
  once per KV head, over one contiguous chunk of the sequence. S (splits) is fixed by the batch size
  alone (the launcher's caller picks it), the chunk length is computed on the device from the
  row's seq_len, so grid and workspace are static and the pair is CUDA-graph capturable. Splits
  past the row's end exit at once. With S == 1 the decode kernel writes the output directly and
  no reduce runs. Rows with seq_len 0 (graph padding) output zeros.

Compiled variants: Triton specializes a kernel on each integer argument (== 1, divisible by 16)
and on each pointer's 16-byte alignment. The block-table row stride follows the widest table of
the batch and the decode split count the batch size, so neither is specialized
(`do_not_specialize`); the reduce merges any count of splits BLOCK_S at a time, not in one block
sized by the batch (mixed steps of two or three sequences, which no decode graph runs, compiled
new blocks while serving: 250-290 ms online p99 TTFT, bench/RESULTS.md, eighteenth session); and
the step's uploads start every
tensor 16-byte aligned (engine/runner/step_inputs.py): one variant per kernel and model serves every
batch, compiled at startup, never while a request waits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine import pdl
from engine.launcher import Launcher

_LOG2E = 1.4426950408889634
_REDUCE_BLOCK_S = 16  # splits the decode reduce merges per iteration


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


# ---- shared helpers -----------------------------------------------------------------------------


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    # IEEE: full fp32 products (fp32 inputs); otherwise the tensor cores' native precision.
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _kv_offsets(
    bt_row_ptr,  # block table row of this sequence: [max_blocks] int32
    offs_n,  # [BLOCK_N] token indices in the sequence
    n_mask,  # [BLOCK_N] which of them exist
    kv_head,
    stride_cblk,
    stride_ctok,
    stride_chead,
    BLOCK_SIZE: tl.constexpr,
):  # -> [BLOCK_N] int64 element offsets of each token's row for this KV head
    page = tl.load(bt_row_ptr + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
    return page * stride_cblk + (offs_n % BLOCK_SIZE) * stride_ctok + kv_head * stride_chead


# ---- store --------------------------------------------------------------------------------------


@Launcher
@triton.jit
def _store_kv_kernel(
    k_ptr,  # [T, Hkv, D] new keys (last dim contiguous)
    v_ptr,  # [T, Hkv, D] new values
    k_cache_ptr,  # [num_blocks * block_size, Hkv, D]
    v_cache_ptr,
    slot_ptr,  # [T] int64; -1 = write nothing
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cslot,
    stride_chead,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_HKV: tl.constexpr,  # next power of two >= NUM_KV_HEADS
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot < 0:
        return
    h = tl.arange(0, BLOCK_HKV)[:, None]
    d = tl.arange(0, HEAD_DIM)[None, :]
    mask = h < NUM_KV_HEADS
    t64 = t.to(tl.int64)
    k = tl.load(k_ptr + t64 * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + t64 * stride_vt + h * stride_vh + d, mask=mask)
    dst = slot * stride_cslot + h * stride_chead + d
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D] contiguous
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64
) -> None:
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_HKV=_next_pow2(num_kv_heads),
        num_warps=1 if num_kv_heads * head_dim <= 512 else 4,
    )  # fmt: skip


# ---- prefill ------------------------------------------------------------------------------------


@triton.jit
def _prefill_tile(
    q, m_i, l_i, acc,  # running state: q [BLOCK_M, D], m/l [BLOCK_M] fp32, acc [BLOCK_M, D] fp32
    k_cache_ptr, v_cache_ptr, bt_row_ptr, kv_head, n0, q_pos, kv_end, sm_scale_log2,
    stride_cblk, stride_ctok, stride_chead,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    n_mask = offs_n < kv_end
    kv_off = _kv_offsets(bt_row_ptr, offs_n, n_mask, kv_head, stride_cblk, stride_ctok, stride_chead, BLOCK_SIZE)
    if MASKED:
        k = tl.load(k_cache_ptr + kv_off[:, None] + offs_d[None, :], mask=n_mask[:, None], other=0.0)
    else:
        k = tl.load(k_cache_ptr + kv_off[:, None] + offs_d[None, :])
    s = _dot(q, tl.trans(k), IEEE) * sm_scale_log2  # [BLOCK_M, BLOCK_N]
    if MASKED:  # causal with the prefix offset; keys past kv_end are padding
        keep = (offs_n[None, :] <= q_pos[:, None]) & n_mask[None, :]
        s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if MASKED:
        v = tl.load(v_cache_ptr + kv_off[:, None] + offs_d[None, :], mask=n_mask[:, None], other=0.0)
    else:
        v = tl.load(v_cache_ptr + kv_off[:, None] + offs_d[None, :])
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
    return m_new, l_i, acc


@Launcher
@triton.jit(do_not_specialize=["stride_bt", "skip_single"])
def _prefill_kernel(
    q_ptr,  # [T, H, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,
    block_tables_ptr,  # [B, max_blocks] int32
    seq_lens_ptr,  # [B] int32
    query_start_loc_ptr,  # [B + 1] int32
    out_ptr,  # [T, H, D]
    sm_scale_log2,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cblk, stride_ctok, stride_chead, stride_bt,
    skip_single,  # 1: sequences of one query are the decode kernel's (a mixed step); a runtime flag, one variant
    GROUP: tl.constexpr,  # H // Hkv
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    m_block = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if m_block * BLOCK_M >= q_len:
        return
    if skip_single != 0:
        if q_len == 1:
            return
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len  # cached tokens before this step's first query
    kv_head = head // GROUP
    bt_row_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    m_mask = offs_m < q_len
    rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :], mask=m_mask[:, None], other=0.0)
    q = q.to(k_cache_ptr.dtype.element_ty)
    q_pos = context + offs_m  # absolute position of each query: it sees keys 0..q_pos

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    # Tiles wholly at or before the first query's position need no mask; the rest are masked.
    first_pos = context + m_block * BLOCK_M
    full_end = (first_pos + 1) // BLOCK_N * BLOCK_N
    kv_end = tl.minimum(seq_len, first_pos + BLOCK_M)
    for n0 in range(0, full_end, BLOCK_N):
        m_i, l_i, acc = _prefill_tile(
            q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, bt_row_ptr, kv_head, n0, q_pos, kv_end,
            sm_scale_log2, stride_cblk, stride_ctok, stride_chead,
            HEAD_DIM, BLOCK_SIZE, BLOCK_N, False, IEEE,
        )  # fmt: skip
    for n0 in range(full_end, kv_end, BLOCK_N):
        m_i, l_i, acc = _prefill_tile(
            q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, bt_row_ptr, kv_head, n0, q_pos, kv_end,
            sm_scale_log2, stride_cblk, stride_ctok, stride_chead,
            HEAD_DIM, BLOCK_SIZE, BLOCK_N, True, IEEE,
        )  # fmt: skip
    out = acc / l_i[:, None]
    tl.store(
        out_ptr + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None],
    )


def _prefill_config(head_dim: int, elem_bytes: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages), sized so K/V tiles fit shared memory."""
    if elem_bytes >= 4:
        return (32, 32, 4, 2) if head_dim > 128 else (64, 32, 4, 2)
    if head_dim > 128:
        return 64, 32, 4, 2
    return 128, 64, 8, 2


def prefill_attention(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32
    query_start_loc: torch.Tensor,  # [B + 1] int32
    out: torch.Tensor,  # [T, H, D], written for rows inside a sequence only
    scale: float,
    max_query_len: int,  # host value: sizes the grid
    config: tuple[int, int, int, int] | None = None,  # (BLOCK_M, BLOCK_N, warps, stages) override
    skip_single: bool = False,  # leave sequences of one query to decode_attention(query_start_loc=...)
) -> None:
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_seqs = seq_lens.shape[0]
    if num_seqs == 0 or max_query_len == 0:
        return
    block_m, block_n, num_warps, num_stages = config or _prefill_config(head_dim, k_cache.element_size())
    grid = (triton.cdiv(max_query_len, block_m), num_seqs, num_heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out,
        scale * _LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0), int(skip_single),
        GROUP=num_heads // k_cache.shape[2], HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_M=block_m, BLOCK_N=block_n, IEEE=k_cache.dtype == torch.float32,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip


# ---- decode -------------------------------------------------------------------------------------


@triton.jit
def split_chunk(seq_len, num_splits, BLOCK_N: tl.constexpr):
    # Tokens per split for this row: an even share rounded up to whole tiles (0 when seq_len is 0).
    return tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N


@Launcher
@triton.jit(do_not_specialize=["num_splits", "stride_bt", "mixed"])
def _decode_kernel(
    q_ptr,  # [B, H, D]: one query per sequence
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,
    block_tables_ptr,  # [B, max_blocks] int32
    seq_lens_ptr,  # [B] int32; 0 = padding row
    out_ptr,  # [B, H, D]: written here when num_splits == 1
    part_out_ptr,  # [B, H, num_splits, D] fp32: each split's normalized output
    part_lse_ptr,  # [B, H, num_splits] fp32: each split's log2-sum-exp2 of scaled scores
    sm_scale_log2,
    num_splits,
    stride_qb, stride_qh, stride_ob, stride_oh,
    stride_cblk, stride_ctok, stride_chead, stride_bt,
    qsl_ptr,  # [B + 1] int32, read when mixed: sequence seq's query is token row qsl[seq], if it has one
    mixed,  # 1: a mixed step (decode_attention's query_start_loc); a runtime flag, one variant
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,  # >= GROUP and >= 16 (tl.dot's smallest M)
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
    USE_PDL: tl.constexpr = False, LINE: tl.constexpr = 64,
):  # fmt: skip
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    row = seq
    if mixed != 0:
        row = tl.load(qsl_ptr + seq)
        if tl.load(qsl_ptr + seq + 1) - row != 1:  # a prefill chunk: the prefill kernel's
            return
    seq_len = tl.load(seq_lens_ptr + seq)
    chunk = split_chunk(seq_len, num_splits, BLOCK_N)
    start = split * chunk
    end = tl.minimum(start + chunk, seq_len)
    if num_splits > 1:
        if start >= end:  # past this row's end (or a padding row): the reduce skips this split
            return

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    h_mask = offs_h < GROUP
    heads = kv_head * GROUP + offs_h
    bt_row_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    if USE_PDL:
        # engine/pdl.py: launched while the kernel that writes q and the new K/V row still runs.
        # The metadata is the step's upload; the first tile's K/V lines go to L2 (a prefetch
        # holds no value, so the new row's line cannot be stale); then wait.
        first = start + tl.arange(0, BLOCK_N)
        first_off = _kv_offsets(bt_row_ptr, first, first < end, kv_head, stride_cblk, stride_ctok, stride_chead, BLOCK_SIZE)
        lines = (tl.arange(0, HEAD_DIM // LINE) * LINE)[None, :]
        pdl.prefetch_l2(k_cache_ptr + first_off[:, None] + lines)
        pdl.prefetch_l2(v_cache_ptr + first_off[:, None] + lines)
        tl.extra.cuda.gdc_wait()
    q = tl.load(
        q_ptr + row * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=h_mask[:, None], other=0.0
    ).to(k_cache_ptr.dtype.element_ty)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        kv_off = _kv_offsets(bt_row_ptr, offs_n, n_mask, kv_head, stride_cblk, stride_ctok, stride_chead, BLOCK_SIZE)
        k = tl.load(k_cache_ptr + kv_off[:, None] + offs_d[None, :], mask=n_mask[:, None], other=0.0)
        v = tl.load(v_cache_ptr + kv_off[:, None] + offs_d[None, :], mask=n_mask[:, None], other=0.0)
        s = _dot(q, tl.trans(k), IEEE) * sm_scale_log2  # [BLOCK_H, BLOCK_N]
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every tile holds at least one key
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
        m_i = m_new

    if num_splits == 1:
        # seq_len 0 leaves l_i == 0 and acc == 0: output zeros, not NaN.
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + row * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=h_mask[:, None],
        )
    else:
        part = (seq * NUM_HEADS + heads) * num_splits + split  # [BLOCK_H]
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc / l_i[:, None], mask=h_mask[:, None])
        tl.store(part_lse_ptr + part, m_i + tl.log2(l_i), mask=h_mask)


@Launcher
@triton.jit(do_not_specialize=["num_splits", "mixed"])
def _decode_reduce_kernel(
    part_out_ptr,  # [B, H, num_splits, D] fp32
    part_lse_ptr,  # [B, H, num_splits] fp32
    seq_lens_ptr,  # [B] int32
    out_ptr,  # [B, H, D]
    num_splits,
    stride_ob, stride_oh,
    qsl_ptr, mixed,  # as _decode_kernel's
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr,  # splits merged per iteration (any count of splits: one variant)
):  # fmt: skip
    seq = tl.program_id(0)
    head = tl.program_id(1)
    row = seq
    if mixed != 0:
        row = tl.load(qsl_ptr + seq)
        if tl.load(qsl_ptr + seq + 1) - row != 1:
            return
    seq_len = tl.load(seq_lens_ptr + seq)
    chunk = split_chunk(seq_len, num_splits, BLOCK_N)
    num_valid = tl.cdiv(seq_len, tl.maximum(chunk, 1))  # splits that wrote a partial; 0 for padding
    offs_d = tl.arange(0, HEAD_DIM)
    base = (seq * NUM_HEADS + head) * num_splits
    # Online merge over BLOCK_S splits at a time, base 2: m the running max lse, total the sum of
    # exp2(lse - m), acc the weighted partial outputs (one iteration: the plain weighted mean).
    m = tl.full([], float("-inf"), tl.float32)
    total = tl.zeros([], tl.float32)
    acc = tl.zeros([HEAD_DIM], tl.float32)
    for s0 in range(0, num_valid, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        s_mask = offs_s < num_valid
        lse = tl.load(part_lse_ptr + base + offs_s, mask=s_mask, other=float("-inf"))
        m_new = tl.maximum(m, tl.max(lse, 0))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # no -inf - -inf
        scale = tl.exp2(m - m_ref)  # 0 on the first iteration
        w = tl.exp2(lse - m_ref)  # [BLOCK_S], 0 for missing splits
        part = tl.load(part_out_ptr + (base + offs_s)[:, None] * HEAD_DIM + offs_d[None, :], mask=s_mask[:, None], other=0.0)
        acc = acc * scale + tl.sum(w[:, None] * part, 0)
        total = total * scale + tl.sum(w, 0)
        m = m_new
    out = acc / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + row * stride_ob + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty))


@Launcher
@triton.jit(do_not_specialize=["n", "width", "stride_src"])
def _graph_metadata_kernel(
    src_bt_ptr, src_len_ptr, src_slot_ptr,  # a decode step's n rows: [n, width] int32, [n] int32, [n] int64
    dst_bt_ptr, dst_len_ptr, dst_slot_ptr,  # a graph's static buffers: [bs, max_blocks], [bs], [bs]
    n, width, stride_src, stride_dst, BLOCK: tl.constexpr,
):  # fmt: skip
    # Program r: row r of the step into the static buffers; rows r >= n become padding (seq_len 0,
    # slot -1, table untouched: never read past seq_len).
    r = tl.program_id(0)
    live = r < n
    tl.store(dst_len_ptr + r, tl.load(src_len_ptr + r, mask=live, other=0))
    tl.store(dst_slot_ptr + r, tl.load(src_slot_ptr + r, mask=live, other=-1))
    if live:
        for c0 in range(0, width, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            ok = cols < width
            row = tl.load(src_bt_ptr + r.to(tl.int64) * stride_src + cols, mask=ok)
            tl.store(dst_bt_ptr + r.to(tl.int64) * stride_dst + cols, row, mask=ok)


def load_graph_metadata(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, slot_mapping: torch.Tensor,  # the step's n rows
    static_tables: torch.Tensor, static_lens: torch.Tensor, static_slots: torch.Tensor,  # the graph's bs rows
) -> None:
    """A decode step into a graph's static metadata, padding rows included: one launch."""
    n, width = block_tables.shape
    _graph_metadata_kernel[(static_lens.shape[0],)](
        block_tables, seq_lens, slot_mapping, static_tables, static_lens, static_slots,
        n, width, block_tables.stride(0), static_tables.stride(0), BLOCK=256, num_warps=1,
    )  # fmt: skip


def decode_config(head_dim: int, elem_bytes: int) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) of the decode kernel."""
    row_bytes = head_dim * elem_bytes  # one K row
    block_n = 64 if row_bytes <= 256 else 32
    return block_n, 4, 3 if block_n * row_bytes <= 16384 else 2


def decode_attention(
    q: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32
    out: torch.Tensor,  # [B, H, D]
    scale: float,
    num_splits: int,  # static per batch size
    part_out: torch.Tensor,  # fp32, at least B * H * num_splits * D elements (unused if 1 split)
    part_lse: torch.Tensor,  # fp32, at least B * H * num_splits elements
    config: tuple[int, int, int] | None = None,  # (BLOCK_N, num_warps, num_stages) override
    pdl_launch: bool = False,  # engine/pdl.py: the kernel before writes q and the new K/V rows
    query_start_loc: torch.Tensor | None = None,  # [B + 1] int32: mixed step (see below)
) -> None:
    """Split-KV decode of B sequences, q [B, H, D] and out row i sequence i's. With
    `query_start_loc` (a mixed step): q and out are the step's [T, H, D] token rows, and only the
    sequences of exactly one new token are attended, at their row; the others are left to
    prefill_attention(skip_single=True)."""
    batch = seq_lens.shape[0] if query_start_loc is not None else q.shape[0]
    num_heads, head_dim = q.shape[1], q.shape[2]
    if batch == 0:
        return
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    block_n, num_warps, num_stages = config or decode_config(head_dim, k_cache.element_size())
    mixed = int(query_start_loc is not None)
    qsl = query_start_loc if query_start_loc is not None else seq_lens  # unread unless mixed
    _decode_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, part_out, part_lse,
        scale * _LOG2E, num_splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0), qsl, mixed,
        NUM_HEADS=num_heads, GROUP=group, BLOCK_H=max(16, _next_pow2(group)),
        HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1], BLOCK_N=block_n,
        IEEE=k_cache.dtype == torch.float32, USE_PDL=pdl_launch, LINE=128 // k_cache.element_size(),
        num_warps=num_warps, num_stages=num_stages, launch_pdl=pdl_launch,
    )  # fmt: skip
    if num_splits > 1:
        _decode_reduce_kernel[(batch, num_heads)](
            part_out, part_lse, seq_lens, out, num_splits, out.stride(0), out.stride(1), qsl, mixed,
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_N=block_n, BLOCK_S=_REDUCE_BLOCK_S,
            num_warps=4 if head_dim * _REDUCE_BLOCK_S >= 4096 else 1,
        )  # fmt: skip
