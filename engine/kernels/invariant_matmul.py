"""A batch-invariant half-precision GEMM: row r of the output is bit for bit the same whatever the
number of rows M and whatever the other rows hold, the CUDA counterpart of engine/models/invariant.py's
block linear (`--deterministic`). Only CUDA code paths import this module (it imports Triton).

    y [M, N] = x [M, K] @ weight [N, K].T          invariant_matmul(x, w, out=None)

Why cuBLAS is not: it picks its kernel, its tiles and its split of K by M (and by the other
sizes), so a row's fp32 sums over K run in an order, and round, that depend on the batch it
came in (issue 76). Rules that make this kernel invariant:
- One tile configuration (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) per weight shape (N, K):
  `config(n, k)`, a rule on N and K alone, never on M; no autotuning. So one compiled variant
  serves every M (M is not specialized: `do_not_specialize`), with one MMA instruction sequence.
- No split-K: each program owns one [BLOCK_M, BLOCK_N] output tile and walks all of K in
  ascending BLOCK_K steps into one fp32 accumulator (tensor-core dots, bf16/fp16 products exact
  in fp32), then rounds once to x's dtype. An output element is sum over k of x[r, k] w[n, k]:
  the MMA never mixes rows, so the other rows of a tile change nothing of row r's bits.
- Rows past M and columns past N read row M-1 / N-1 (no mask on those loads) and are never
  stored; a K that BLOCK_K does not divide masks its last step's columns to zero (fixed by K).
- Tiles are visited in groups of GROUP_M row tiles (L2 reuse of the weight at large M): which
  program computes a tile changes, how it computes it does not.
- Grid and output are fixed by the shapes, no host read of a device value: CUDA-graph capturable
  with a preallocated `out`. No PDL (no decode graph launches it yet).

The configuration rule (`config`), reasoned for an H100 / H200 (132 SMs, wgmma), not yet tuned
on one (bench/kernels/invariant_matmul.py times it against cuBLAS and `--sweep` ranks a grid of
configs per weight shape over all M at once, the only way a config may be chosen here):
- BLOCK_M = 64, 4 warps: one warp group, Hopper's smallest wgmma M. A decode step's few rows
  still compute one whole row tile, so a larger BLOCK_M only multiplies an M = 1 GEMV's
  tensor-core work (128 rows: 4.3 GFLOP for the 8B o_proj on the 32-64 SMs its column tiles
  occupy, about the time its 32 MiB weight takes to stream).
- Up to 64 rows the grid is cdiv(N, BLOCK_N) programs (no split-K to add more), so BLOCK_N
  trades M = 1 bandwidth (programs to stream the weight) against large-M intensity (MACs per
  loaded element): 128 columns where N >= WIDE_N (>= 64 column tiles; the 8B's gate_up and
  every lm_head have 192 and more), else 64 (the 8B's o_proj / down: 64 programs, the 0.6B's
  qkv 64, its o_proj / down 16: their weights are 2-6 MB).
- BLOCK_K = 64 and 4 stages: 24 KB of shared memory a stage at 64 x 128, two programs an SM.
  K < 64 (tiny test models) takes one step of K rounded up to a power of two (>= 16).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from engine.kernels.launcher import Launcher

BLOCK_M = 64  # rows of a tile: one warp group's wgmma M
WIDE_N = 8192  # N from which a tile is 128 columns wide, below it 64
GROUP_M = 8  # row tiles visited together: their programs share the weight's column tiles in L2


class Config(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def config(n: int, k: int) -> Config:
    """The one tile configuration of a weight [N = n, K = k], whatever the rows: the rule above."""
    block_n = min(128 if n >= WIDE_N else 64, max(16, triton.next_power_of_2(n)))
    block_k = 64 if k >= 64 else max(16, triton.next_power_of_2(k))
    return Config(BLOCK_M, block_n, block_k, num_warps=4, num_stages=4)


@Launcher
@triton.jit(do_not_specialize=["M"])  # one variant for every M: the same instructions for a row
def _invariant_matmul_kernel(
    x_ptr,  # [M, K], unit last stride
    w_ptr,  # [N, K], contiguous
    out_ptr,  # [M, N], unit last stride
    M, N, K, stride_xm, stride_om,
    EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n  # programs of a group of GROUP_M row tiles (the last group may be shorter)
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rows_x = tl.minimum(offs_m, M - 1).to(tl.int64)  # rows past M read row M - 1, never stored
    rows_w = tl.minimum(offs_n, N - 1).to(tl.int64)  # columns past N read row N - 1, never stored
    x_ptrs = x_ptr + rows_x[:, None] * stride_xm + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    w_ptrs = w_ptr + rows_w[:, None] * K + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # ascending, whatever M: the one order of every row's sums
        if EVEN_K:
            x = tl.load(x_ptrs)
            w = tl.load(w_ptrs)
        else:
            k_ok = (k0 + offs_k)[None, :] < K
            x = tl.load(x_ptrs, mask=k_ok, other=0.0)
            w = tl.load(w_ptrs, mask=k_ok, other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


def invariant_matmul(
    x: torch.Tensor,  # [M, K] bf16 (or fp16) CUDA, any M >= 0
    w: torch.Tensor,  # [N, K], x's dtype, contiguous (an nn.Linear's weight)
    out: torch.Tensor | None = None,  # [M, N] of x's dtype, unit last stride: written in place (a graph's buffer)
    cfg: Config | None = None,  # tuning override (bench/kernels/invariant_matmul.py --sweep); None: config(N, K)
) -> torch.Tensor:  # out: [M, N] = x @ w.T, fp32 sums rounded once
    if x.dim() != 2 or not x.is_cuda or x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"invariant_matmul: x must be a CUDA bf16/fp16 [M, K], got {tuple(x.shape)} {x.dtype} on {x.device}")
    m, k = x.shape
    if w.dim() != 2 or w.shape[1] != k or w.dtype != x.dtype or w.device != x.device or not w.is_contiguous():
        raise ValueError(f"invariant_matmul: w {tuple(w.shape)} {w.dtype} (contiguous [N, {k}] {x.dtype}) for x {tuple(x.shape)}")
    n = w.shape[0]
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    elif out.shape != (m, n) or out.dtype != x.dtype or out.device != x.device or out.stride(-1) != 1:
        raise ValueError(f"invariant_matmul: out {tuple(out.shape)} {out.dtype} for an [{m}, {n}] {x.dtype} result")
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    if x.stride(-1) != 1:
        x = x.contiguous()
    c = cfg or config(n, k)
    grid = (triton.cdiv(m, c.block_m) * triton.cdiv(n, c.block_n),)
    _invariant_matmul_kernel[grid](
        x, w, out, m, n, k, x.stride(0), out.stride(0),
        EVEN_K=k % c.block_k == 0, BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, GROUP_M=GROUP_M,
        num_warps=c.num_warps, num_stages=c.num_stages,
    )  # fmt: skip
    return out
