"""Triton kernels that fuse the decoder's small ops, and their launchers. Only the CUDA path of
`engine.models.layers` imports this module (lazily, on the first CUDA tensor a fused layer sees),
so a CPU install never imports Triton.

Each kernel computes what the torch code in layers.py computes, rounding where it rounds, so the
results are the same bits or within one bfloat16 ULP of them (reduction order differs):
- `rms_norm`: x / rms(x) with the normalisation in fp32, cast to the model dtype, then times the
  weight in the model dtype (Hugging Face's `weight * x.to(dtype)`). One program per row.
- `fused_add_rms_norm`: residual += x in the model dtype (in place, one rounding as the unfused
  `residual + x`), then `rms_norm` of the new residual. One kernel, one read of each input. x may
  also be a row-parallel linear's fp32 partial sums [KS, T, N] (splitk_linear.py): summed and
  rounded to the model dtype first, where the unfused linear rounds its output.
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
from engine.kernels.attention import next_pow2
from engine.kernels.launcher import Launcher

# libdevice's expf, as torch's CUDA silu calls; Triton's interpreter (TRITON_INTERPRET=1, for
# CPU checks of these kernels) has no libdevice, so it gets tl.exp.
_LIBDEVICE_EXP = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") != "1")


def warps_for(elements: int) -> int:
    """Warps for a program that holds `elements` values: about 8 per thread, 1..16 warps."""
    return max(1, min(16, next_pow2(elements) // 256))


@triton.jit
def rounded(x, DTYPE: tl.constexpr):
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
    xn = rounded(xf * rstd, dtype)
    tl.store(out_ptr + row * stride_o + offs, (w * xn).to(dtype), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., N] as a 2-D [rows, N] with a unit last stride (a view when possible)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def norm_warps(n: int) -> int:
    """The warps of the RMSNorm's program (a row of n): a kernel that norms a row with others
    may sum its squares in another order."""
    return warps_for(next_pow2(n))


def _launch_norm(x2, res2, weight, out2, eps, has_residual, parts: int = 1):
    # x2 [T, N], or [parts, T, N] fp32 partial sums (parts > 1)
    rows, n = x2.shape[-2:]
    if rows == 0:
        return
    block = next_pow2(n)
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


# ---- SiLU and multiply --------------------------------------------------------------------------


@triton.jit
def silu_mul(gate, up, dtype: tl.constexpr):
    """silu(gate) * up, rounded as layers.SiluAndMul rounds (gate, up: fp32 values of the model
    dtype `dtype`): `silu_and_mul`'s arithmetic, and invariant_matmul's gate_up epilogue's."""
    if _LIBDEVICE_EXP:
        e = libdevice.exp(-gate)
    else:
        e = tl.exp(-gate)
    act = rounded(tl.math.div_rn(gate, 1.0 + e), dtype)
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
    block = min(1024, next_pow2(n))
    _silu_and_mul_kernel[(rows, triton.cdiv(n, block))](
        x2, out, x2.stride(0), out.stride(0), n, BLOCK=block, num_warps=warps_for(block)
    )
    return out.view(*x.shape[:-1], n)
