"""Rotary position embedding on q and k in place, after Qwen3's per-head q/k RMSNorm where its
weights are given, as one Triton kernel (`rotary`), and its per-token body (`rope_token`) for
kernels that rotate their own rows (batch_kernel.py INVARIANT, `--deterministic`'s batch decode);
`rope_kv_head` the same for one KV head's q heads, key and value, summed first from a qkv
projection's fp32 partials, into the destinations the caller gives (the fixed-split token kernel's
ROPE, attention_fixed.py; batch_kernel.py ROPE_ITEMS).
Only the CUDA path of `engine.models.layers` imports this module (lazily, as fused_ops.py).

`rotary`: rope on q [T, H, D] and k [T, Hkv, D] in place, from the fp32 cos/sin cache and the
positions; with per-head weights it first applies Qwen3's q/k RMSNorm over head_dim. One program
per token handles all its q and k heads. Rounding follows Hugging Face's model-dtype rope: cos
and sin are rounded to the model dtype, then `x * cos + rotate_half(x) * sin` rounds each product
and the sum to the model dtype (what torch's elementwise ops do; in fp32 every rounding is exact
and this is plain fp32 rope). Compiled without FMA contraction, which would skip a rounding.
With `kv_store` the same program also writes the token's rotated K and its V into the paged
cache (attention.store_kv's writes, one launch a layer fewer: a Triton backend's `kv_target`).

A kernel that calls `rope_token` gives `rotary`'s bits when its blocks and warps are `rotary`'s
(`rotary_warps`): the q/k norm's sums of squares follow the layout. The launch's grid is fixed by
the input shapes: CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.attention import next_pow2
from engine.kernels.fused_ops import rounded, warps_for
from engine.kernels.grid_phases import part_sum
from engine.kernels.launcher import Launcher


@triton.jit
def _norm_rope_heads(
    ptr,  # this token's first head
    stride_h, num_heads, w_ptr, cos, sin, inv_d, eps,
    HAS_NORM: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    # cos, sin: [1, BLOCK_D] fp32, already rounded to the model dtype.
    dtype = ptr.dtype.element_ty
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < num_heads) & (d < HALF)
    p1 = ptr + h * stride_h + d  # first half of each head; the second is HALF further
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        ss = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
        rstd = tl.math.rsqrt(ss * inv_d + eps)[:, None]
        w1 = tl.load(w_ptr + d, mask=d < HALF, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + d, mask=d < HALF, other=0.0).to(tl.float32)
        x1 = rounded(w1 * rounded(x1 * rstd, dtype), dtype)
        x2 = rounded(w2 * rounded(x2 * rstd, dtype), dtype)
    o1 = (rounded(x1 * cos, dtype) - rounded(x2 * sin, dtype)).to(dtype)
    o2 = (rounded(x2 * cos, dtype) + rounded(x1 * sin, dtype)).to(dtype)
    tl.store(p1, o1, mask=mask)
    tl.store(p1 + HALF, o2, mask=mask)
    return o1, o2  # [BLOCK_H, BLOCK_D] each: the heads' halves as stored


@triton.jit
def rope_token(
    t, q_ptr, k_ptr, pos_ptr, cache_ptr, qw_ptr, kw_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cache, stride_vt, stride_vh, stride_cslot, stride_chead,
    num_q_heads, num_k_heads, inv_d, eps,
    HAS_NORM: tl.constexpr, HALF: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, STORE: tl.constexpr,
):  # fmt: skip
    # Token t (int64) of `_rotary_kernel`'s arguments: its q and k heads normed (HAS_NORM) and
    # rotated in place, its rotated K and its V into the cache (STORE). Also the `--deterministic`
    # batch decode's (batch_kernel.py INVARIANT), which must give these bits: the same block
    # shapes at the same warps reduce in the same order.
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_D)[None, :]
    dtype = q_ptr.dtype.element_ty
    c_ptr = cache_ptr + pos * stride_cache + d
    cos = rounded(tl.load(c_ptr, mask=d < HALF, other=0.0), dtype)
    sin = rounded(tl.load(c_ptr + HALF, mask=d < HALF, other=0.0), dtype)
    _norm_rope_heads(
        q_ptr + t * stride_qt, stride_qh, num_q_heads, qw_ptr, cos, sin, inv_d, eps,
        HAS_NORM, HALF, BLOCK_HQ, BLOCK_D,
    )  # fmt: skip
    k1, k2 = _norm_rope_heads(
        k_ptr + t * stride_kt, stride_kh, num_k_heads, kw_ptr, cos, sin, inv_d, eps,
        HAS_NORM, HALF, BLOCK_HK, BLOCK_D,
    )  # fmt: skip
    if STORE:  # the token's rotated K and its V into the cache (attention.store_kv's writes)
        slot = tl.load(slot_ptr + t)
        if slot >= 0:
            h = tl.arange(0, BLOCK_HK)[:, None]
            mask = (h < num_k_heads) & (d < HALF)
            dst = slot * stride_cslot + h * stride_chead + d  # first half of each head
            cache_dtype = k_cache_ptr.dtype.element_ty
            tl.store(k_cache_ptr + dst, k1.to(cache_dtype), mask=mask)
            tl.store(k_cache_ptr + dst + HALF, k2.to(cache_dtype), mask=mask)
            v_src = v_ptr + t * stride_vt + h * stride_vh + d
            tl.store(v_cache_ptr + dst, tl.load(v_src, mask=mask).to(cache_dtype), mask=mask)
            tl.store(v_cache_ptr + dst + HALF, tl.load(v_src + HALF, mask=mask).to(cache_dtype), mask=mask)


@triton.jit
def rope_kv_head(
    t, g, part_ptr, stride_part, dq_ptr, dk_ptr, dv_ptr, pos_ptr, cache_ptr, qw_ptr, kw_ptr, k_cache_ptr, v_cache_ptr,
    slot_ptr, stride_cache, stride_cslot, stride_chead, inv_d, eps,
    KS: tl.constexpr, NH: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr, HAS_NORM: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
):  # fmt: skip
    # Token t's KV head g of a qkv projection left as KS fp32 partials (part [KS, *, QKV] at
    # stride_part; `--deterministic`'s batch decode, batch_kernel.py ROPE_LATER and ROPE_ITEMS): its
    # GROUP = NH / NKV query heads, its key and its value summed in chunk order and rounded into
    # dq [GROUP, D], dk [D] and dv [D] (batch_kernel.py phase 7's sums), then `rope_token` on those
    # GROUP q heads and one k head: normed and rotated in place, the rotated K and the V stored at
    # t's slot, in the rotary kernel's blocks (BLOCK_HQ / BLOCK_HK rows), so in its bits: a row's
    # sum of squares does not follow which rows of the block hold heads. The program's own later
    # loads of dq..dv and of the cache see these stores (CTA barriers). dq..dv pass through the
    # unrotated sums: no other program may read or write them meanwhile.
    QKV: tl.constexpr = (NH + 2 * NKV) * D
    GROUP: tl.constexpr = NH // NKV
    HALF: tl.constexpr = D // 2
    BLOCK_Q: tl.constexpr = triton.next_power_of_2(GROUP * D)
    dtype = dq_ptr.dtype.element_ty
    row = t.to(tl.int64) * QKV
    offs_q = tl.arange(0, BLOCK_Q)
    q_ok = offs_q < GROUP * D
    tl.store(dq_ptr + offs_q, part_sum(part_ptr, row + g * (GROUP * D) + offs_q, q_ok, stride_part, KS).to(dtype), mask=q_ok)
    offs_d = tl.arange(0, D)
    ik = row + NH * D + g * D + offs_d  # its key; its value NKV heads further
    tl.store(dk_ptr + offs_d, part_sum(part_ptr, ik, ik >= 0, stride_part, KS).to(dtype))
    tl.store(dv_ptr + offs_d, part_sum(part_ptr, ik + NKV * D, ik >= 0, stride_part, KS).to(dtype))
    tl.debug_barrier()  # the sums, stored by every thread, read back by others
    rope_token(  # on dq..dv (no token stride), the cache at head g
        t.to(tl.int64), dq_ptr, dk_ptr, pos_ptr, cache_ptr, qw_ptr, kw_ptr, dv_ptr, k_cache_ptr + g * stride_chead,
        v_cache_ptr + g * stride_chead, slot_ptr, 0, D, 0, D, stride_cache, 0, D, stride_cslot, stride_chead, GROUP, 1,
        inv_d, eps, HAS_NORM, HALF, HALF, BLOCK_HQ, BLOCK_HK, True,
    )  # fmt: skip
    tl.debug_barrier()  # q rotated and the new K/V row stored, for the attention's loads


def rotary_warps(num_heads: int, head_dim: int) -> int:
    """The warps of `rotary`'s program (a token's q heads, [BLOCK_HQ, BLOCK_D]): a kernel that
    calls `rope_token` with others gives other bits where the q/k norm reduces."""
    return max(1, min(8, warps_for(next_pow2(num_heads) * next_pow2(head_dim // 2))))


@Launcher
@triton.jit
def _rotary_kernel(
    q_ptr,  # [T, H, D], last dim contiguous; rotated in place
    k_ptr,  # [T, Hkv, D]
    pos_ptr,  # [T] positions
    cache_ptr,  # [max_positions, D] fp32: cos | sin
    qw_ptr, kw_ptr,  # [D] per-head norm weights (read only when HAS_NORM)
    v_ptr,  # STORE: [T, Hkv, D] the new values, last dim contiguous
    k_cache_ptr, v_cache_ptr,  # STORE: [slots, Hkv, D] the layer's paged cache (blocks x block size slots)
    slot_ptr,  # STORE: [T] int64 each token's cache slot; -1 writes nothing
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cache, stride_vt, stride_vh, stride_cslot, stride_chead,
    num_q_heads, num_k_heads, inv_d, eps,
    HAS_NORM: tl.constexpr, HALF: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, STORE: tl.constexpr,
):  # fmt: skip
    rope_token(
        tl.program_id(0).to(tl.int64), q_ptr, k_ptr, pos_ptr, cache_ptr, qw_ptr, kw_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_cache, stride_vt, stride_vh, stride_cslot, stride_chead,
        num_q_heads, num_k_heads, inv_d, eps, HAS_NORM, HALF, BLOCK_D, BLOCK_HQ, BLOCK_HK, STORE,
    )  # fmt: skip


def rotary(
    q: torch.Tensor,  # [T, H, D], last dim contiguous (a view of the qkv output is fine)
    k: torch.Tensor,  # [T, Hkv, D]
    positions: torch.Tensor,  # [T] int
    cos_sin_cache: torch.Tensor,  # [max_positions, D] fp32, contiguous
    q_weight: torch.Tensor | None = None,  # [D]: per-head RMSNorm of q before rope (Qwen3)
    k_weight: torch.Tensor | None = None,  # [D]: the same for k
    eps: float = 0.0,
    kv_store: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rope (after the per-head RMSNorm when weights are given) applied to q and k in place;
    returns them. `kv_store` = (v [T, Hkv, D], k_cache, v_cache [num_blocks, block_size, Hkv, D]
    contiguous, slot_mapping [T] int64): the same launch also writes each token's rotated K and
    its V into the cache at its slot (slot -1: nothing), as attention.store_kv would after it."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if q.stride(-1) != 1 or k.stride(-1) != 1 or cos_sin_cache.stride(-1) != 1:
        raise ValueError("rotary works in place: q, k and the cache need a contiguous last dim")
    if head_dim % 2 or k.shape[2] != head_dim or cos_sin_cache.shape[-1] != head_dim:
        raise ValueError(f"rotary: head dims q {head_dim}, k {k.shape[2]}, cache {cos_sin_cache.shape[-1]}")
    has_norm = q_weight is not None
    if has_norm != (k_weight is not None):
        raise ValueError("rotary: give both q and k norm weights or neither")
    if kv_store is not None:
        v, k_cache, v_cache, slots = kv_store
        if v.shape != k.shape or v.stride(-1) != 1 or slots.shape != (num_tokens,):
            raise ValueError(f"rotary: v {tuple(v.shape)} (last dim contiguous) and slots {tuple(slots.shape)} "
                             f"for k {tuple(k.shape)}")  # fmt: skip
        if k_cache.shape != v_cache.shape or k_cache.shape[2:] != k.shape[1:] or not k_cache.is_contiguous():
            raise ValueError(f"rotary: caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} (contiguous "
                             f"[blocks, block_size, {num_kv_heads}, {head_dim}])")  # fmt: skip
        store = (v, k_cache, v_cache, slots, v.stride(0), v.stride(1), k_cache.stride(1), k_cache.stride(2))
    else:
        store = (q, q, q, positions, 0, 0, 0, 0)  # not read
    if num_tokens == 0:
        return q, k
    half = head_dim // 2
    block_d = next_pow2(half)
    block_hq = next_pow2(num_heads)
    _rotary_kernel[(num_tokens,)](
        q, k, positions, cos_sin_cache,
        q_weight if has_norm else q, k_weight if has_norm else k, *store[:4],
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0), *store[4:],
        num_heads, num_kv_heads, 1.0 / head_dim, eps,
        HAS_NORM=has_norm, HALF=half, BLOCK_D=block_d,
        BLOCK_HQ=block_hq, BLOCK_HK=next_pow2(num_kv_heads), STORE=kv_store is not None,
        num_warps=rotary_warps(num_heads, head_dim),
        # No FMA contraction: the compiler narrows `round(x1 * cos) - round(x2 * sin)` to bf16
        # ops and would fuse a multiply into the subtraction, skipping a rounding torch does
        # (seen on an H200: 19% of bf16 outputs one ULP off).
        enable_fp_fusion=False,
    )  # fmt: skip
    return q, k
