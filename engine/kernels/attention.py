"""Triton kernels for paged attention, and thin launchers: the cache's layout, the helpers every
attention kernel shares, and the K/V store. The prefill kernel is `engine/kernels/attention_prefill.py`'s, the
split-KV decode `engine/kernels/attention_decode.py`'s (its shared pieces `engine/kernels/split_kv.py`'s). Only `engine.attention.triton` (and the models' fused decode
kernels) import these modules, so a CPU install never imports Triton.

Cache of one layer: K and V each `[num_blocks, block_size, Hkv, D]`, contiguous; token j of a
sequence lives in block `block_table[j // block_size]`, row `j % block_size`. Query head h reads KV
head `h // (H // Hkv)` (GQA). Softmax runs in fp32 in base 2 (`exp2`, scores times scale*log2(e));
partial results carry their log-sum-exp in that base too.

Kernels:
- `_store_kv_kernel`: grid (T,); one program copies one token's K and V rows (all KV heads) into
  the cache at `slot_mapping[t]`, skipping slot -1.

Compiled variants: Triton specializes a kernel on each integer argument (== 1, divisible by 16)
and on each pointer's 16-byte alignment. Integers that follow the batch (block-table widths and
strides, split counts, row counts) are not specialized (`do_not_specialize`), and the step's
uploads start every tensor 16-byte aligned (engine/runner/step_inputs.py): one variant per kernel
and model serves every batch, compiled at startup, never while a request waits. Every kernel
launches through engine/kernels/launcher.py's `Launcher`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.launcher import Launcher

LOG2E = 1.4426950408889634


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


# ---- shared helpers -----------------------------------------------------------------------------


@triton.jit
def dot(a, b, IEEE: tl.constexpr):
    # IEEE: full fp32 products (fp32 inputs); otherwise the tensor cores' native precision.
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def globaltimer():
    # This program's %globaltimer (ns): the bench-only stamps of the decode kernels (TIMING).
    return tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer; // $1", "=l,r", [tl.program_id(0)], dtype=tl.int64, is_pure=False, pack=1
    )


@triton.jit
def smid():
    # The SM this program runs on (%smid): the bench-only stamps of the decode kernels (TIMING).
    return tl.inline_asm_elementwise(
        "mov.u32 $0, %smid; // $1", "=r,r", [tl.program_id(0)], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def stamp_row(row_ptr, i: tl.constexpr, SM_AT: tl.constexpr):
    # bench only: this program's %globaltimer (ns) into row_ptr[i]; at point 0 also its %smid into
    # row_ptr[SM_AT]. Callers own the row layout (attention_decode._stamp, grid_barrier.stamp).
    tl.store(row_ptr + i, globaltimer())
    if i == 0:
        tl.store(row_ptr + SM_AT, smid().to(tl.int64))


@triton.jit
def kv_offsets(
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
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_HKV=next_pow2(num_kv_heads),
        num_warps=1 if num_kv_heads * head_dim <= 512 else 4,
    )  # fmt: skip
