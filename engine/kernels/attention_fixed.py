"""Fixed-split paged attention for `--deterministic` (issue 76): a query token's output depends on
its own query and its sequence's cached K/V alone, never on the other tokens of its step, how its
sequence was cut into prefill chunks, or whether it is a decode.

    out[t] = softmax(q[t] K[:p+1].T * scale) V[:p+1]      p = token t's position in its sequence

Rules:
- Three paths, one arithmetic for a token whatever step it is in (prefill chunks, decodes, mixed,
  verify chunks). A step where some sequence has several query tokens (a prefill chunk) runs
  `_tile_kernel`: grid (tiles, Hkv), one program per tile of up to TOK = BLOCK_H // GROUP
  consecutive query tokens of one sequence and a KV head; row r of its [BLOCK_H, D] tile is
  token r // GROUP's query head r % GROUP (BLOCK_H fixed by the model). A row's arithmetic does
  not depend on the other rows of its tile: the MMAs never mix rows, a row's max is exact in
  any order and its sum of p is an MMA's (split_kv.softmax_step's DOT_SUM, so neither the row's
  place nor the kernel's warps change it), and a row's state changes only on the K/V tiles
  that hold its keys (fixed_rows.py `walk_rows`). So a chunk reads its K/V once for TOK
  tokens. A step of one token a sequence runs `_token_kernel`, grid (T, Hkv), rows 0..GROUP-1
  one token's heads (the tiled kernel's `where`s and idle tiles cost a decode of 256 rows 4 %).
- The context 0..p is cut at fixed positions, every SPLIT tokens (not a count that follows the
  batch); each piece runs split_kv.py's online softmax in BLOCK_N tiles from a fresh state, and
  the pieces merge in ascending order by one recurrence (fixed_rows.py `merge_piece`): the same
  arithmetic for a token whatever step it is in.
- A tile's or token's sequence is found by binary search of query_start_loc; a token's position is
  seq_len - (query_start_loc[seq + 1] - t). A step of as many tokens as sequences (a decode,
  eager or a graph's: the scheduler schedules no sequence without a token) skips the search:
  token t is sequence t (`ONE_EACH`: the search's dependent loads were 0.5 of a one-row split
  step's 12.9 us at 576 tokens, H200). Rows past the step's last sequence, and rows of
  sequences of seq_len 0 (graph padding), write zeros.
- The K/V of the step's new tokens are in the cache before the kernel runs (the backend stores
  them first). A decode step's kernels launched after the kernel that stored them and wrote q
  (`use_pdl`: the batch decode's persistent kernel) start early under PDL and wait for it before
  any other read, `_token_kernel` once it has located its row (engine/kernels/pdl.py).
- Where it runs may follow the step, what it computes may not: a step of at most `FEW_TOKENS`
  tokens given a workspace (`Workspace`: decode steps and their graphs) runs a program per
  (token, KV head, slot), each slot computing its pieces p = slot, slot + SLOTS, ... from a fresh
  state into the workspace, and the last slot of (token, KV head) to arrive merges the token's
  pieces in ascending order by the same recurrence: the same partials merged in the same order
  as the one-program path, so the same bits, in one launch. Every kernel here is compiled
  without FMA contraction (each multiply and add rounds by itself), so the paths' shared
  arithmetic cannot be contracted two ways.

Its cost: each tile streams its tokens' whole context once per KV head, so a prefill of T tokens
reads O(T / TOK * context) K/V bytes (through L2), against a 64- or 128-token tiled prefill's
O(T * context / BLOCK_M): TOK is 8 for Qwen3-0.6B's 2 query heads a KV head, 4 for Qwen3-8B's
4. A decode step of few tokens has only T x Hkv programs on the one-program path (8 for one
Qwen3 row), hence the split path. Only CUDA code paths, and the CPU tests under Triton's
interpreter, import this module.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from engine.kernels.attention import LOG2E, next_pow2
from engine.kernels.fixed_rows import (
    locate,
    piece_item,
    query_rows,
    tile_rows,
    walk_pieces,
    walk_rows,
)
from engine.kernels.launcher import Launcher
from engine.kernels.qkv_parts import QkvParts, token_args, token_consts, token_values
from engine.kernels.rope import rope_kv_head

# Context tokens a piece: a fixed position grid, a multiple of BLOCK_N. What the bits follow: a
# piece is BLOCK_N tiles in sequence, the length of a one-row decode's chain. H200, 8B heads (32 /
# 8), microseconds a call at SPLIT 256 / 128 / 64 (bench/kernels/attention_fixed.py --split,
# 2026-11-30m): one row at 512 tokens, split path, 11.3 / 8.2 / 7.5; 256 rows at 512, one token a
# program, 132.3 / 136.3 / 137.1; 4 x 512-token chunks at 2k, tiles, 579 / 626 / 719.
SPLIT = 128
# Keys per tile, a divisor of SPLIT; the bits follow it too. H200, microseconds a call at 32
# (warps 1, 1, 4) / 64 (warps 2, 2, 4), 0.6B heads (bench/kernels/attention_fixed.py --block-n,
# 2026-12-01a): 64 rows at 512, one token a program, 44.8 / 36.1 (8B heads 45.4 / 36.2); one row
# at 32k, split path, 153.1 / 144.9; 4 rows at 8k 86.4 / 78.6; 256 rows at 512 132.8 / 131.7; one
# 2,048-token prefill, tiles, 250.4 / 199.9 (8B heads 404.3 / 345.7); 4 x 512-token chunks alike.
BLOCK_N = 64
FEW_TOKENS = 16  # steps of at most this many tokens may take the split path (a workspace this wide)
TARGET_PROGRAMS = 264  # the split path's programs: about two an SM of an H200 (132 SMs)
# Warps a program, per path (free, since every sum a row's bits depend on is an MMA's:
# softmax_step's DOT_SUM). At BLOCK_N 64 a program of one warp runs slow (64 rows at 512: 69.4 us
# against 36.1 at two warps); the tiles at 4 warps: 4 x 512-token chunks at 2k 406.4 us against
# 283.9 at 2 (0.6B heads; 2026-12-01a).
TILE_WARPS, TOKEN_WARPS, PIECE_WARPS = 2, 2, 4


@triton.jit
def after_wait(USE_PDL: tl.constexpr):
    # USE_PDL (engine/kernels/pdl.py): launched while the kernel that wrote q and the new K/V rows
    # runs, having read only the step's metadata; wait for all of it, then let the next kernel's
    # programs get scheduled.
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@Launcher
@triton.jit(do_not_specialize=["num_seqs", "stride_bt"])
def _token_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, out_ptr,
    part_ptr, pos_ptr, cos_sin_ptr, qw_ptr, kw_ptr, slot_ptr,  # ROPE (QkvParts); else any tensors, not read
    num_seqs, stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, stride_cblk, stride_ctok, stride_chead,
    sm_scale_log2, stride_part, stride_cos, eps,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N_: tl.constexpr, SPLIT_: tl.constexpr, SEARCH: tl.constexpr, IEEE: tl.constexpr, ONE_EACH: tl.constexpr,
    USE_PDL: tl.constexpr = False, ROPE: tl.constexpr = False, KS: tl.constexpr = 1,
    NUM_HEADS: tl.constexpr = 1, QK_NORM: tl.constexpr = False, BLOCK_HQ: tl.constexpr = 1, BLOCK_HK: tl.constexpr = 1,
):  # fmt: skip
    # Program (t, g): token t's query heads of KV head g, every piece of its context. ROPE: first
    # their q, the key and the value of head g from the qkv partials, normed, rotated, the new K/V
    # row stored (rope.rope_kv_head); q_ptr is then the qkv rows (stride_qt its width).
    t = tl.program_id(0)
    g = tl.program_id(1)
    seq, live, context = locate(t, qsl_ptr, seq_lens_ptr, num_seqs, SEARCH, ONE_EACH)
    after_wait(USE_PDL)
    if ROPE:  # into t's qkv row: its q heads of g, key g, value g (this program's alone)
        q_row = q_ptr + t.to(tl.int64) * stride_qt
        dk = q_row + (NUM_HEADS + g) * HEAD_DIM
        rope_kv_head(
            t, g, part_ptr, stride_part, q_row + g * (GROUP * HEAD_DIM), dk, dk + (NUM_HEADS // GROUP) * HEAD_DIM, pos_ptr,
            cos_sin_ptr, qw_ptr, kw_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, stride_cos, stride_ctok, stride_chead,
            1.0 / HEAD_DIM, eps, KS, NUM_HEADS, NUM_HEADS // GROUP, HEAD_DIM, QK_NORM, BLOCK_HQ, BLOCK_HK,
        )  # fmt: skip
    heads, h_mask, offs_d, q = query_rows(q_ptr, t, g, live, stride_qt, stride_qh, GROUP, BLOCK_H, HEAD_DIM)
    out_ptrs = out_ptr + t.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    m, total, acc = walk_pieces(q, k_cache_ptr, v_cache_ptr, bt_row, context, g, sm_scale_log2, stride_cblk,
                                stride_ctok, stride_chead, BLOCK_H, HEAD_DIM, BLOCK_SIZE, BLOCK_N_, SPLIT_, IEEE)  # fmt: skip
    result = acc / tl.where(total > 0, total, 1.0)[:, None]
    tl.store(out_ptrs, result.to(out_ptr.dtype.element_ty), mask=h_mask[:, None])


@Launcher
@triton.jit(do_not_specialize=["num_seqs", "tokens", "stride_bt"])
def _tile_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, out_ptr,
    num_seqs, tokens, stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, stride_cblk, stride_ctok, stride_chead,
    sm_scale_log2,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N_: tl.constexpr, SPLIT_: tl.constexpr, SEARCH: tl.constexpr, IEEE: tl.constexpr, TOK: tl.constexpr,
):  # fmt: skip
    # Program (tile, g): the tile's tokens (tile_rows) for KV head g, every piece of their contexts,
    # the K/V tiles loaded once for all of them.
    g = tl.program_id(1)
    seq, t, h, mine, context = tile_rows(tl.program_id(0), qsl_ptr, seq_lens_ptr, num_seqs, tokens, TOK, GROUP,
                                         BLOCK_H, SEARCH)  # fmt: skip
    heads = g * GROUP + h
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + t[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=(context > 0)[:, None], other=0.0)  # fmt: skip
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    m, total, acc = walk_rows(q, k_cache_ptr, v_cache_ptr, bt_row, context, tl.max(context, 0), g, sm_scale_log2,
                              stride_cblk, stride_ctok, stride_chead, BLOCK_H, HEAD_DIM, BLOCK_SIZE, BLOCK_N_, SPLIT_,
                              IEEE)  # fmt: skip
    result = acc / tl.where(total > 0, total, 1.0)[:, None]
    out_ptrs = out_ptr + t[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(out_ptrs, result.to(out_ptr.dtype.element_ty), mask=mine[:, None])


@Launcher
@triton.jit(do_not_specialize=["num_seqs", "stride_bt", "pieces"])
def _piece_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, ws_m_ptr, ws_l_ptr, ws_acc_ptr, count_ptr, out_ptr,
    num_seqs, stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, stride_cblk, stride_ctok, stride_chead,
    sm_scale_log2, pieces,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N_: tl.constexpr, SPLIT_: tl.constexpr, SEARCH: tl.constexpr,
    IEEE: tl.constexpr, ONE_EACH: tl.constexpr, USE_PDL: tl.constexpr = False,
):  # fmt: skip
    # Program (t, g, slot) of SLOTS: fixed_rows.piece_item, the pieces slot, slot + SLOTS, ... of
    # token t for KV head g, and the merge of them all by the last of (t, g) to arrive.
    after_wait(USE_PDL)
    t = tl.program_id(0)
    seq, live, context = locate(t, qsl_ptr, seq_lens_ptr, num_seqs, SEARCH, ONE_EACH)
    piece_item(
        t, tl.program_id(1), tl.program_id(2), tl.num_programs(2), seq, live, context, q_ptr, k_cache_ptr, v_cache_ptr,
        bt_ptr, ws_m_ptr, ws_l_ptr, ws_acc_ptr, count_ptr, out_ptr, stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
        stride_cblk, stride_ctok, stride_chead, sm_scale_log2, pieces,
        NUM_HEADS, GROUP, BLOCK_H, HEAD_DIM, BLOCK_SIZE, BLOCK_N_, SPLIT_, IEEE,
    )  # fmt: skip


class Workspace(NamedTuple):
    """The split path's partials, fp32, for steps of up to FEW_TOKENS tokens: per (token, piece,
    query head) the piece's running max `m`, sum of exp2 `total` and unnormalized output `acc`;
    and per (token, KV head) the slot programs arrived (`counts`: zero between steps, since the
    last to arrive zeroes it; zeroed again after a resume of the region holding it)."""

    m: torch.Tensor  # [FEW_TOKENS, pieces, H]
    total: torch.Tensor  # [FEW_TOKENS, pieces, H]
    acc: torch.Tensor  # [FEW_TOKENS, pieces, H, D]
    counts: torch.Tensor  # [FEW_TOKENS, H] int32 (indexed by KV head: H >= Hkv)

    @classmethod
    def allocate(cls, num_heads: int, head_dim: int, max_model_len: int, device: torch.device) -> Workspace:
        pieces = triton.cdiv(max_model_len, SPLIT)
        m = torch.empty(FEW_TOKENS, pieces, num_heads, dtype=torch.float32, device=device)
        acc = torch.empty(FEW_TOKENS, pieces, num_heads, head_dim, dtype=torch.float32, device=device)
        return cls(m, torch.empty_like(m), acc, torch.zeros(FEW_TOKENS, num_heads, dtype=torch.int32, device=device))

    @property
    def nbytes(self) -> int:
        return sum(x.numel() * x.element_size() for x in self)

    def after_resume(self) -> None:
        self.counts.zero_()


def fixed_split_attention(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32: each sequence's tokens, this step's included
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    out: torch.Tensor,  # [T, H, D]
    scale: float,
    max_num_seqs: int,  # the most sequences a step may hold: the search's depth (more are searched deeper)
    workspace: Workspace | None = None,  # the split path's, for steps of up to FEW_TOKENS tokens
    use_pdl: bool = False,  # a decode step's launch after the kernel that wrote q and its K/V rows
    rope: QkvParts | None = None,  # a decode step of more tokens than the workspace's: q and K/V from these
) -> torch.Tensor:
    """out[t] = token t's attention over its sequence's cached keys 0..its position (module
    docstring); every row of out is written (zeros past the last sequence). The grid follows the
    shapes alone (CUDA-graph capturable). `use_pdl` (engine/kernels/pdl.py): the decode kernels
    launch programmatically and wait before reading q or the cache."""
    tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    if tokens == 0:
        return out
    # The search's depth covers the step's sequences even past max_num_seqs (a shape: graph-safe).
    search_depth = max(1, max(max_num_seqs, seq_lens.shape[0]).bit_length())
    shared = dict(GROUP=group, BLOCK_H=max(16, next_pow2(group)), HEAD_DIM=head_dim, SPLIT_=SPLIT,
                  SEARCH=search_depth, enable_fp_fusion=False)  # fmt: skip
    search = (seq_lens.shape[0], q.stride(0), q.stride(1))
    tok = max(1, shared["BLOCK_H"] // group)  # query tokens a tile
    one_each = tokens == seq_lens.shape[0]  # a decode step: no sequence is scheduled without a token
    if tokens > seq_lens.shape[0] and tok > 1 and (workspace is None or tokens > workspace.m.shape[0]):
        _tile_kernel[(tokens // tok + seq_lens.shape[0] + 1, num_kv_heads)](
            q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out,
            seq_lens.shape[0], tokens, q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), scale * LOG2E,
            BLOCK_SIZE=k_cache.shape[1], BLOCK_N_=BLOCK_N, IEEE=q.dtype == torch.float32, TOK=tok,
            num_warps=TILE_WARPS, **shared,
        )  # fmt: skip
        return out
    token_path = workspace is None or tokens > workspace.m.shape[0]
    if rope is not None and not (token_path and one_each and k_cache.is_contiguous() and q.data_ptr() == rope.qkv.data_ptr()
                                 and q.stride(0) == rope.qkv.stride(0)):  # fmt: skip
        raise ValueError("fixed_split_attention: qkv partials only for a decode step past the workspace's tokens, "
                         "on a contiguous cache, q a view of their qkv rows")  # fmt: skip
    if token_path:
        _token_kernel[(tokens, num_kv_heads)](
            q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out, *token_args(rope, q),
            *search, out.stride(0), out.stride(1), block_tables.stride(0),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), scale * LOG2E, *token_values(rope),
            BLOCK_SIZE=k_cache.shape[1], BLOCK_N_=BLOCK_N, IEEE=q.dtype == torch.float32, ONE_EACH=one_each,
            USE_PDL=use_pdl, launch_pdl=use_pdl, num_warps=TOKEN_WARPS,
            **token_consts(rope, num_heads, head_dim), **shared,
        )  # fmt: skip
        return out
    pieces = workspace.m.shape[1]
    slots = max(1, min(pieces, triton.cdiv(TARGET_PROGRAMS, tokens * num_kv_heads)))
    ws = (workspace.m, workspace.total, workspace.acc, workspace.counts)
    _piece_kernel[(tokens, num_kv_heads, slots)](
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, *ws, out, *search, out.stride(0),
        out.stride(1), block_tables.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        scale * LOG2E, pieces,
        NUM_HEADS=num_heads, BLOCK_SIZE=k_cache.shape[1], BLOCK_N_=BLOCK_N, IEEE=q.dtype == torch.float32,
        ONE_EACH=one_each, USE_PDL=use_pdl, launch_pdl=use_pdl, num_warps=PIECE_WARPS, **shared,
    )  # fmt: skip
    return out
