"""The row-parallel linears (o_proj, down_proj) of 1-64 rows as fp32 partial sums over K splits,
which the RMSNorm after them adds up (fused_ops.fused_add_rms_norm takes [KS, T, N] parts): no
reduce launch, and no program re-reads all of x from L2 (what makes skinny_linear.py lose past 16
rows). The qkv projection of 1-16 rows too, where the layers' decode attention reads it
(engine/decode/decode_attention.py: engine/kernels/rope_decode.py sums the parts and adds the bias).
Only CUDA code paths import this module (it imports Triton).

    parts [KS, M, N] fp32 = x [M, K] @ weight [N, K].T, K in KS chunks          splitk_parts(x, w)
    parts [KS, R, N], rows M..R-1 unwritten (R >= M: a fixed stride)          splitk_parts(x, w, rows=R)

Rules (`config`: KS and BLOCK_N from the rows and the weight's shape):
- For 17..64 rows of a half-precision x and weights wide enough that the KS x N / BLOCK_N programs
  fill the GPU (at least 15/16 of its SMs): Qwen3-8B's o_proj (4096 x 4096) and down_proj
  (4096 x 12288) at batch 17-64. Narrower layers would leave SMs idle; qkv and gate_up (not
  row-parallel, no norm after them) stay on cuBLAS, which reads them as fast (bench/history/2026-11-27.md, the split-K rows probe, H200, 64 rows: o_proj 11.15 us against
  cuBLAS's 12.43, down_proj 28.0 against 31.8 with cuBLAS's own split-K reduce; qkv 16.2 and
  gate_up 50.3 on cuBLAS against 18.6 and 58.4 here).
- For 1..16 rows (skinny_linear's), FEW_BLOCK_N columns a program and K cut in the fewest chunks
  (2 or FEW_MAX_KS, the counts measured) that make two programs an SM (15/16 of them): two weight
  streams an SM, where skinny_linear runs one program of 16-32 columns over all of K. H200, one
  row, us a call from CUDA graphs over weights beyond L2 (bench/history/2026-12-01.md, entry g):
  30B-A3B's o_proj (2048 x 4096, KS 4) 7.33 against skinny 10.37 and cuBLAS 9.06; the 8B's
  o_proj (KS 2) 11.26 against 12.53 / 13.65, its down_proj (KS 2) 29.12 against 32.70 / 32.52.
  The same rule for a qkv weight (`qkv_chunks`): 30B-A3B's (5120 x 2048, KS 2) 8.07 against
  skinny 9.36 and cuBLAS 8.37, the 8B's (6144 x 4096, KS 2) 15.47 against 16.65 / 17.44
  (bench/history/2026-12-01.md, entry h). Past 16 rows qkv stays on cuBLAS (above).
- One program per (BLOCK_N columns, K chunk), BLOCK_K = 128, 4 stages in flight, fp32 tl.dot:
  the sum of the parts is cuBLAS's product up to the order of fp32 sums; the norm rounds it to
  the model dtype where the unfused layers round the linear's output.
- No bias (the norm adds none). Launched plainly (the attention or the gate_up GEMM before it is
  bandwidth-bound: a prefetch would only take its bandwidth, engine/kernels/pdl.py); it triggers its
  dependents at once, so the RMSNorm after it (a PDL launch) is scheduled while it streams.
- Grid and output fixed by the shapes: CUDA-graph capturable.

`--no-splitk-linear` (engine/kernels SWITCHES.splitk_linear) keeps every such linear on cuBLAS.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from engine.kernels import SWITCHES, pdl, skinny_linear

MAX_ROWS = 64
KS, BLOCK_N, BLOCK_K, NUM_WARPS, NUM_STAGES = 2, 64, 128, 4, 4  # 17..64 rows
FEW_BLOCK_N, FEW_MAX_KS, FEW_PER_SM = 32, 4, 2  # 1..16 rows


@triton.jit(do_not_specialize=["M", "R"])
def _splitk_kernel(
    x_ptr,  # [M, K] contiguous
    w_ptr,  # [N, K] contiguous
    part_ptr,  # [KS, R, N] fp32, R >= M
    M, R, N, K,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, KS: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    # Program (column tile n, K chunk c): part[c, :, tile] = x[:, chunk c] @ w[tile, chunk c].T.
    if USE_PDL:  # engine/kernels/pdl.py: the norm after it gets scheduled now and waits for all of it
        tl.extra.cuda.gdc_launch_dependents()
    n = tl.program_id(0)
    c = tl.program_id(1)
    chunk = K // KS
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = c * chunk + tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    x_ptrs = x_ptr + offs_m[:, None] * K + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * K + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, chunk, BLOCK_K):
        x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
        acc = tl.dot(x, tl.trans(tl.load(w_ptrs)), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    tl.store(part_ptr + (c * R + offs_m)[:, None] * N + offs_n[None, :], acc, mask=m_ok[:, None])


@functools.cache  # asked by `applies` and again by `splitk_parts` for the same call
def config(m: int, n: int, k: int, sms: int) -> tuple[int, int] | None:
    """(KS, BLOCK_N) of a row-parallel linear of m rows and weight [N, K] on `sms` SMs (rules
    above), or None where it stays off the parts."""
    if skinny_linear.MAX_ROWS < m <= MAX_ROWS:
        ks, block_n, programs = KS, BLOCK_N, sms * 15 // 16
    elif 0 < m <= skinny_linear.MAX_ROWS:
        block_n, programs = FEW_BLOCK_N, FEW_PER_SM * sms * 15 // 16
        ks = 2 if 2 * (n // block_n) >= programs else FEW_MAX_KS
    else:
        return None
    fits = k % (ks * BLOCK_K) == 0 and n % block_n == 0 and ks * (n // block_n) >= programs
    return (ks, block_n) if fits else None


def _config_of(x: torch.Tensor, weight: torch.Tensor) -> tuple[int, int] | None:
    """`config` of x [M, K] and weight [N, K] on x's GPU."""
    return config(x.shape[0], weight.shape[0], x.shape[1], skinny_linear.num_sms(x.device.index or 0))


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a row-parallel linear of x [M, K] and weight [N, K] returns parts here (rules above)."""
    return (
        SWITCHES.splitk_linear and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype
        and weight.is_contiguous() and _config_of(x, weight) is not None
    )  # fmt: skip


def qkv_chunks(x: torch.Tensor, weight: torch.Tensor) -> int | None:
    """KS of a qkv projection of x [M, K] and weight [N, K] as parts (1-16 rows, the rules
    above), or None where it stays on the layer's own linear."""
    if x.shape[0] > skinny_linear.MAX_ROWS or not applies(x, weight):
        return None
    return _config_of(x, weight)[0]


def splitk_parts(x: torch.Tensor, weight: torch.Tensor, rows: int | None = None) -> torch.Tensor:
    """[KS, R, N] fp32 partial sums of x [M, K] @ weight [N, K].T (`applies` must hold); R = `rows`
    (at least M; rows past M unwritten), else M."""
    x = x.contiguous()  # the kernel indexes x [M, K] by row * K
    m, k = x.shape
    n = weight.shape[0]
    r = m if rows is None else rows
    if r < m:
        raise ValueError(f"splitk_parts: {r} rows of parts for {m} rows of x")
    ks, block_n = _config_of(x, weight)
    parts = torch.empty(ks, r, n, dtype=torch.float32, device=x.device)
    _splitk_kernel[(n // block_n, ks)](
        x, weight, parts, m, r, n, k, BLOCK_M=skinny_linear.block_m(m), BLOCK_N=block_n, BLOCK_K=BLOCK_K, KS=ks,
        USE_PDL=pdl.enabled(x.device), num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )  # fmt: skip
    return parts
