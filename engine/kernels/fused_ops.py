"""Triton kernels that fuse the decoder's small ops, and their launchers. Only the CUDA path of
`engine.models.layers` imports this module (lazily, on the first CUDA tensor a fused layer sees),
so a CPU install never imports Triton.

Each kernel computes what the torch code in layers.py and rotary.py computes, rounding where it rounds, so the
results are the same bits or within one bfloat16 ULP of them (reduction order differs):
- `rms_norm`: x / rms(x) with the normalisation in fp32, cast to the model dtype, then times the
  weight in the model dtype (Hugging Face's `weight * x.to(dtype)`). One program per row.
- `fused_add_rms_norm`: residual += x in the model dtype (in place, one rounding as the unfused
  `residual + x`), then `rms_norm` of the new residual. One kernel, one read of each input. x may
  also be a row-parallel linear's fp32 partial sums [KS, T, N] (splitk_linear.py): summed and
  rounded to the model dtype first, where the unfused linear rounds its output.
- `rotary`: rope on q [T, H, D] and k [T, Hkv, D] in place, from the fp32 cos/sin cache and the
  positions; with per-head weights it first applies Qwen3's q/k RMSNorm over head_dim. One program
  per token handles all its q and k heads. Rounding follows Hugging Face's model-dtype rope: cos
  and sin are rounded to the model dtype, then `x * cos + rotate_half(x) * sin` rounds each product
  and the sum to the model dtype (what torch's elementwise ops do; in fp32 every rounding is exact
  and this is plain fp32 rope). Compiled without FMA contraction, which would skip a rounding.
  With `kv_store` the same program also writes the token's rotated K and its V into the paged
  cache (attention.store_kv's writes, one launch a layer fewer: a Triton backend's `kv_target`).
- `silu_and_mul`: [T, 2I] (gate | up) -> silu(gate) * up [T, I]; silu in fp32 with an IEEE
  division and libdevice's expf (as torch's CUDA kernel), rounded to the model dtype, then times
  up, rounded.

Every launch has a grid fixed by the input shapes and allocates at most its output: all are
CUDA-graph capturable. Row offsets are int64, so any number of tokens works.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from engine.kernels import pdl
from engine.kernels.launcher import Launcher

# libdevice's expf, as torch's CUDA silu calls; Triton's interpreter (TRITON_INTERPRET=1, for
# CPU checks of these kernels) has no libdevice, so it gets tl.exp.
_LIBDEVICE_EXP = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") != "1")


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _warps(elements: int) -> int:
    """Warps for a program that holds `elements` values: about 8 per thread, 1..16 warps."""
    return max(1, min(16, _next_pow2(elements) // 256))


@triton.jit
def _round(x, DTYPE: tl.constexpr):
    # Round fp32 values to the model dtype and back: the rounding a torch op in that dtype does.
    return x.to(DTYPE).to(tl.float32)


# ---- RMSNorm (plain and fused with the residual add) --------------------------------------------


@Launcher
@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [T, N]; [KS, T, N] fp32 partial sums with KS > 1 (splitk_linear.py)
    res_ptr,  # [T, N]: residual, updated in place (read only when HAS_RESIDUAL)
    w_ptr,  # [N]
    out_ptr,  # [T, N]
    stride_x, stride_r, stride_o, stride_part,
    n_cols, inv_n, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr, KS: tl.constexpr = 1,
):  # fmt: skip
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # a weight: no kernel's output, loaded before the wait
    if USE_PDL:  # engine/kernels/pdl.py: scheduled while the kernel before ends; the GEMV after it prefetches now
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if KS > 1:  # the linear's output: its parts summed, rounded where the unfused linear rounds
        x = x.to(tl.float32)
        for c in tl.static_range(1, KS):
            x += tl.load(x_ptr + c * stride_part + row * stride_x + offs, mask=mask, other=0.0)
        x = x.to(dtype)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)
        tl.store(res_ptr + row * stride_r + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=0) * inv_n + eps)
    xn = _round(xf * rstd, dtype)
    tl.store(out_ptr + row * stride_o + offs, (w * xn).to(dtype), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., N] as a 2-D [rows, N] with a unit last stride (a view when possible)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def norm_warps(n: int) -> int:
    """The warps of the RMSNorm's program (a row of n): a kernel that norms a row with others
    may sum its squares in another order."""
    return _warps(_next_pow2(n))


def _launch_norm(x2, res2, weight, out2, eps, has_residual, parts: int = 1):
    # x2 [T, N], or [parts, T, N] fp32 partial sums (parts > 1)
    rows, n = x2.shape[-2:]
    if rows == 0:
        return
    block = _next_pow2(n)
    use_pdl = pdl.enabled(x2.device)
    _rms_norm_kernel[(rows,)](
        x2, res2, weight, out2,
        x2.stride(-2), res2.stride(0), out2.stride(0), x2.stride(0) if parts > 1 else 0,
        n, 1.0 / n, eps,
        HAS_RESIDUAL=has_residual, BLOCK=block, USE_PDL=use_pdl, KS=parts, num_warps=norm_warps(n), launch_pdl=use_pdl,
    )  # fmt: skip


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [..., N] over its last dim; a new tensor of x's shape and dtype."""
    x2 = _rows(x)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    _launch_norm(x2, x2, weight, out, eps, False)
    return out.view(x.shape)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual += x (in place), then (rms_norm(residual), residual). x, residual [T, N]; or x
    [KS, T, N] fp32, a row-parallel linear's partial sums (splitk_linear.py): x = round(sum of
    the parts) first."""
    if residual.stride(-1) != 1 or residual.dim() != 2:
        raise ValueError("fused_add_rms_norm updates the residual in place: it must be [T, N], last dim contiguous")
    if x.dim() == 3:
        if x.dtype != torch.float32 or x.shape[1:] != residual.shape or x.stride(-1) != 1:
            raise ValueError(f"fused_add_rms_norm: parts {tuple(x.shape)} {x.dtype} for a residual {tuple(residual.shape)}")
        out = torch.empty(residual.shape, dtype=residual.dtype, device=x.device)
        _launch_norm(x, residual, weight, out, eps, True, x.shape[0])
        return out, residual
    x2 = _rows(x)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    _launch_norm(x2, residual, weight, out, eps, True)
    return out.view(x.shape), residual


# ---- rotary embedding, optionally after the per-head q/k RMSNorm ---------------------------------


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
        x1 = _round(w1 * _round(x1 * rstd, dtype), dtype)
        x2 = _round(w2 * _round(x2 * rstd, dtype), dtype)
    o1 = (_round(x1 * cos, dtype) - _round(x2 * sin, dtype)).to(dtype)
    o2 = (_round(x2 * cos, dtype) + _round(x1 * sin, dtype)).to(dtype)
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
    cos = _round(tl.load(c_ptr, mask=d < HALF, other=0.0), dtype)
    sin = _round(tl.load(c_ptr + HALF, mask=d < HALF, other=0.0), dtype)
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


def rotary_warps(num_heads: int, head_dim: int) -> int:
    """The warps of `rotary`'s program (a token's q heads, [BLOCK_HQ, BLOCK_D]): a kernel that
    calls `rope_token` with others gives other bits where the q/k norm reduces."""
    return max(1, min(8, _warps(_next_pow2(num_heads) * _next_pow2(head_dim // 2))))


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
    block_d = _next_pow2(half)
    block_hq = _next_pow2(num_heads)
    _rotary_kernel[(num_tokens,)](
        q, k, positions, cos_sin_cache,
        q_weight if has_norm else q, k_weight if has_norm else k, *store[:4],
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0), *store[4:],
        num_heads, num_kv_heads, 1.0 / head_dim, eps,
        HAS_NORM=has_norm, HALF=half, BLOCK_D=block_d,
        BLOCK_HQ=block_hq, BLOCK_HK=_next_pow2(num_kv_heads), STORE=kv_store is not None,
        num_warps=rotary_warps(num_heads, head_dim),
        # No FMA contraction: the compiler narrows `round(x1 * cos) - round(x2 * sin)` to bf16
        # ops and would fuse a multiply into the subtraction, skipping a rounding torch does
        # (seen on an H200: 19% of bf16 outputs one ULP off).
        enable_fp_fusion=False,
    )  # fmt: skip
    return q, k


# ---- SiLU and multiply --------------------------------------------------------------------------


@triton.jit
def silu_mul(gate, up, dtype: tl.constexpr):
    """silu(gate) * up, rounded as layers.SiluAndMul rounds (gate, up: fp32 values of the model
    dtype `dtype`): `silu_and_mul`'s arithmetic, and invariant_matmul's gate_up epilogue's."""
    if _LIBDEVICE_EXP:
        e = libdevice.exp(-gate)
    else:
        e = tl.exp(-gate)
    act = _round(tl.math.div_rn(gate, 1.0 + e), dtype)
    return (act * up).to(dtype)


@Launcher
@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # [T, 2I]: gate | up
    out_ptr,  # [T, I]
    stride_x, stride_o, n_cols,
    BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_cols
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n_cols + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, silu_mul(gate, up, dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] (gate | up) -> silu(gate) * up [T, I]."""
    x2 = _rows(x)
    rows, n = x2.shape[0], x2.shape[1] // 2
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows == 0 or n == 0:
        return out.view(*x.shape[:-1], n)
    block = min(1024, _next_pow2(n))
    _silu_and_mul_kernel[(rows, triton.cdiv(n, block))](
        x2, out, x2.stride(0), out.stride(0), n, BLOCK=block, num_warps=_warps(block)
    )
    return out.view(*x.shape[:-1], n)
