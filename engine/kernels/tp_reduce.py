"""`TpReduce`: the tensor-parallel all-reduce of a row-parallel layer's output, fused with the
residual add and RMSNorm that follow it, in one Triton kernel over NVLink (CUDA, tp_size > 1).

Why: at batch 1 the 8B decode step at TP=2 spent 13.7 % of its device time in NCCL's all-reduce
kernels (72 per step, 6.5 us each) plus 2.3 us of idle device before each of them and a separate
norm kernel after (bench/history/2026-11-23.md). Here one kernel per norm does all three.

Protocol (one program per row; every rank runs the same calls in the same order, as with NCCL),
Lamport-style, as TensorRT-LLM's one-shot kernels: the data is its own flag, so there is no fence
and no flag round trip over NVLink.
- Each rank owns, in torch symmetric memory (mapped into every peer's address space), a data
  buffer [2 slots, world sources, max_rows, hidden] that starts all -0.0, the "not yet written"
  sentinel; a rank never sends -0.0 (it sends +0.0 instead, the same value in the sum), plus its
  own epochs [max_rows] (how many calls each row index has done), in plain device memory.
- Call e (the row's epoch + 1) uses slot e % 2. A program pushes its partial row into slot e % 2,
  source `rank`, of every peer (NVLink stores), then reads each peer's row from its own buffer
  (volatile loads) until no element is -0.0, sums the sources in rank order (fp32, one rounding
  to the model dtype: NCCL's result for two ranks, and the same bits on every rank, except that
  a sum of zeros is +0.0) and writes -0.0 back over what it read.
- Two slots make the buffers safe to reuse: a peer writes slot e % 2 again only in call e + 2,
  which needs this rank's data of call e + 1, which this rank pushes after its call e (and so
  its reset) has finished.
Then residual += sum and out = RMSNorm(residual) * weight, rounded as `fused_ops._rms_norm_kernel`.

Rows beyond `max_rows` (long prefills) and every CPU run take the unfused path: NCCL/gloo
all-reduce, then the norm. The buffers (2 x world x max_rows x hidden x dtype size: 8 MiB at the
8B shape, TP=2) live outside torch_memory_saver's regions and stay through a release; NVLink
multicast is never used.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from engine.kernels import pdl
from engine.kernels.lamport import fill_unwritten, pending, sentinel_like, written
from engine.kernels.launcher import Launcher
from engine.parallel import TensorParallel

# The most ranks one kernel serves (peers are unrolled at compile time).
MAX_WORLD = 8


@Launcher
@triton.jit
def _reduce_add_norm_kernel(
    x_ptr,  # [T, N]: this rank's partial sums
    res_ptr,  # [T, N]: residual, updated in place
    w_ptr,  # [N]
    out_ptr,  # [T, N]
    data_ptrs,  # int64 [WORLD]: every rank's data buffer [2, WORLD, max_rows, N]
    epoch_ptr,  # int32 [max_rows]: this rank's calls so far per row index
    stride_x, stride_r, stride_o,
    n_cols, inv_n, eps, max_rows,
    RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    if USE_PDL:  # engine/kernels/pdl.py: the next GEMV gets scheduled (and prefetches) meanwhile
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    dtype = x_ptr.dtype.element_ty
    e = tl.load(epoch_ptr + row) + 1
    slot = e & 1  # not e % 2, which is negative once e wraps
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + offs, mask=mask, other=0.0)
    x = written(x)  # -0.0 means "not yet written" in the buffers (lamport.py)
    mine = ((slot * WORLD + RANK) * max_rows + row).to(tl.int64) * n_cols
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            peer_data = tl.load(data_ptrs + peer).to(tl.pointer_type(dtype))
            tl.store(peer_data + mine + offs, x, mask=mask)
    my_data = tl.load(data_ptrs + RANK).to(tl.pointer_type(dtype))
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for src in tl.static_range(WORLD):
        if src == RANK:
            acc += x.to(tl.float32)
        else:
            theirs = my_data + ((slot * WORLD + src) * max_rows + row).to(tl.int64) * n_cols + offs
            v = tl.load(theirs, mask=mask, other=0.0, volatile=True)
            while pending(v) > 0:
                v = tl.load(theirs, mask=mask, other=0.0, volatile=True)
            acc += v.to(tl.float32)
            tl.store(theirs, sentinel_like(v), mask=mask)  # for this slot's next call
    total = acc.to(dtype).to(tl.float32)
    r_row = res_ptr + row.to(tl.int64) * stride_r + offs
    h = (total + tl.load(r_row, mask=mask, other=0.0).to(tl.float32)).to(dtype)
    tl.store(r_row, h, mask=mask)
    hf = h.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(hf * hf, axis=0) * inv_n + eps)
    hn = (hf * rstd).to(dtype).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row.to(tl.int64) * stride_o + offs, (w * hn).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(epoch_ptr + row, e)


class TpReduce:
    """The symmetric buffers of one rank and the fused launch (module docstring)."""

    def __init__(self, tp: TensorParallel, device: torch.device, dtype: torch.dtype, hidden: int, max_rows: int) -> None:
        """Collective: every rank builds its own at the same point of startup."""
        import torch.distributed._symmetric_memory as symm_mem

        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        if not 1 < tp.size <= MAX_WORLD:
            raise ValueError(f"TpReduce serves 2..{MAX_WORLD} ranks, not {tp.size}")
        self.tp, self.dtype, self.hidden, self.max_rows = tp, dtype, hidden, max_rows
        self.pdl = pdl.enabled(device)
        group = dist.group.WORLD.group_name
        self.data = symm_mem.empty(2 * tp.size * max_rows * hidden, dtype=dtype, device=device)
        fill_unwritten(self.data)  # -0.0: "not yet written" (module docstring)
        handle = symm_mem.rendezvous(self.data, group)
        assert handle.buffer_ptrs[tp.rank] == self.data.data_ptr()
        self.data_ptrs = torch.tensor(list(handle.buffer_ptrs), dtype=torch.int64, device=device)
        self.epochs = torch.zeros(max_rows, dtype=torch.int32, device=device)
        torch.cuda.synchronize(device)
        dist.barrier()  # every rank's buffer holds sentinels before any peer writes into it
        self.nbytes = self.data.numel() * self.data.element_size() + self.epochs.numel() * 4

    def fits(self, x: torch.Tensor) -> bool:
        return x.dim() == 2 and x.shape[0] <= self.max_rows and x.shape[1] == self.hidden and x.dtype == self.dtype

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, N] partial on each rank: residual += all_reduce(x) (in place), then
        (rms_norm(residual) * weight, residual)."""
        rows, n = x.shape
        out = torch.empty_like(x)
        if rows == 0:
            return out, residual
        if x.stride(-1) != 1 or residual.stride(-1) != 1:
            raise ValueError("TpReduce.add_rms_norm needs unit last strides")
        block = 1 << max(0, (n - 1).bit_length())
        _reduce_add_norm_kernel[(rows,)](
            x, residual, weight, out, self.data_ptrs, self.epochs,
            x.stride(0), residual.stride(0), out.stride(0),
            n, 1.0 / n, eps, self.max_rows,
            RANK=self.tp.rank, WORLD=self.tp.size, BLOCK=block,
            USE_PDL=self.pdl, num_warps=max(1, min(16, block // 256)), launch_pdl=self.pdl,
        )  # fmt: skip
        return out, residual
