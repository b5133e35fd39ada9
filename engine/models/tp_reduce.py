"""`TpReduce`: the tensor-parallel all-reduce of a row-parallel layer's output, fused with the
residual add and RMSNorm that follow it, in one Triton kernel over NVLink (CUDA, tp_size > 1).

Why: at batch 1 the 8B decode step at TP=2 spent 13.7 % of its device time in NCCL's all-reduce
kernels (72 per step, 6.5 us each) plus 2.3 us of idle device before each of them and a separate
norm kernel after (bench/RESULTS.md, eleventh session). Here one kernel per norm does all three.

Protocol (one program per row; every rank runs the same calls in the same order, as with NCCL):
- Each rank owns, in torch symmetric memory (mapped into every peer's address space), a data
  buffer [2 slots, world sources, max_rows, hidden] and int32 flags [world sources, max_rows],
  plus its own epochs [max_rows] (how many calls each row index has done).
- Call e (the row's epoch + 1) uses slot e % 2. A program pushes its partial row into slot e % 2,
  source `rank`, of every peer (NVLink stores), then sets flag[rank][row] = e in every peer
  (release, system scope), waits until its own flag[peer][row] has reached e for every peer
  (acquire), and sums the sources from its own buffer in rank order (fp32, one rounding to the
  model dtype: NCCL's result for two ranks, and the same bits on every rank).
- Two slots make the buffers safe to reuse: a peer can only write slot e % 2 again in call e + 2,
  which needs this rank's flag of call e + 1, which this rank sets after it has finished call e.
  Flags compare by wrapping difference, so epochs may overflow.
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

from engine.parallel import TensorParallel

# The most ranks one kernel serves (peers are unrolled at compile time).
MAX_WORLD = 8


@triton.jit
def _reduce_add_norm_kernel(
    x_ptr,  # [T, N]: this rank's partial sums
    res_ptr,  # [T, N]: residual, updated in place
    w_ptr,  # [N]
    out_ptr,  # [T, N]
    data_ptrs,  # int64 [WORLD]: every rank's data buffer [2, WORLD, max_rows, N]
    flag_ptrs,  # int64 [WORLD]: every rank's flags [WORLD, max_rows] then its epochs [max_rows]
    stride_x, stride_r, stride_o,
    n_cols, inv_n, eps, max_rows,
    RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    dtype = x_ptr.dtype.element_ty
    my_flags = tl.load(flag_ptrs + RANK).to(tl.pointer_type(tl.int32))
    epoch_ptr = my_flags + WORLD * max_rows + row
    e = tl.load(epoch_ptr) + 1
    slot = e % 2
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + offs, mask=mask, other=0.0)
    mine = ((slot * WORLD + RANK) * max_rows + row).to(tl.int64) * n_cols
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            peer_data = tl.load(data_ptrs + peer).to(tl.pointer_type(dtype))
            tl.store(peer_data + mine + offs, x, mask=mask)
    tl.debug_barrier()  # every thread's stores precede the flags
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            peer_flags = tl.load(flag_ptrs + peer).to(tl.pointer_type(tl.int32))
            tl.atomic_xchg(peer_flags + RANK * max_rows + row, e, sem="release", scope="sys")
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            while tl.atomic_add(my_flags + peer * max_rows + row, 0, sem="acquire", scope="sys") - e < 0:
                pass
    tl.debug_barrier()
    my_data = tl.load(data_ptrs + RANK).to(tl.pointer_type(dtype))
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for src in tl.static_range(WORLD):
        if src == RANK:
            acc += x.to(tl.float32)
        else:
            theirs = ((slot * WORLD + src) * max_rows + row).to(tl.int64) * n_cols
            acc += tl.load(my_data + theirs + offs, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    total = acc.to(dtype).to(tl.float32)
    r_row = res_ptr + row.to(tl.int64) * stride_r + offs
    h = (total + tl.load(r_row, mask=mask, other=0.0).to(tl.float32)).to(dtype)
    tl.store(r_row, h, mask=mask)
    hf = h.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(hf * hf, axis=0) * inv_n + eps)
    hn = (hf * rstd).to(dtype).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row.to(tl.int64) * stride_o + offs, (w * hn).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(epoch_ptr, e)


class TpReduce:
    """The symmetric buffers of one rank and the fused launch (module docstring)."""

    def __init__(self, tp: TensorParallel, device: torch.device, dtype: torch.dtype, hidden: int, max_rows: int) -> None:
        """Collective: every rank builds its own at the same point of startup."""
        import torch.distributed._symmetric_memory as symm_mem

        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        if not 1 < tp.size <= MAX_WORLD:
            raise ValueError(f"TpReduce serves 2..{MAX_WORLD} ranks, not {tp.size}")
        self.tp, self.dtype, self.hidden, self.max_rows = tp, dtype, hidden, max_rows
        group = dist.group.WORLD.group_name
        world = tp.size
        self.data = symm_mem.empty(2 * world * max_rows * hidden, dtype=dtype, device=device)
        self.flags = symm_mem.empty((world + 1) * max_rows, dtype=torch.int32, device=device)
        self.flags.zero_()
        ptrs = []
        for buf in (self.data, self.flags):
            handle = symm_mem.rendezvous(buf, group)
            assert handle.buffer_ptrs[tp.rank] == buf.data_ptr()
            ptrs.append(torch.tensor(list(handle.buffer_ptrs), dtype=torch.int64, device=device))
        self.data_ptrs, self.flag_ptrs = ptrs
        torch.cuda.synchronize(device)
        dist.barrier()  # every rank's flags are zero before any peer writes one
        self.nbytes = self.data.numel() * self.data.element_size() + self.flags.numel() * 4

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
            x, residual, weight, out, self.data_ptrs, self.flag_ptrs,
            x.stride(0), residual.stride(0), out.stride(0),
            n, 1.0 / n, eps, self.max_rows,
            RANK=self.tp.rank, WORLD=self.tp.size, BLOCK=block, num_warps=max(1, min(16, block // 256)),
        )  # fmt: skip
        return out, residual
