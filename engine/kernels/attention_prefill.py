"""The Triton prefill kernel over the paged cache (layout: attention.py), and its launcher.

`_prefill_kernel`: grid (cdiv(max_query_len, BLOCK_M), sequences, H); one program attends BLOCK_M
queries of one sequence and one head over that sequence's keys, causally with the offset of the
cached prefix (context = seq_len - q_len). Eager only: its grid uses the host's max_query_len. In
a mixed step (`skip_single`) it leaves sequences of one query to the split-KV decode kernel
(attention_decode.py), which reads each KV head once for its GROUP query heads, and its grid spans
only the sequences from the first to the last with more than one (`seqs`). Over all sequences,
64 decodes beside a chunk made 4096 programs that returned at once; profiled on an H100, the
kernel then took 28.7 us a layer beside the decodes against 16.5 for the chunk alone.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.attention import LOG2E, dot, kv_offsets
from engine.kernels.launcher import Launcher


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
    kv_off = kv_offsets(bt_row_ptr, offs_n, n_mask, kv_head, stride_cblk, stride_ctok, stride_chead, BLOCK_SIZE)
    if MASKED:
        k = tl.load(k_cache_ptr + kv_off[:, None] + offs_d[None, :], mask=n_mask[:, None], other=0.0)
    else:
        k = tl.load(k_cache_ptr + kv_off[:, None] + offs_d[None, :])
    s = dot(q, tl.trans(k), IEEE) * sm_scale_log2  # [BLOCK_M, BLOCK_N]
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
    acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, IEEE)
    return m_new, l_i, acc


@Launcher
@triton.jit(do_not_specialize=["stride_bt", "skip_single", "first_seq"])
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
    first_seq,  # the grid's sequence 0 is this one (the first with more than one query in a mixed step)
    GROUP: tl.constexpr,  # H // Hkv
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    m_block = tl.program_id(0)
    seq = first_seq + tl.program_id(1)
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
    seqs: tuple[int, int] | None = None,  # (first, end): attend only these sequences (default: all)
) -> None:
    num_heads, head_dim = q.shape[1], q.shape[2]
    first, end = seqs if seqs is not None else (0, seq_lens.shape[0])
    if end <= first or max_query_len == 0:
        return
    block_m, block_n, num_warps, num_stages = config or _prefill_config(head_dim, k_cache.element_size())
    grid = (triton.cdiv(max_query_len, block_m), end - first, num_heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out,
        scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0), int(skip_single), first,
        GROUP=num_heads // k_cache.shape[2], HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_M=block_m, BLOCK_N=block_n, IEEE=k_cache.dtype == torch.float32,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
