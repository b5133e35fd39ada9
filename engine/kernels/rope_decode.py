"""The decode step's attention from the qkv projection's output: the backend's split-KV decode
(engine/kernels/attention_decode.py) with q/k norm, rope and the new K/V rows' store folded in.
Two callers, one kernel (`rope_decode_kernel`):
- the batch decode (engine/decode/batch_decode.py) on the fp32 split-K partials of its persistent
  kernel, which then ends at its qkv projection, one phase and one grid barrier sooner; its tiles
  are half the backend's above FEW_ROWS rows, two buffered (`batch_tile_config`);
- `DecodeAttention`, the layers' own forward (models/layers.py `Attention`) on the decode steps no
  persistent path takes (the 8B and 30B-A3B shapes, more than 64 rows): on the qkv projection's
  split-K parts (1-16 rows, engine/kernels/splitk_linear.py; the bias added here) or on the qkv
  linear's output (one "partial", its bias already added), one launch where rotary, store_kv,
  decode and its reduce were four.
Only those two modules import this one (it imports Triton).

Grid (B, Hkv, splits), as the backend's kernel; one program, (row, KV head g, split):
  1. (PDL) the first tile's K/V lines into L2 and the q/k norm's weights loaded, wait for the
     kernel before, trigger the next.
  2. q of g's GROUP query heads and the new token's k and v: round(sum_c qkv_part[c] + bias)
     (KS parts of the qkv output), Qwen3's q/k norm, rope; the roundings of
     rope._norm_rope_heads (compiled without FMA contraction, as the persistent kernels).
  3. The split holding the new token (position seq_len - 1) stores its k and v into the cache at
     the row's slot (none for slot -1).
  4. The online softmax over the split's cached tokens, the new one excluded (split_kv's
     `attend_tiles`), then the new token folded in from registers: no program reads a row that
     another is writing.
  5. The output (one split) or the split's partial, merged by the row's last split to arrive
     (split_kv's `write_split`). Splits always merge here: no reduce launch runs after it.
Rows of seq_len 0 (graph padding) write zeros and no cache row. Results equal the rope kernel
followed by the backend's store and decode kernels up to the order of fp32 sums (the new token last).

`--no-rope-decode` keeps the layers' forward on the separate kernels (engine/decode/attach.py);
the batch decode always uses this kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels import attention_decode
from engine.kernels.attention import LOG2E
from engine.kernels.grid_phases import rnd
from engine.kernels.launcher import Launcher
from engine.kernels.layer_attention import norm_rope_w, norm_weights
from engine.kernels.split_kv import (
    MERGE_SPLITS,
    attend_tiles,
    prefetch_first_tile,
    split_chunk,
    write_split,
    write_zeros,
)


@triton.jit
def qkv_values(row_ptr, b_ptr, col, mask, KS: tl.constexpr, STRIDE: tl.constexpr, HAS_BIAS: tl.constexpr,
               DTYPE: tl.constexpr):  # fmt: skip
    # A row's qkv output at columns col: round(sum_c part[c] + bias), as fp32; part c at c * STRIDE.
    x = tl.load(row_ptr + col, mask=mask, other=0.0, cache_modifier=".cg")
    for c in tl.static_range(1, KS):
        x += tl.load(row_ptr + c * STRIDE + col, mask=mask, other=0.0, cache_modifier=".cg")
    if HAS_BIAS:
        x += tl.load(b_ptr + col, mask=mask, other=0.0).to(tl.float32)
    return rnd(x, DTYPE)


@Launcher
@triton.jit(do_not_specialize=["num_splits", "stride_bt"])
def rope_decode_kernel(
    part_ptr,  # [KS, MAX_M, QKV] fp32: the qkv projection's split-K partial sums, part c at STRIDE
    b_ptr, qn_ptr, kn_ptr,  # the layer's qkv bias (HAS_BIAS), q and k norm weights (QK_NORM)
    pos_ptr, cos_sin_ptr, slot_ptr,  # [B] positions, [positions, D] cos | sin, [B] int64 slots
    k_cache_ptr, v_cache_ptr,  # [num_blocks, block_size, NKV, D]
    block_tables_ptr, seq_lens_ptr,  # [B, max_blocks] int32, [B] int32 (0: padding)
    out_ptr,  # [B, NH, D]
    part_out_ptr, part_lse_ptr, count_ptr,  # split partials and merge counters (attention_decode.py)
    eps, sm_scale_log2, num_splits, stride_cblk, stride_ctok, stride_chead, stride_bt,
    NH: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr, KS: tl.constexpr, STRIDE: tl.constexpr,
    HAS_BIAS: tl.constexpr, QK_NORM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, LINE: tl.constexpr, IEEE: tl.constexpr, USE_PDL: tl.constexpr, MERGE: tl.constexpr,
):  # fmt: skip
    DTYPE: tl.constexpr = k_cache_ptr.dtype.element_ty
    GROUP: tl.constexpr = NH // NKV
    HALF: tl.constexpr = D // 2
    seq = tl.program_id(0)
    g = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    chunk = split_chunk(seq_len, num_splits, BLOCK_N)
    start = split * chunk
    end = tl.minimum(start + chunk, seq_len)
    hh = tl.arange(0, BLOCK_H)
    h_mask = hh < GROUP
    heads = g * GROUP + hh
    dd = tl.arange(0, D)[None, :]
    out_ptrs = out_ptr + (seq * NH + heads)[:, None] * D + dd  # [BLOCK_H, D]
    if start >= end:  # a split past the row's end, or a padding row: split 0 writes its zeros
        if split == 0:
            write_zeros(out_ptrs, h_mask, BLOCK_H, D, USE_PDL)
        return
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    # What no kernel of the step writes (the step's upload, the rope table): before the wait.
    d = tl.arange(0, HALF)[None, :]
    pos = tl.load(pos_ptr + seq).to(tl.int64)
    cos = rnd(tl.load(cos_sin_ptr + pos * D + d), DTYPE)  # [1, HALF]
    sin = rnd(tl.load(cos_sin_ptr + pos * D + HALF + d), DTYPE)
    slot = tl.load(slot_ptr + seq)
    qw1, qw2 = norm_weights(qn_ptr, QK_NORM, HALF)  # the layer's: no load of them after the wait
    kw1, kw2 = norm_weights(kn_ptr, QK_NORM, HALF)
    if USE_PDL:  # engine/kernels/pdl.py: and the first tile's old cache rows into L2, then wait
        prefetch_first_tile(k_cache_ptr, v_cache_ptr, bt_row, start, end, g, stride_cblk, stride_ctok, stride_chead,
                            D, BLOCK_SIZE, BLOCK_N, LINE)  # fmt: skip
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    # The new token's q (GROUP heads), k and v from the partial sums, normed and rotated.
    row = part_ptr + seq * ((NH + 2 * NKV) * D)
    cq = heads[:, None] * D + d  # [BLOCK_H, HALF]
    q_ok = h_mask[:, None]
    q1, q2 = norm_rope_w(
        qkv_values(row, b_ptr, cq, q_ok, KS, STRIDE, HAS_BIAS, DTYPE),
        qkv_values(row, b_ptr, cq + HALF, q_ok, KS, STRIDE, HAS_BIAS, DTYPE),
        qw1, qw2, cos, sin, eps, QK_NORM, HALF, DTYPE,
    )  # fmt: skip
    ck = NH * D + g * D + d  # [1, HALF]
    k1, k2 = norm_rope_w(
        qkv_values(row, b_ptr, ck, ck >= 0, KS, STRIDE, HAS_BIAS, DTYPE),
        qkv_values(row, b_ptr, ck + HALF, ck >= 0, KS, STRIDE, HAS_BIAS, DTYPE),
        kw1, kw2, cos, sin, eps, QK_NORM, HALF, DTYPE,
    )  # fmt: skip
    cv = (NH + NKV) * D + g * D + dd  # [1, D]
    v = qkv_values(row, b_ptr, cv, cv >= 0, KS, STRIDE, HAS_BIAS, DTYPE).to(DTYPE)
    cur = seq_len - 1
    has_new = (start <= cur) & (cur < end)
    if has_new & (slot >= 0):
        dst = slot * stride_ctok + g * stride_chead
        tl.store(k_cache_ptr + dst + d, k1)
        tl.store(k_cache_ptr + dst + HALF + d, k2)
        tl.store(v_cache_ptr + dst + dd, v)
    # The new token's scores [BLOCK_H] now, so that only they and v stay live through the loop.
    s = tl.sum(q1.to(tl.float32) * k1.to(tl.float32), 1) + tl.sum(q2.to(tl.float32) * k2.to(tl.float32), 1)
    s = s * sm_scale_log2
    q = tl.reshape(tl.permute(tl.join(q1, q2), (0, 2, 1)), (BLOCK_H, D))  # [BLOCK_H, D] = q1 | q2
    m_i, l_i, acc = attend_tiles(
        q, k_cache_ptr, v_cache_ptr, bt_row, start, tl.minimum(end, cur), g, sm_scale_log2, stride_cblk, stride_ctok,
        stride_chead, BLOCK_H, D, BLOCK_SIZE, BLOCK_N, IEEE, False,
    )  # fmt: skip
    if has_new:  # the new token, last: its p rounded as the tile loop's dot takes it
        m_new = tl.maximum(m_i, s)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new)
        l_i = l_i * alpha + p
        acc = acc * alpha[:, None] + rnd(p, DTYPE)[:, None] * v.to(tl.float32)
        m_i = m_new
    write_split(
        m_i, l_i, acc, out_ptrs, part_out_ptr, part_lse_ptr, count_ptr, seq, g, split, num_splits,
        tl.cdiv(seq_len, chunk), heads, h_mask, NH, D, BLOCK_H, MERGE,
    )  # fmt: skip


# Steps of at most this many rows keep the backend's tile in the batch decode: few rows are long
# rows (bench/kernels/rope_decode.py, H200, bench/history/2026-11-30.md: 64x4x3 against 32x4x6,
# us a layer: 1 row at 8k / 32k 27.0 / 57.2 against 29.0 / 61.0, 4 rows at 32k 146.5 against
# 172.9, 8 rows at 8k 81.2 against 89.3; level at 8 rows of 512, 2026-11-28).
FEW_ROWS = 8
# Partials a load of the last split's merge (split_kv.merge_splits) in a step of at most FEW_ROWS
# rows: one long row's 49 splits merge in 4 loads, not 13 (H200, us a layer, 16 query heads:
# 1 row at 32k 49.6 -> 41.1, at 8k 21.2 -> 17.0; 4 rows at 32k 147.7 -> 134.9; 8 rows at 8k
# 80.3 -> 72.1; bench/kernels/rope_decode.py --merge-splits, bench/history/2026-11-30.md entry n).
# Steps of more rows keep split_kv.MERGE_SPLITS: at 16 the kernel takes 146 registers a thread,
# 3 programs an SM, where one wave of 64 rows x 8 KV heads needs 4.
FEW_ROWS_MERGE = 16


def merge_for(rows: int) -> int:
    """Partials a load of the merge in a step of `rows` rows."""
    return FEW_ROWS_MERGE if rows <= FEW_ROWS else MERGE_SPLITS


def batch_tile_config(d: int, elem_bytes: int, rows: int) -> tuple[int, int, int]:
    """(BLOCK_N, warps, stages) of the batch decode's attention for steps of `rows` rows: up to
    FEW_ROWS the backend's decode tile (attention_decode.decode_config); above, that tile
    at half the tokens and twice the stages, so a program buffers
    two K/V tiles and streams one while it computes the other, at the same four programs an SM
    (0.6B shape: 32x4x6 against 64x4x3). H200, context 512, forward from a graph, three rounds:
    64 / 32 / 16 rows 1.693-1.700 -> 1.678-1.685, 1.339-1.343 -> 1.307-1.313, 1.132-1.135 ->
    1.114-1.116 ms, 8 rows level (bench/history/2026-11-28.md; the kernel of 2026-11-24, before rope
    and the K/V store were folded in, lost with it).
    Only the 64-token tile of half-precision rows is halved (what was measured; fp32 caches, the
    tests', keep the backend's: 16-token tiles spill there)."""
    block_n, num_warps, num_stages = attention_decode.decode_config(d, elem_bytes)
    if elem_bytes == 2 and block_n == 64 and rows > FEW_ROWS:
        return 32, num_warps, 2 * num_stages
    return block_n, num_warps, num_stages


def kernel_consts(
    nh: int, nkv: int, d: int, ks: int, stride: int, has_bias: bool, qk_norm: bool, block_size: int, elem_bytes: int,
    use_pdl: bool, config: tuple[int, int, int] | None = None, merge: int = MERGE_SPLITS,
) -> dict[str, object]:  # fmt: skip
    """The kernel's constexprs and launch options for a layer of nh / nkv heads of d, qkv partials
    [ks, *, *] at `stride`, KV blocks of block_size (no device needed: bench/kernels/occupancy.py
    compiles them). The tile config (BLOCK_N, warps, stages) is `config`, else the backend's
    decode kernel's; the merge loads `merge` partials at a time (`merge_for` the step's rows)."""
    block_n, num_warps, num_stages = config or attention_decode.decode_config(d, elem_bytes)
    return dict(
        NH=nh, NKV=nkv, D=d, KS=ks, STRIDE=stride, HAS_BIAS=has_bias, QK_NORM=qk_norm,
        BLOCK_H=attention_decode.query_rows(nh // nkv), BLOCK_SIZE=block_size, BLOCK_N=block_n, LINE=attention_decode.prefetch_line(d, elem_bytes),
        IEEE=elem_bytes == 4,  # fp32 caches: fp32 dots, not tf32 (as the backend's kernel)
        USE_PDL=use_pdl, MERGE=merge, num_warps=num_warps, num_stages=num_stages, launch_pdl=use_pdl, enable_fp_fusion=False,
    )  # fmt: skip


def rope_decode(
    norms: tuple[torch.Tensor | None, torch.Tensor | None, float],  # q and k norm weights [D] (Qwen3), eps
    qkv_part: torch.Tensor,  # [KS, MAX_M, QKV] fp32 partial sums, or [1, B, QKV] the qkv linear's output
    qkv_bias: torch.Tensor | None,  # added here (None: already in the part)
    caches: tuple[torch.Tensor, torch.Tensor],  # the layer's K and V caches, each [num_blocks, block_size, NKV, D]
    positions: torch.Tensor, cos_sin: torch.Tensor,  # [B] int64, [max_pos, D] the rotary table
    slots: tuple[torch.Tensor, torch.Tensor, torch.Tensor],  # slot_mapping [B], block_tables [B, W], seq_lens [B]
    out: torch.Tensor,  # [B, NH, D]
    scale: float,
    plan: tuple[int, torch.Tensor, torch.Tensor, torch.Tensor],  # (splits, partial out, partial lse, counters)
    consts: dict[str, object],  # kernel_consts of these shapes
) -> None:  # fmt: skip
    """Attention of a decode step of B rows from the qkv projection's output (module docstring)."""
    splits, part_out, part_lse, counts = plan
    q_w, k_w, eps = norms
    k_cache, v_cache = caches
    slot_mapping, block_tables, seq_lens = slots
    rope_decode_kernel[(out.shape[0], k_cache.shape[2], splits)](
        qkv_part, qkv_bias if qkv_bias is not None else qkv_part, q_w if q_w is not None else cos_sin,
        k_w if k_w is not None else cos_sin, positions, cos_sin, slot_mapping, k_cache, v_cache,
        block_tables, seq_lens, out, part_out, part_lse, counts, eps,
        scale * LOG2E, splits, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        **consts,
    )  # fmt: skip
