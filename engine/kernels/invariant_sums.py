"""Where the programs of one invariant GEMM (invariant_matmul.py) meet: the chunk sums that cross
a program's tile, and their arrival counters.

- The chunk-order sum: without counters, a split call's chunk partials ws [CHUNKS, M, N] fp32
  are summed by a second launch, ((ws[0] + ws[1]) + ws[2]) + ..., rounded once: the order of
  the tile's last chunk to arrive when counters are given (`Arrivals.counts`).
- Counters are zero between calls (the last to arrive zeroes its own), allocated once in the
  `cuda_graph` region, zeroed after a resume of it, and shared by calls on one stream.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.launcher import Launcher

REDUCE_BLOCK = 1024  # output elements a program of the chunk sum adds up
# Fewer output tiles than this: a program per chunk (more: one per tile, walking its chunks). 128
# of 132 SMs count as a full wave: 128 tiles walking beat their split (the 8B down at 256 rows,
# 1.53x against 1.64x cuBLAS; bench/kernels/invariant_matmul.py --sweep, 2026-11-30m).
SPLIT_BELOW_TILES = 128


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


def chunk_order_sum(ws: torch.Tensor, out: torch.Tensor) -> None:
    """out [M, N] = ws [CHUNKS, M, N] summed in chunk order, rounded once to out's dtype."""
    chunks, m, n = ws.shape
    _chunk_order_sum_kernel[(triton.cdiv(m * n, REDUCE_BLOCK),)](
        ws, out, m, n, out.stride(0), CHUNKS=chunks, BLOCK=REDUCE_BLOCK, num_warps=4)


class Arrivals:
    """The split programs' arrival counters, one per output tile (a split call has fewer than
    SPLIT_BELOW_TILES tiles): zero between calls, since a tile's last chunk to arrive zeroes its
    counter. Allocated once, in the `cuda_graph` region (ModelRunner), and zeroed after a resume
    of it; the calls sharing one run on one stream (one forward at a time)."""

    def __init__(self, device: torch.device) -> None:
        self.counts = torch.zeros(SPLIT_BELOW_TILES, dtype=torch.int32, device=device)

    def after_resume(self) -> None:
        self.counts.zero_()
