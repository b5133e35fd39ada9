"""A batch-invariant half-precision GEMM: row r of the output is bit for bit the same whatever the
number of rows M and whatever the other rows hold, the CUDA counterpart of engine/models/invariant.py's
block linear (`--deterministic`). Only CUDA code paths import this module (it imports Triton).

    y [M, N] = x [M, K] @ weight [N, K].T          invariant_matmul(x, w, out=None)

Why cuBLAS is not: it picks its kernel, its tiles and its split of K by M (and by the other
sizes), so a row's fp32 sums over K run in an order, and round, that depend on the batch it
came in (issue 76). Rules that make this kernel invariant:
- K's order (the chunks below) is fixed per weight shape (N, K): `config(n, k)`, a rule on N and
  K alone, never on M; no autotuning. M is not specialized (`do_not_specialize`). BLOCK_K may
  follow M where the weight is one chunk: the dots add K's 16-wide slices in order whatever it is.
- The output tile may follow M, the bits may not (`rows_tile`): up to FEW_ROWS rows (a decode
  step) run 16-row tiles (mma.sync m16n8k16, a quarter of a 64-row tile's loads), from
  MANY_ROWS (a prefill) tiles of two warp groups (128 x 128, 128 x 256, 256 x 128), between
  them 64-row tiles (wgmma), 128 rows high from MID_ROWS for a large weight.
  Each output element is the same 16-wide K slices of MMAs into fp32 in the same order whatever
  the tile, and on an H200 the instructions round a row's sums alike:
  tests/test_gpu_invariant_matmul.py crosses 16 -> 17, 100 -> 256 and 1000 -> 1100 -> 2100 rows with
  the Qwen3 shapes, bit for bit.
- K is cut into SPLIT_K chunks fixed by (N, K) (`config`), each a whole number of BLOCK_K steps.
  A chunk's partial sum starts from zero and walks its K in ascending BLOCK_K steps (tensor-core
  dots into fp32; bf16/fp16 products are exact in fp32); the output is
  ((p_0 + p_1) + p_2) + ... in fp32, rounded once to x's dtype. The MMA never mixes rows, so the
  other rows of a tile change nothing of row r's bits.
- Where that arithmetic runs may follow M, the bits may not: with fewer output tiles than a wave
  of one an SM (SPLIT_BELOW_TILES) each chunk is a program of its own, writing its fp32 partial to a
  workspace [SPLIT_K, M, N] (`SPLIT_PROGRAMS`: K's parallelism for a GEMV), and the tile's last
  chunk to arrive (`Arrivals`, split_kv.last_to_arrive) sums the tile's partials in chunk order;
  without `Arrivals` a second kernel sums them the same way. With many tiles one program walks
  every chunk of its tile and sums the same way: from WALK_CHUNKS chunks (3 from MANY_ROWS rows)
  in one loop over K that folds each chunk's partial into the sum as the chunk ends
  (`_walk_chunks`), so the loads run on across chunks; fewer chunks a pipeline each. The same
  partials, added in the same order, give the same bits every way.
- Tiles load through TMA descriptors on Hopper (`tma_loads`: 16-byte aligned tensors; not the
  programs of chunks shorter than TMA_SPLIT_STEPS), else through pointers: the same tiles. Rows
  past M and columns past N read zeros (TMA) or row M-1 / N-1 (pointers) and are never stored;
  a K that BLOCK_K does not divide reads its last step's columns past K as zeros (fixed by K).
- Tiles are visited in groups of GROUP_M row tiles (L2 reuse of the weight at large M): which
  program computes a tile changes, how it computes it does not.
- Grid and output are fixed by the shapes, no host read of a device value: CUDA-graph capturable
  with a preallocated `out`.
- `prefetch` (on Hopper; engine/kernels/pdl.py): launched with PDL, a program pulls the first
  PREFETCH_LINES lines of its chunk of its weight rows into L2 (the first row tile's programs
  only), waits for the kernel before, then releases the next: for the GEMMs right after a norm
  (qkv, gate_up, the lm_head), as skinny_linear.py's. Scheduling only: the same bits.

The tiles and K's chunks: engine/kernels/invariant_tiles.py; the chunk sums across programs and
their counters: engine/kernels/invariant_sums.py.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from engine.kernels import pdl
from engine.kernels.invariant_sums import SPLIT_BELOW_TILES, Arrivals, chunk_order_sum
from engine.kernels.invariant_tiles import MANY_ROWS, Config, chunking, config, rows_tile
from engine.kernels.launcher import Launcher
from engine.kernels.split_kv import last_to_arrive

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # Triton before 3.3: pointer loads only
    TensorDescriptor = None

GROUP_M = 8  # row tiles visited together: their programs share the weight's column tiles in L2
WALK_CHUNKS = 4  # a program walking this many chunks (3 from MANY_ROWS) walks them in one loop
# A program per chunk of fewer BLOCK_K steps loads through pointers: its TMA setup is not paid back
# (2026-11-30h: the 0.6B's o_proj and down, 8-step chunks, at 64 rows 1.21x / 1.10x cuBLAS with
# pointers, 1.42x / 1.40x with TMA; chunks of 13 steps and more, the 8B's, alike or faster).
TMA_SPLIT_STEPS = 12


@functools.cache
def _has_tma(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def tma_loads(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the tiles load through TMA descriptors: Hopper or later (or Triton's interpreter),
    16-byte aligned bases and row strides, rows that do not overlap (no broadcast rows). The bits
    are the pointer loads' either way."""
    aligned = all(t.data_ptr() % 16 == 0 and t.stride(0) * t.element_size() % 16 == 0 and t.stride(0) >= t.shape[1]
                  for t in (x, w))  # fmt: skip
    return TensorDescriptor is not None and aligned and (triton.knobs.runtime.interpret or _has_tma(x.device))


@triton.jit
def _step_tiles(x_ptrs, w_ptrs, k0, K, m0, n0, TMA: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """The x [BLOCK_M, BLOCK_K] and w [BLOCK_N, BLOCK_K] tiles of the K step at k0: TMA: from
    the descriptors at (m0, k0) and (n0, k0); else through the pointers (already at k0). Columns
    past K, and with TMA rows past M or N, read as zeros."""
    if TMA:
        x = x_ptrs.load([m0, k0])
        w = w_ptrs.load([n0, k0])
    elif EVEN_K:
        x = tl.load(x_ptrs)
        w = tl.load(w_ptrs)
    else:
        k_ok = (k0 + tl.arange(0, BLOCK_K))[None, :] < K
        x = tl.load(x_ptrs, mask=k_ok, other=0.0)
        w = tl.load(w_ptrs, mask=k_ok, other=0.0)
    return x, w


@triton.jit
def _chunk_sum(x_ptrs, w_ptrs, k_start, k_end, K, m0, n0, TMA: tl.constexpr, EVEN_K: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """One chunk's fp32 partial [BLOCK_M, BLOCK_N]: from zero, K ascending in BLOCK_K steps."""
    if not TMA:
        x_ptrs += k_start
        w_ptrs += k_start
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        x, w = _step_tiles(x_ptrs, w_ptrs, k0, K, m0, n0, TMA, EVEN_K, BLOCK_K)
        acc = tl.dot(x, tl.trans(w), acc)
        if not TMA:
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
    return acc


@triton.jit
def _walk_chunks(x_ptrs, w_ptrs, K, CHUNK_STEPS, m0, n0, TMA: tl.constexpr, EVEN_K: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """Every chunk's partial, summed in chunk order [BLOCK_M, BLOCK_N]: ((p_0 + p_1) + p_2) + ...,
    each p_c `_chunk_sum`'s (from zero, its K ascending). One loop over all of K, so the loads
    of the next chunk are in flight while a chunk ends (no pipeline drained and filled per chunk)."""
    steps = tl.cdiv(K, BLOCK_K)
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(0, steps):
        x, w = _step_tiles(x_ptrs, w_ptrs, step * BLOCK_K, K, m0, n0, TMA, EVEN_K, BLOCK_K)
        acc = tl.dot(x, tl.trans(w), acc)
        if not TMA:
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        if (step + 1) % CHUNK_STEPS == 0 or step == steps - 1:  # a chunk ends: p_0 as it is, then + p_c
            total = tl.where(step < CHUNK_STEPS, acc, total + acc)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    return total


@Launcher
@triton.jit(do_not_specialize=["M"])  # one variant for every M: the same instructions for a row
def _invariant_matmul_kernel(
    x_ptr,  # [M, K], unit last stride (TMA: its descriptor, [BLOCK_M, BLOCK_K] boxes)
    w_ptr,  # [N, K], contiguous (TMA: its descriptor, [BLOCK_N, BLOCK_K] boxes)
    out_ptr,  # [M, N], unit last stride
    ws_ptr,  # SPLIT_PROGRAMS: fp32 [CHUNKS, M, N], contiguous
    count_ptr,  # LAST_SUMS: int32 [tiles], zeros: the chunks arrived per tile (Arrivals)
    wp_ptr,  # [N, K]: the weight's pointer, TMA or not (the L2 prefetch's)
    M, N, K, stride_xm, stride_om, CHUNK_K,
    CHUNKS: tl.constexpr, SPLIT_PROGRAMS: tl.constexpr, LAST_SUMS: tl.constexpr, WALK: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, TMA: tl.constexpr,
    USE_PDL: tl.constexpr = False, PREFETCH_LINES: tl.constexpr = 0, LINE: tl.constexpr = 64,
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
    m0 = pid_m * BLOCK_M
    n0 = pid_n * BLOCK_N
    if USE_PDL:  # engine/kernels/pdl.py: the weights are no kernel's output
        if PREFETCH_LINES > 0 and pid_m == 0:
            k_first = tl.program_id(1) * CHUNK_K if SPLIT_PROGRAMS else 0
            cols = tl.minimum(k_first + tl.arange(0, PREFETCH_LINES) * LINE, K - 1)  # [PREFETCH_LINES]
            pdl.prefetch_l2(wp_ptr + tl.minimum(offs_n, N - 1).to(tl.int64)[:, None] * K + cols[None, :])
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if TMA:
        x_ptrs = x_ptr
        w_ptrs = w_ptr
    else:
        offs_k = tl.arange(0, BLOCK_K)
        rows_x = tl.minimum(offs_m, M - 1).to(tl.int64)  # rows past M read row M - 1, never stored
        rows_w = tl.minimum(offs_n, N - 1).to(tl.int64)  # columns past N read row N - 1, never stored
        x_ptrs = x_ptr + rows_x[:, None] * stride_xm + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
        w_ptrs = w_ptr + rows_w[:, None] * K + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    if SPLIT_PROGRAMS:  # this program: chunk program_id(1) of the tile, its fp32 partial to the workspace
        chunk = tl.program_id(1)
        k_start = chunk * CHUNK_K
        acc = _chunk_sum(x_ptrs, w_ptrs, k_start, tl.minimum(k_start + CHUNK_K, K), K, m0, n0, TMA, EVEN_K,
                         BLOCK_M, BLOCK_N, BLOCK_K)  # fmt: skip
        tile = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]  # [BLOCK_M, BLOCK_N] in one chunk's [M, N]
        tl.store(ws_ptr + chunk.to(tl.int64) * M * N + tile, acc, mask=mask)
        if LAST_SUMS:  # the tile's last chunk to arrive: every chunk's partial, summed in chunk order
            if last_to_arrive(count_ptr + pid, CHUNKS):
                part_ptrs = ws_ptr + tile
                acc = tl.load(part_ptrs, mask=mask, other=0.0, cache_modifier=".cg")
                for _ in range(1, CHUNKS):
                    part_ptrs += M * N  # the next chunk's (M * N < 2**31: fewer tiles than SMs)
                    acc += tl.load(part_ptrs, mask=mask, other=0.0, cache_modifier=".cg")
                out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
                tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:  # every chunk here, summed in chunk order: one loop (WALK), or a pipeline a chunk
        if WALK:
            acc = _walk_chunks(x_ptrs, w_ptrs, K, CHUNK_K // BLOCK_K, m0, n0, TMA, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K)
        else:
            acc = _chunk_sum(x_ptrs, w_ptrs, 0, tl.minimum(CHUNK_K, K), K, m0, n0, TMA, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K)
            for chunk in range(1, CHUNKS):
                k_start = chunk * CHUNK_K
                acc += _chunk_sum(x_ptrs, w_ptrs, k_start, tl.minimum(k_start + CHUNK_K, K), K, m0, n0, TMA, EVEN_K,
                                  BLOCK_M, BLOCK_N, BLOCK_K)  # fmt: skip
        out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def placement(c: Config, m: int, n: int, k: int, split_below: int = SPLIT_BELOW_TILES) -> tuple[int, int, int, bool]:
    """Where an [m, k] x [n, k].T call in config c runs, never what it computes: (chunk_k, chunks,
    output tiles, split: a program per chunk, with fewer than `split_below` tiles)."""
    chunk_k, chunks = chunking(k, c)
    tiles = triton.cdiv(m, c.block_m) * triton.cdiv(n, c.block_n)
    return chunk_k, chunks, tiles, chunks > 1 and tiles < split_below


def invariant_matmul(
    x: torch.Tensor,  # [M, K] bf16 (or fp16), any M >= 0
    w: torch.Tensor,  # [N, K], x's dtype, contiguous (an nn.Linear's weight)
    out: torch.Tensor | None = None,  # [M, N] of x's dtype, unit last stride: written in place (a graph's buffer)
    cfg: Config | None = None,  # tuning override (bench/kernels/invariant_matmul.py --sweep); None: the rules
    arrivals: Arrivals | None = None,  # x's device's: split calls sum in their last chunk (else a second launch)
    tma: bool | None = None,  # load through TMA descriptors; None: where `tma_loads` allows, but short split chunks
    split_below: int = SPLIT_BELOW_TILES,  # tuning override (the bench): a program per chunk below this many tiles
    prefetch: bool = False,  # launch with PDL and prefetch the weight: for a GEMM right after a norm
) -> torch.Tensor:  # out: [M, N] = x @ w.T, fp32 sums rounded once
    if x.dim() != 2 or not (x.is_cuda or triton.knobs.runtime.interpret) or x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"invariant_matmul: x must be a CUDA bf16/fp16 [M, K], got {tuple(x.shape)} {x.dtype} on {x.device}")
    m, k = x.shape
    if w.dim() != 2 or w.shape[1] != k or w.dtype != x.dtype or w.device != x.device or not w.is_contiguous():
        raise ValueError(f"invariant_matmul: w {tuple(w.shape)} {w.dtype} (contiguous [N, {k}] {x.dtype}) for x {tuple(x.shape)}")
    n = w.shape[0]
    if not 0 <= split_below <= SPLIT_BELOW_TILES:  # a split call counts its tiles' arrivals in Arrivals.counts
        raise ValueError(f"invariant_matmul: split_below must be in [0, {SPLIT_BELOW_TILES}], got {split_below}")
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
    c = cfg or rows_tile(config(n, k), n, k, m)
    chunk_k, chunks, tiles, split = placement(c, m, n, k, split_below)
    ws = torch.empty((chunks, m, n), dtype=torch.float32, device=x.device) if split else out
    last_sums = split and arrivals is not None
    walk = chunks >= WALK_CHUNKS or (chunks > 2 and m >= MANY_ROWS)
    if tma is None:
        tma = tma_loads(x, w) and not (split and chunk_k // c.block_k < TMA_SPLIT_STEPS)
    x_src = TensorDescriptor(x, [m, k], [x.stride(0), 1], [c.block_m, c.block_k]) if tma else x
    w_src = TensorDescriptor(w, [n, k], [k, 1], [c.block_n, c.block_k]) if tma else w
    use_pdl = prefetch and pdl.enabled(x.device)
    line = pdl.LINE_BYTES // x.element_size()
    _invariant_matmul_kernel[(tiles, chunks if split else 1)](
        x_src, w_src, out, ws, arrivals.counts if last_sums else out, w, m, n, k, x.stride(0), out.stride(0), chunk_k,
        CHUNKS=chunks, SPLIT_PROGRAMS=split, LAST_SUMS=last_sums, WALK=walk, EVEN_K=k % c.block_k == 0, BLOCK_M=c.block_m,
        BLOCK_N=c.block_n, BLOCK_K=c.block_k, GROUP_M=GROUP_M, TMA=tma, USE_PDL=use_pdl,
        PREFETCH_LINES=pdl.prefetch_lines(w.numel() * w.element_size(), chunk_k, line) if use_pdl else 0, LINE=line,
        num_warps=c.num_warps, num_stages=c.num_stages, launch_pdl=use_pdl,
    )  # fmt: skip
    if split and not last_sums:
        chunk_order_sum(ws, out)
    return out
