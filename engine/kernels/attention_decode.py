"""The Triton split-KV decode over the paged cache (layout: attention.py), and its launcher.

`_decode_kernel` + `_decode_reduce_kernel`: split-KV decode (one query per sequence). Grid
(B, Hkv, S): one program handles all H/Hkv query heads of one KV head, so each K/V tile is loaded
once per KV head, over one contiguous chunk of the sequence. S (splits) is fixed by the batch size
alone (the launcher's caller picks it), the chunk length is computed on the device from the
row's seq_len, so grid and workspace are static and the pair is CUDA-graph capturable. Splits
past the row's end exit at once. With S == 1 the decode kernel writes the output directly and
no reduce runs. Rows with seq_len 0 (graph padding) output zeros. In a mixed step both read the
step's query_start_loc and attend only sequences of exactly one new token, at their token rows.

With `counts` (MERGE), the kernel merges its own splits and no reduce runs: each split stores its
partial, then adds one to its (row, KV head) counter; the split that brings it to the row's count
of splits merges them (`merge_splits`) and zeroes the counter for the next launch.

The tile loop, the first tile's L2 prefetch and a split's write and merge are split_kv.py's,
shared with the batch decode's own attention kernel (engine/kernels/rope_decode.py).

Compiled variants: the split count is not specialized, and the reduce merges any count of splits
BLOCK_S at a time, not in one block sized by the batch (mixed steps of two or three sequences,
which no decode graph runs, compiled new blocks while serving: 250-290 ms online p99 TTFT,
bench/history/2026-11-24.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.attention import LOG2E, next_pow2, stamp_row
from engine.kernels.launcher import Launcher
from engine.kernels.split_kv import (
    MERGE_SPLITS,
    attend_tiles,
    prefetch_first_tile,
    split_chunk,
    write_split,
    write_zeros,
)

REDUCE_BLOCK_S = 16  # splits the decode reduce merges per iteration


@triton.jit
def decode_row(qsl_ptr, seq, mixed):
    # -> (token row of sequence seq's query, whether this kernel attends it). Mixed steps: the
    # row is query_start_loc[seq], and sequences of more than one new token are prefill chunks
    # (the prefill kernel's).
    row = seq
    attend = seq >= 0
    if mixed != 0:
        row = tl.load(qsl_ptr + seq)
        attend = tl.load(qsl_ptr + seq + 1) - row == 1
    return row, attend


@triton.jit
def _stamp(stamp_ptr, i: tl.constexpr, TIMING: tl.constexpr):
    # bench only (TIMING): this program's %globaltimer (ns) at point i (0 start, 1 after the PDL
    # wait, 2 end of a one-split program) into stamp[program, i]; at 0 also its %smid into [3].
    if TIMING:
        program = (tl.program_id(2) * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(0) + tl.program_id(0)
        stamp_row(stamp_ptr + program * 4, i, 3)


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
    count_ptr,  # [B, Hkv] int32, zero between launches (MERGE): splits of (seq, kv_head) done
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,  # >= GROUP and >= 16 (tl.dot's smallest M)
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
    USE_PDL: tl.constexpr = False, LINE: tl.constexpr = 64,
    MERGE: tl.constexpr = 0,  # > 0: the last split of (seq, kv_head) to finish merges the partials, MERGE a load
    stamp_ptr=None,  # [programs, 4] int64 (TIMING only: per-program timestamps)
    TIMING: tl.constexpr = False,
):  # fmt: skip
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    _stamp(stamp_ptr, 0, TIMING)
    row, attend = decode_row(qsl_ptr, seq, mixed)
    if not attend:
        return
    # seq_len after the early return: loaded (with the split) before it, inside decode_row, the
    # batch-64 layer took 47 us instead of 38 (bench/history/2026-11-24.md).
    seq_len = tl.load(seq_lens_ptr + seq)
    chunk = split_chunk(seq_len, num_splits, BLOCK_N)
    start = split * chunk
    end = tl.minimum(start + chunk, seq_len)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    h_mask = offs_h < GROUP
    heads = kv_head * GROUP + offs_h
    out_ptrs = out_ptr + row * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]  # [BLOCK_H, D]
    if num_splits > 1:
        if start >= end:  # past this row's end (or a padding row): the reduce skips this split
            if MERGE > 0 and split == 0:  # a padding row: zeros, as the reduce writes
                write_zeros(out_ptrs, h_mask, BLOCK_H, HEAD_DIM, USE_PDL)
            return

    bt_row_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    if USE_PDL:
        # engine/kernels/pdl.py: launched while the kernel that writes q and the new K/V row still runs.
        # The metadata is the step's upload; the first tile's K/V lines go to L2; then wait.
        prefetch_first_tile(k_cache_ptr, v_cache_ptr, bt_row_ptr, start, end, kv_head, stride_cblk, stride_ctok,
                            stride_chead, HEAD_DIM, BLOCK_SIZE, BLOCK_N, LINE)  # fmt: skip
        tl.extra.cuda.gdc_wait()
        _stamp(stamp_ptr, 1, TIMING)
        # The kernel after it gets scheduled as programs end.
        tl.extra.cuda.gdc_launch_dependents()
    q = tl.load(
        q_ptr + row * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=h_mask[:, None], other=0.0
    ).to(k_cache_ptr.dtype.element_ty)

    m_i, l_i, acc = attend_tiles(
        q, k_cache_ptr, v_cache_ptr, bt_row_ptr, start, end, kv_head, sm_scale_log2, stride_cblk, stride_ctok,
        stride_chead, BLOCK_H, HEAD_DIM, BLOCK_SIZE, BLOCK_N, IEEE, False,
    )  # fmt: skip
    write_split(
        m_i, l_i, acc, out_ptrs, part_out_ptr, part_lse_ptr, count_ptr, seq, kv_head, split, num_splits,
        tl.cdiv(seq_len, chunk), heads, h_mask, NUM_HEADS, HEAD_DIM, BLOCK_H, MERGE,
    )  # fmt: skip
    if num_splits == 1:
        _stamp(stamp_ptr, 2, TIMING)


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
    row, attend = decode_row(qsl_ptr, seq, mixed)
    if not attend:
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


def decode_config(head_dim: int, elem_bytes: int) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) of the decode kernel."""
    row_bytes = head_dim * elem_bytes  # one K row
    block_n = 64 if row_bytes <= 256 else 32
    return block_n, 4, 3 if block_n * row_bytes <= 16384 else 2


def query_rows(group: int) -> int:
    """BLOCK_H: the query heads of one KV head a program holds, at least tl.dot's 16 rows."""
    return max(16, next_pow2(group))


def prefetch_line(head_dim: int, elem_bytes: int) -> int:
    """LINE: elements per L2 prefetch of a K/V row, a 128-byte line but at most the row (head_dim
    16 in bf16 is 32 bytes)."""
    return min(head_dim, 128 // elem_bytes)


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
    pdl_launch: bool = False,  # engine/kernels/pdl.py: the kernel before writes q and the new K/V rows
    query_start_loc: torch.Tensor | None = None,  # [B + 1] int32: mixed step (see below)
    counts: torch.Tensor | None = None,  # [>= B * Hkv] int32, zero: merge in the kernel, no reduce
    merge: int = MERGE_SPLITS,  # with counts: partials a load of the in-kernel merge (a power of two)
    stamps: torch.Tensor | None = None,  # bench only: [B * Hkv * splits, 4] int64 (_stamp)
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
        scale * LOG2E, num_splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0), qsl, mixed,
        counts if counts is not None else seq_lens,  # unread unless MERGE
        NUM_HEADS=num_heads, GROUP=group, BLOCK_H=query_rows(group),
        HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1], BLOCK_N=block_n,
        IEEE=k_cache.dtype == torch.float32, USE_PDL=pdl_launch, LINE=prefetch_line(head_dim, k_cache.element_size()),
        MERGE=merge if counts is not None and num_splits > 1 else 0, stamp_ptr=stamps, TIMING=stamps is not None,
        num_warps=num_warps, num_stages=num_stages, launch_pdl=pdl_launch,
    )  # fmt: skip
    if num_splits > 1 and counts is None:
        _decode_reduce_kernel[(batch, num_heads)](
            part_out, part_lse, seq_lens, out, num_splits, out.stride(0), out.stride(1), qsl, mixed,
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_N=block_n, BLOCK_S=REDUCE_BLOCK_S,
            num_warps=4 if head_dim * REDUCE_BLOCK_S >= 4096 else 1,
        )  # fmt: skip
