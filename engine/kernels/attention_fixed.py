"""Fixed-split paged attention for `--deterministic` (issue 76): a query token's output depends on
its own query and its sequence's cached K/V alone, never on the other tokens of its step, how its
sequence was cut into prefill chunks, or whether it is a decode.

    out[t] = softmax(q[t] K[:p+1].T * scale) V[:p+1]      p = token t's position in its sequence

Rules:
- One kernel for every step (prefill chunks, decodes, mixed, verify chunks): grid (T, Hkv), one
  program per query token and KV head, its GROUP query heads as the rows of one [BLOCK_H, D]
  tile (BLOCK_H fixed by the model, so every token runs the same instructions at the same rows).
- The context 0..p is cut at fixed positions, every SPLIT tokens (not a count that follows the
  batch); each piece runs split_kv.py's online softmax in BLOCK_N tiles from a fresh state, and
  the pieces merge in ascending order by one recurrence (`_merge`): the same arithmetic for a
  token whatever step it is in.
- A token's sequence is found by binary search of query_start_loc; its position is
  seq_len - (query_start_loc[seq + 1] - t). Rows past the step's last sequence, and rows of
  sequences of seq_len 0 (graph padding), write zeros.
- The K/V of the step's new tokens are in the cache before the kernel runs (the backend stores
  them first).

Its cost: each token streams its whole context once per KV head, so a prefill of T tokens reads
O(T * context) K/V bytes (through L2), against a tiled prefill's O(T * context / BLOCK_M); the
price of a row's bits not depending on its neighbours. Only CUDA code paths, and the CPU tests
under Triton's interpreter, import this module.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.attention import LOG2E, next_pow2
from engine.kernels.launcher import Launcher
from engine.kernels.split_kv import attend_tiles

SPLIT = 256  # context tokens per piece: a fixed position grid, multiple of BLOCK_N
BLOCK_N = 32  # keys per tile


@triton.jit
def _merge(m, total, acc, m_s, l_s, acc_s):
    # The running (max, sum of exp2, unnormalized output) with one more piece's, in base 2.
    m_new = tl.maximum(m, m_s)
    a = tl.exp2(m - m_new)
    b = tl.exp2(m_s - m_new)
    return m_new, total * a + l_s * b, acc * a[:, None] + acc_s * b[:, None]


@Launcher
@triton.jit(do_not_specialize=["num_seqs", "stride_bt"])
def _fixed_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, out_ptr,
    num_seqs, stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, stride_cblk, stride_ctok, stride_chead,
    sm_scale_log2,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N_: tl.constexpr, SPLIT_: tl.constexpr, SEARCH: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    g = tl.program_id(1)
    # The sequence of token t: the least i with query_start_loc[i + 1] > t.
    lo = t * 0
    hi = t * 0 + num_seqs - 1
    for _ in tl.static_range(SEARCH):
        mid = (lo + hi) // 2
        right = tl.load(qsl_ptr + mid + 1) <= t
        lo = tl.where(right, mid + 1, lo)
        hi = tl.where(right, hi, mid)
    seq = tl.minimum(lo, num_seqs - 1)  # (past the last sequence: a padding row, below)
    end_q = tl.load(qsl_ptr + seq + 1)
    pos = tl.load(seq_lens_ptr + seq) - (end_q - t)  # -1 or less: padding
    live = (t < tl.load(qsl_ptr + num_seqs)) & (pos >= 0)
    heads = g * GROUP + tl.arange(0, BLOCK_H)
    h_mask = tl.arange(0, BLOCK_H) < GROUP
    offs_d = tl.arange(0, HEAD_DIM)
    out_ptrs = out_ptr + t.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    q = tl.load(q_ptr + t.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=h_mask[:, None] & live, other=0.0)  # fmt: skip
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
    context = tl.where(live, pos + 1, 0)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    for start in range(0, context, SPLIT_):
        end = tl.minimum(start + SPLIT_, context)
        m_s, l_s, acc_s = attend_tiles(q, k_cache_ptr, v_cache_ptr, bt_row, start, end, g, sm_scale_log2,
                                       stride_cblk, stride_ctok, stride_chead, BLOCK_H, HEAD_DIM, BLOCK_SIZE,
                                       BLOCK_N_, IEEE)  # fmt: skip
        m, total, acc = _merge(m, total, acc, m_s, l_s, acc_s)
    result = acc / tl.where(total > 0, total, 1.0)[:, None]
    tl.store(out_ptrs, result.to(out_ptr.dtype.element_ty), mask=h_mask[:, None])


def fixed_split_attention(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32: each sequence's tokens, this step's included
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    out: torch.Tensor,  # [T, H, D]
    scale: float,
    max_num_seqs: int,  # the most sequences a step may hold: the search's depth
) -> torch.Tensor:
    """out[t] = token t's attention over its sequence's cached keys 0..its position (module
    docstring); every row of out is written (zeros past the last sequence)."""
    tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    if tokens == 0:
        return out
    _fixed_split_kernel[(tokens, num_kv_heads)](
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out,
        seq_lens.shape[0], q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), scale * LOG2E,
        GROUP=group, BLOCK_H=max(16, next_pow2(group)), HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_N_=BLOCK_N, SPLIT_=SPLIT, SEARCH=max(1, max_num_seqs.bit_length()), IEEE=q.dtype == torch.float32,
        num_warps=4,
    )  # fmt: skip
    return out
