"""Linear layers for few rows (decode steps): a Triton matmul that reads each weight once at
close to the copy bandwidth, where cuBLAS's kernels for small M reach a third of it (profile of
the 0.6B decode step at batch 1: the per-layer GEMVs at 1.0-1.5 TB/s of 4.2). Only the CUDA path
of `engine.models.layers` imports this module.

    y [M, N] = x [M, K] @ weight [N, K].T (+ bias [N])              skinny_linear(x, w, b)
    y [M, I] = silu(x @ w[:I].T) * (x @ w[I:].T)   (w = gate | up)    skinny_linear(x, w, b, silu_mul=True)

Rules:
- For few rows of a half-precision x (bf16/fp16); `applies` says whether a call may use it. fp32
  models keep cuBLAS (a tensor-core dot would round fp32 inputs to tf32).
- One program per BLOCK_N output columns over all of K (no split-K: no second kernel, no
  atomics), K in BLOCK_K = 128 steps, 5 stages in flight (the best of bench/kernels/linear.py's sweep). Accumulation in fp32,
  bias added in fp32, one rounding to the model dtype: the result is cuBLAS's up to the order of
  the sum.
- `silu_mul`: the gate and up columns of a packed gate_up weight are computed by the same
  program and the activation is applied in the epilogue with the rounding of the unfused ops
  (gate and up rounded to the model dtype, then fused_ops.silu_mul: silu in fp32 with libdevice's
  expf and an IEEE division, rounded; times up, rounded): the [M, 2I] intermediate is never written.
- Grid and output are fixed by the shapes: CUDA-graph capturable.
- `prefetch` (on Hopper; engine/kernels/pdl.py): launched with PDL, the kernel prefetches the
  first columns of its weight rows (up to pdl.PREFETCH_BYTES in all) into L2 before it waits for x.
  For the GEMVs after a norm (qkv, gate_up): the norm, or at TP > 1 the cross-rank reduce, is
  one latency-bound program per row and leaves HBM idle. Between back-to-back GEMVs it would
  only take bandwidth from the running one (bench/kernels/linear.py: slower), so they launch plainly.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from engine.kernels import fused_ops, pdl
from engine.kernels.launcher import Launcher

# Rows up to which layers use the skinny kernel (bench/kernels/linear.py, H200, the 0.6B and 8B
# layer shapes in CUDA graphs): up to 16 rows it matches cuBLAS or beats it (2.1x on 0.6B's o_proj
# at one row, 1.2-1.3x on gate_up with its activation); at 32-64 rows cuBLAS's tiled GEMMs win.
MAX_ROWS = 16
# What the kernel itself accepts (benchmarks and tests go past the policy).
KERNEL_MAX_ROWS = 64
# The logits' tiles (block_n, block_k, warps, stages) for a vocabulary-sized N: at 1-16 rows of
# Qwen3-0.6B's and 8B's lm_head (152k x 1024 / 4096) 4-6 % faster than cuBLAS, which the default
# rule's 32-column tiles are not at 8B (the lm_head probe, H200, bench/history/2026-11-25.md).
LOGITS_CONFIG = dict(block_n=128, block_k=128, num_warps=8, num_stages=3)


def applies(x: torch.Tensor, max_rows: int = MAX_ROWS) -> bool:
    """Whether layers run `skinny_linear` on x [M, K]: CUDA, half precision, 1 <= M <= max_rows."""
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and 0 < x.shape[0] <= max_rows


@functools.cache
def num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def block_m(m: int) -> int:
    return max(16, 1 << (m - 1).bit_length())  # tl.dot needs at least 16 rows


def _block_n(n: int, sms: int) -> int:
    """32 columns per program while that keeps half the SMs busy, else 16 (the sweep's best)."""
    return 32 if triton.cdiv(n, 32) >= sms // 2 else 16


@Launcher
@triton.jit(do_not_specialize=["M"])  # one variant per BLOCK_M, whatever the batch
def _skinny_kernel(
    x_ptr,  # [M, K], unit last stride
    w_ptr,  # [N_W, K], contiguous: N_W = N, or 2N (gate | up) with SILU_MUL
    b_ptr,  # [N_W] (read only when HAS_BIAS)
    out_ptr,  # [M, N]
    M, N, K, stride_xm, stride_om,
    HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr, PREFETCH_LINES: tl.constexpr, LINE: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    rows_n = offs_n.to(tl.int64)
    if USE_PDL:
        # engine/kernels/pdl.py: the weights are no kernel's output, so this program's first
        # PREFETCH_LINES lines of each weight row go to L2 while the previous kernel runs.
        if PREFETCH_LINES > 0:
            rows = tl.minimum(rows_n, N - 1)[:, None] * K
            lines = (tl.arange(0, PREFETCH_LINES) * LINE)[None, :]
            pdl.prefetch_l2(w_ptr + rows + lines)
            if SILU_MUL:
                pdl.prefetch_l2(w_ptr + N.to(tl.int64) * K + rows + lines)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    w_ptrs = w_ptr + rows_n[:, None] * K + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
    up_ptrs = w_ptrs + N.to(tl.int64) * K  # the up half of a gate | up weight
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
        else:
            k_ok = (k0 + offs_k) < K
            x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
        if SILU_MUL:
            if EVEN_K:
                u = tl.load(up_ptrs, mask=n_ok[:, None], other=0.0)
            else:
                u = tl.load(up_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            acc_up = tl.dot(x, tl.trans(u), acc_up)
            up_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    dtype = out_ptr.dtype.element_ty
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if SILU_MUL:
            acc_up += tl.load(b_ptr + N + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if SILU_MUL:
        acc = fused_ops.silu_mul(acc.to(dtype).to(tl.float32), acc_up.to(dtype).to(tl.float32), dtype)  # the rounded outputs
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(dtype), mask=m_ok[:, None] & n_ok[None, :])


def skinny_linear(
    x: torch.Tensor,  # [M, K], M <= KERNEL_MAX_ROWS, bf16/fp16
    weight: torch.Tensor,  # [N, K] ([2I, K] gate | up with silu_mul), contiguous
    bias: torch.Tensor | None = None,  # [N] ([2I])
    silu_mul: bool = False,
    block_n: int | None = None,  # tuning overrides (bench); None: the rule above
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    prefetch: bool = False,  # launch with PDL and prefetch weights: for a GEMV right after a norm
    out: torch.Tensor | None = None,  # [M, N] contiguous rows: written in place (a graph's static buffer)
) -> torch.Tensor:  # [M, N] ([M, I] with silu_mul)
    if x.dim() != 2 or not applies(x, KERNEL_MAX_ROWS):
        raise ValueError(f"skinny_linear: x must be a CUDA bf16/fp16 [M, K] with 1 <= M <= {KERNEL_MAX_ROWS}, got {tuple(x.shape)} {x.dtype}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    if not weight.is_contiguous() or weight.dtype != x.dtype or weight.shape[1] != x.shape[1]:
        raise ValueError(f"skinny_linear: weight {tuple(weight.shape)} {weight.dtype} for x {tuple(x.shape)} {x.dtype}")
    m, k = x.shape
    n = weight.shape[0] // 2 if silu_mul else weight.shape[0]
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    elif out.shape != (m, n) or out.dtype != x.dtype or out.stride(-1) != 1:
        raise ValueError(f"skinny_linear: out {tuple(out.shape)} {out.dtype} for an [{m}, {n}] {x.dtype} result")
    block_n = block_n or _block_n(n, num_sms(x.device.index or 0))
    block_k = block_k or (128 if k >= 128 else max(16, 1 << (k - 1).bit_length()))
    programs = triton.cdiv(n, block_n)
    use_pdl = pdl.enabled(x.device)
    line = pdl.LINE_BYTES // x.element_size()  # elements a line
    _skinny_kernel[(programs,)](
        x, weight, bias if bias is not None else weight, out,
        m, n, k, x.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, SILU_MUL=silu_mul, EVEN_K=k % block_k == 0,
        BLOCK_M=block_m(m), BLOCK_N=block_n, BLOCK_K=block_k,
        USE_PDL=use_pdl, LINE=line,
        PREFETCH_LINES=pdl.prefetch_lines(weight.numel() * x.element_size(), k, line) if prefetch else 0,
        num_warps=num_warps or 4, num_stages=num_stages or 5, launch_pdl=use_pdl and prefetch,
    )  # fmt: skip
    return out
