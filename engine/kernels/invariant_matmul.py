"""A batch-invariant half-precision GEMM: row r of the output is bit for bit the same whatever the
number of rows M and whatever the other rows hold, the CUDA counterpart of engine/models/invariant.py's
block linear (`--deterministic`). Only CUDA code paths import this module (it imports Triton).

    y [M, N] = x [M, K] @ weight [N, K].T          invariant_matmul(x, w, out=None)

Why cuBLAS is not: it picks its kernel, its tiles and its split of K by M (and by the other
sizes), so a row's fp32 sums over K run in an order, and round, that depend on the batch it
came in (issue 76). Rules that make this kernel invariant:
- K's order (BLOCK_K and the chunks below) is fixed per weight shape (N, K): `config(n, k)`, a
  rule on N and K alone, never on M; no autotuning. M is not specialized (`do_not_specialize`).
- The output tile may follow M, the bits may not (`rows_tile`): up to FEW_ROWS rows (a decode
  step) run 16-row tiles (mma.sync m16n8k16, a quarter of a 64-row tile's loads), from
  MANY_ROWS (a prefill) tiles of two warp groups (128 x 128, 128 x 256, 256 x 128), between
  them 64-row tiles (wgmma), 128 rows high from MID_ROWS for a large weight.
  Each output element is the same BLOCK_K steps of MMAs into fp32 in the same order whatever
  the tile, and on an H200 the instructions round a row's sums alike:
  tests/test_gpu_invariant_matmul.py crosses 16 -> 17, 100 -> 256 and 1000 -> 1100 rows with the Qwen3
  shapes, bit for bit.
- K is cut into SPLIT_K chunks fixed by (N, K) (`config`), each a whole number of BLOCK_K steps.
  A chunk's partial sum starts from zero and walks its K in ascending BLOCK_K steps (tensor-core
  dots into fp32; bf16/fp16 products are exact in fp32); the output is
  ((p_0 + p_1) + p_2) + ... in fp32, rounded once to x's dtype. The MMA never mixes rows, so the
  other rows of a tile change nothing of row r's bits.
- Where that arithmetic runs may follow M, the bits may not: with fewer output tiles than SMs
  (SPLIT_BELOW_TILES) each chunk is a program of its own, writing its fp32 partial to a
  workspace [SPLIT_K, M, N] (`SPLIT_PROGRAMS`: K's parallelism for a GEMV), and the tile's last
  chunk to arrive (`Arrivals`, split_kv.last_to_arrive) sums the tile's partials in chunk order;
  without `Arrivals` a second kernel sums them the same way. With many tiles one program walks
  every chunk of its tile and sums the same way: from WALK_CHUNKS chunks (3 from MANY_ROWS rows)
  in one loop over K that folds each chunk's partial into the sum as the chunk ends
  (`_walk_chunks`), so the loads run on across chunks; fewer chunks a pipeline each. The same
  partials, added in the same order, give the same bits every way.
- Tiles load through TMA descriptors on Hopper (`tma_loads`: 16-byte aligned tensors), else
  through pointers; the same tiles either way. Rows past M and columns past N read zeros (TMA)
  or row M-1 / N-1 (pointers) and are never stored; a K that BLOCK_K does not divide reads
  its last step's columns past K as zeros (fixed by K).
- Tiles are visited in groups of GROUP_M row tiles (L2 reuse of the weight at large M): which
  program computes a tile changes, how it computes it does not.
- Grid and output are fixed by the shapes, no host read of a device value: CUDA-graph capturable
  with a preallocated `out`. No PDL (no decode graph launches it yet).

The configuration rule (`config`), reasoned for an H100 / H200 (132 SMs, wgmma), not yet tuned
on one (bench/kernels/invariant_matmul.py times it against cuBLAS and `--sweep` ranks a grid of
configs per weight shape over all M at once, the only way a config may be chosen here):
- BLOCK_M = 64, 4 warps: one warp group, Hopper's smallest wgmma M. A decode step's few rows
  take 16-row tiles instead, 128 columns wide from N >= FEW_WIDE_N: at M = 1 that halves the
  64-row tile's time (the 0.6B lm_head 166 -> 84 us, cuBLAS 76; the 8B gate_up 96 -> 55, cuBLAS
  48; bench/history/2026-11-29.md, 2026-11-29t). From MANY_ROWS rows, `rows_tile`.
- BLOCK_N trades M = 1 bandwidth (programs to stream the weight) against large-M intensity
  (MACs per loaded element): 128 columns where N >= WIDE_N (>= 64 column tiles; the 8B's gate_up
  and every lm_head have 192 and more), else 64.
- SPLIT_K brings a few-rows GEMM's programs to about TARGET_PROGRAMS (two an SM), with chunks of
  at least MIN_CHUNK_STEPS BLOCK_K steps: the 8B's o_proj (64 column tiles, K 4096) takes 5
  chunks of 832, its down (K 12288) 5 of 2496, its gate_up (192 column tiles) 2, the lm_heads 1.
- BLOCK_K = 64 and 4 stages: 24 KB of shared memory a stage at 64 x 128, two programs an SM.
  K < 64 (tiny test models) takes one step of K rounded up to a power of two (>= 16).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from engine.kernels.launcher import Launcher
from engine.kernels.split_kv import last_to_arrive

BLOCK_M = 64  # rows of a tile: one warp group's wgmma M
WIDE_N = 8192  # N from which a tile is 128 columns wide, below it 64
GROUP_M = 8  # row tiles visited together: their programs share the weight's column tiles in L2
TARGET_PROGRAMS = 264  # two an SM of an H100 / H200 (132 SMs)
MIN_CHUNK_STEPS = 8  # BLOCK_K steps a chunk of K walks at least
REDUCE_BLOCK = 1024  # output elements a program of the chunk sum adds up
SPLIT_BELOW_TILES = 132  # fewer output tiles than SMs: a program per chunk (more: one per tile)
FEW_ROWS = 16  # at most this many rows: 16-row tiles (`rows_tile`)
FEW_WIDE_N = 4096  # N from which a few-rows tile is 128 columns wide, below it 64
MID_ROWS = 256  # at least this many rows (a large decode): a large weight's tiles 128 rows high
MANY_ROWS = 1024  # at least this many rows (prefill): 128-row tiles of 8 warps where SMS of them or more
WIDE_TILES = 256  # from this many 128 x 256 tiles (two waves of SMS), prefill's walked weights take them
SMS = 132  # an H100's / H200's
WALK_CHUNKS = 4  # a program walking this many chunks (3 from MANY_ROWS) walks them in one loop


class Config(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int = 1  # chunks of K (fewer where K has fewer whole BLOCK_K steps)


def config(n: int, k: int) -> Config:
    """The one configuration of a weight [N = n, K = k], whatever the rows: the rules above."""
    block_n = min(128 if n >= WIDE_N else 64, max(16, triton.next_power_of_2(n)))
    block_k = 64 if k >= 64 else max(16, triton.next_power_of_2(k))
    tiles_n = triton.cdiv(n, block_n)
    split = max(1, min(triton.cdiv(TARGET_PROGRAMS, tiles_n), triton.cdiv(k, block_k) // MIN_CHUNK_STEPS))
    return Config(BLOCK_M, block_n, block_k, num_warps=4, num_stages=4, split_k=split)


def rows_tile(cfg: Config, n: int, k: int, m: int) -> Config:
    """The output tile that runs m rows of the weight whose configuration is `cfg`: 16-row tiles
    up to FEW_ROWS rows; from MANY_ROWS where SMS tiles of 128 x 128 or more, 8 warps: 256 x 128
    (3 stages) for a weight of one chunk (the lm_heads), 128 x 256 (3 stages) for one of more than
    2 chunks (walked in one loop) where WIDE_TILES of them or more, else 128 x 128 (4 stages);
    from MID_ROWS, a weight of N or K >= WIDE_N (the lm_heads, the 8B's gate_up and down)
    128-row tiles (128 x 128 of two warp groups, or 128 x 64 of one where only K is wide); else
    cfg's. K's order (BLOCK_K, the chunks) is cfg's whatever m.
    The MID_ROWS tiles, timed at 256 rows on an H200 against cuBLAS (bench/kernels/
    invariant_matmul.py --sweep): the 8B gate_up 1.66x -> 1.46x, down 1.89x -> 1.55x, lm_head
    1.76x -> 1.47x, the 0.6B lm_head 1.63x -> 1.50x; at 64 rows and for the 0.6B's layers the
    64-row tile stays the best of the grid (bench/history/2026-11-30.md). From MANY_ROWS, fewer
    128 x 128 tiles than SMS keep the 64-row tile: the 0.6B's o_proj and down at 1024 rows,
    2.66x / 2.97x -> 1.59x / 1.65x (64 tiles -> 256).
    The MANY_ROWS tiles, timed with TMA loads at 8192 rows against cuBLAS (2026-11-30h): 128 x 256
    the 8B's down, qkv, o 1.10x / 1.17x / 1.20x and the 0.6B's o, down 1.17x / 1.16x (128 x 128:
    1.47-1.57x); a weight of 2 chunks keeps 128 x 128, since 128 x 256 holds two fp32
    accumulators of 128 registers a thread there and spills (3.4-4.7x), and 4 stages (the 8B's
    gate_up 1.36x -> 1.18x); 256 x 128 the lm_heads 1.04x-1.15x (1.11x-1.19x)."""
    width = max(16, triton.next_power_of_2(n))
    if m <= FEW_ROWS:
        return cfg._replace(block_m=16, block_n=min(128 if n >= FEW_WIDE_N else 64, width))
    if m >= MANY_ROWS and triton.cdiv(m, 128) * triton.cdiv(n, 128) >= SMS:
        chunks = chunking(k, cfg)[1]
        if chunks == 1 and triton.cdiv(m, 256) * triton.cdiv(n, 128) >= SMS:
            return cfg._replace(block_m=256, block_n=min(128, width), num_warps=8, num_stages=3)
        if chunks > 2 and triton.cdiv(m, 128) * triton.cdiv(n, 256) >= WIDE_TILES:
            return cfg._replace(block_m=128, block_n=min(256, width), num_warps=8, num_stages=3)
        return cfg._replace(block_m=128, block_n=min(128, width), num_warps=8, num_stages=4)
    if m >= MID_ROWS and n >= WIDE_N:
        return cfg._replace(block_m=128, block_n=min(128, width), num_warps=8, num_stages=4)
    if m >= MID_ROWS and k >= WIDE_N:
        return cfg._replace(block_m=128, block_n=min(64, width), num_warps=4, num_stages=4)
    return cfg


@functools.cache
def _has_tma(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def tma_loads(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the tiles load through TMA descriptors: Hopper or later (or Triton's interpreter),
    16-byte aligned bases and row strides. The bits are the pointer loads' either way."""
    aligned = all(t.data_ptr() % 16 == 0 and t.stride(0) * t.element_size() % 16 == 0 for t in (x, w))
    return aligned and (triton.knobs.runtime.interpret or _has_tma(x.device))


def chunking(k: int, cfg: Config) -> tuple[int, int]:
    """(chunk_k, chunks): K cut into chunks of whole BLOCK_K steps, none empty."""
    chunk_k = triton.cdiv(triton.cdiv(k, max(1, cfg.split_k)), cfg.block_k) * cfg.block_k
    return chunk_k, triton.cdiv(k, chunk_k)


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
    M, N, K, stride_xm, stride_om, CHUNK_K,
    CHUNKS: tl.constexpr, SPLIT_PROGRAMS: tl.constexpr, LAST_SUMS: tl.constexpr, WALK: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, TMA: tl.constexpr,
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


@Launcher
@triton.jit(do_not_specialize=["M"])
def _chunk_order_sum_kernel(ws_ptr, out_ptr, M, N, stride_om, CHUNKS: tl.constexpr, BLOCK: tl.constexpr):
    """out [M, N] = ((ws[0] + ws[1]) + ws[2]) + ..., fp32 rounded once: the fused path's order."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < M * N
    acc = tl.load(ws_ptr + offs, mask=ok, other=0.0)
    for chunk in range(1, CHUNKS):
        acc += tl.load(ws_ptr + chunk * M * N + offs, mask=ok, other=0.0)
    row, col = offs // N, offs % N
    tl.store(out_ptr + row * stride_om + col, acc.to(out_ptr.dtype.element_ty), mask=ok)


class Arrivals:
    """The split programs' arrival counters, one per output tile (a split call has fewer than
    SPLIT_BELOW_TILES tiles): zero between calls, since a tile's last chunk to arrive zeroes its
    counter. Allocated once, in the `cuda_graph` region (ModelRunner), and zeroed after a resume
    of it; the calls sharing one run on one stream (one forward at a time)."""

    def __init__(self, device: torch.device) -> None:
        self.counts = torch.zeros(SPLIT_BELOW_TILES, dtype=torch.int32, device=device)

    def after_resume(self) -> None:
        self.counts.zero_()


def invariant_matmul(
    x: torch.Tensor,  # [M, K] bf16 (or fp16), any M >= 0
    w: torch.Tensor,  # [N, K], x's dtype, contiguous (an nn.Linear's weight)
    out: torch.Tensor | None = None,  # [M, N] of x's dtype, unit last stride: written in place (a graph's buffer)
    cfg: Config | None = None,  # tuning override (bench/kernels/invariant_matmul.py --sweep); None: the rules
    arrivals: Arrivals | None = None,  # x's device's: split calls sum in their last chunk (else a second launch)
    tma: bool | None = None,  # load through TMA descriptors; None: where `tma_loads` allows (False: A/B, tests)
) -> torch.Tensor:  # out: [M, N] = x @ w.T, fp32 sums rounded once
    if x.dim() != 2 or not (x.is_cuda or triton.knobs.runtime.interpret) or x.dtype not in (torch.bfloat16, torch.float16):
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
    if cfg is None:
        c = rows_tile(c, n, k, m)
    chunk_k, chunks = chunking(k, c)
    tiles = triton.cdiv(m, c.block_m) * triton.cdiv(n, c.block_n)
    split = chunks > 1 and tiles < SPLIT_BELOW_TILES  # where it runs, never what it computes
    ws = torch.empty((chunks, m, n), dtype=torch.float32, device=x.device) if split else out
    last_sums = split and arrivals is not None
    walk = chunks >= WALK_CHUNKS or (chunks > 2 and m >= MANY_ROWS)
    tma = tma_loads(x, w) if tma is None else tma
    x_src = TensorDescriptor(x, [m, k], [x.stride(0), 1], [c.block_m, c.block_k]) if tma else x
    w_src = TensorDescriptor(w, [n, k], [k, 1], [c.block_n, c.block_k]) if tma else w
    _invariant_matmul_kernel[(tiles, chunks if split else 1)](
        x_src, w_src, out, ws, arrivals.counts if last_sums else out, m, n, k, x.stride(0), out.stride(0), chunk_k,
        CHUNKS=chunks, SPLIT_PROGRAMS=split, LAST_SUMS=last_sums, WALK=walk, EVEN_K=k % c.block_k == 0, BLOCK_M=c.block_m,
        BLOCK_N=c.block_n, BLOCK_K=c.block_k, GROUP_M=GROUP_M, TMA=tma, num_warps=c.num_warps, num_stages=c.num_stages,
    )  # fmt: skip
    if split and not last_sums:
        _chunk_order_sum_kernel[(triton.cdiv(m * n, REDUCE_BLOCK),)](
            ws, out, m, n, out.stride(0), CHUNKS=chunks, BLOCK=REDUCE_BLOCK, num_warps=4)
    return out
