"""Where the programs of one invariant GEMM (invariant_matmul.py) meet: the sums and pairs that
cross a program's tile, and their arrival counters.

- The chunk-order sum: without counters, a split call's chunk partials ws [CHUNKS, M, N] fp32
  are summed by a second launch, ((ws[0] + ws[1]) + ws[2]) + ..., rounded once: the order of
  the tile's last chunk to arrive when counters are given (`Arrivals.counts`).
- The gate_up pair (`silu_pair`): a product of gate | up [M, 2I] whose I BLOCK_N divides pairs
  gate tile j with up tile j + I / BLOCK_N; the second of the two to store its tile (a counter
  of `Arrivals.pairs`, last_to_arrive) reads both back from L2 and writes act = silu(gate) * up
  with fused_ops.silu_mul, layers.SiluAndMul's rounding: the bits of the product, then
  fused_ops.silu_and_mul, in one launch.
- Counters are zero between calls (the last to arrive zeroes its own), allocated once in the
  `cuda_graph` region, zeroed after a resume of it, and shared by calls on one stream.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels import fused_ops
from engine.kernels.launcher import Launcher
from engine.kernels.split_kv import last_to_arrive

REDUCE_BLOCK = 1024  # output elements a program of the chunk sum adds up
SPLIT_BELOW_TILES = 132  # fewer output tiles than SMs: a program per chunk (more: one per tile)
PAIR_COUNTERS = 4096  # gate_up's tile pairs a call may count (more: the GEMM, then the activation)


@triton.jit
def silu_pair(out_ptr, act_ptr, pair_ptr, pid_m, pid_n, offs_m, M, stride_om, stride_am, HALF_N,
              BLOCK_N: tl.constexpr):  # fmt: skip
    """After this program stored its tile of gate | up [M, 2 HALF_N]: the second of the tile pair
    (gate columns j BLOCK_N.., up columns HALF_N + j BLOCK_N..) to arrive writes their act tile
    [BLOCK_M, BLOCK_N] = silu(gate) * up, both read back from L2 (the other's stores acquired)."""
    tiles_half = HALF_N // BLOCK_N
    j = pid_n % tiles_half
    if last_to_arrive(pair_ptr + pid_m * tiles_half + j, 2):
        cols = (j * BLOCK_N + tl.arange(0, BLOCK_N))[None, :]
        rows = offs_m.to(tl.int64)[:, None]
        ok = rows < M
        gate = tl.load(out_ptr + rows * stride_om + cols, mask=ok, other=0.0, cache_modifier=".cg").to(tl.float32)
        up = tl.load(out_ptr + rows * stride_om + HALF_N + cols, mask=ok, other=0.0, cache_modifier=".cg")
        act = fused_ops.silu_mul(gate, up.to(tl.float32), act_ptr.dtype.element_ty)
        tl.store(act_ptr + rows * stride_am + cols, act, mask=ok)


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
    """The split programs' arrival counters, one per output tile (`counts`: a split call has fewer
    than SPLIT_BELOW_TILES tiles), and gate_up's tile pairs' (`pairs`, `silu_mul`): zero between
    calls, since the last to arrive zeroes its counter. Allocated once, in the `cuda_graph` region
    (ModelRunner), and zeroed after a resume of it; the calls sharing one run on one stream (one
    forward at a time)."""

    def __init__(self, device: torch.device) -> None:
        self.counts = torch.zeros(SPLIT_BELOW_TILES, dtype=torch.int32, device=device)
        self.pairs = torch.zeros(PAIR_COUNTERS, dtype=torch.int32, device=device)

    def after_resume(self) -> None:
        self.counts.zero_()
        self.pairs.zero_()
