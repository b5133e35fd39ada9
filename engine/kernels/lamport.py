"""The Lamport sentinel: -0.0 means "not yet written", so a buffer's data is its own flag, as in
TensorRT-LLM's one-shot all-reduce. Triton functions inlined into the kernels that use it
(tp_reduce.py across ranks; grid_phases.py's GEMV and norm phases across the programs of one
launch of layer_kernel.py), and the owners' fill (`fill_unwritten`); only modules that import
Triton, or CUDA code paths, import this one.

Rules for a buffer used so:
- It holds -0.0 in every element before its first use (its owner fills it at construction and
  whenever its memory comes back undefined, e.g. after a resume).
- A producer never stores -0.0: `written` turns it into +0.0, the same value in every later sum,
  product and norm (only a zero's sign can differ).
- A consumer loads what it needs with volatile loads until no element is -0.0 (`unwritten`), and
  uses what it loaded (`await_sum`), or reads it again once it has seen all of it (`await_rows`;
  the stores are visible at L2, the point every later load reaches). No release fence, no
  counter, no barrier between the two: the data's last store is the signal.
- -0.0 goes back into every element (`sentinel_like`) before the buffer's next use and after its last
  consumer has read it; where that is safe is the owner's rule.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def fill_unwritten(t: torch.Tensor) -> None:
    """Every element of t (16- or 32-bit floats) set to the sentinel: what an owner does first."""
    bits = torch.int16 if t.element_size() == 2 else torch.int32
    t.view(bits).fill_(torch.iinfo(bits).min)


@triton.jit
def unwritten(v):
    # True where v holds the sentinel -0.0 (v: 16- or 32-bit floats).
    if v.dtype.primitive_bitwidth == 16:
        return v.to(tl.int16, bitcast=True) == -32768
    else:
        return v.to(tl.int32, bitcast=True) == -2147483648


@triton.jit
def pending(v):
    # How many elements of v still hold the sentinel (a scalar over the whole block).
    return tl.sum(unwritten(v).to(tl.int32))


@triton.jit
def written(v):
    # v with -0.0 turned into +0.0: what a producer stores.
    return tl.where(v == 0.0, 0.0, v).to(v.dtype)


@triton.jit
def sentinel_like(v):
    # A block of -0.0 of v's shape and dtype, built from its bits (a -0.0 literal could be folded
    # to +0.0).
    if v.dtype.primitive_bitwidth == 16:
        return tl.full(v.shape, -32768, tl.int16).to(v.dtype, bitcast=True)
    else:
        return tl.full(v.shape, -2147483648, tl.int32).to(v.dtype, bitcast=True)


@triton.jit
def await_rows(ptr, stride, M, k_lo, K: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    # Return once rows < M (M <= BM) of ptr[:, k_lo : k_lo + K] at row stride `stride` hold no
    # sentinel. Each round issues every load (BK columns each) before one reduction: a reduction
    # per load would wait out each load's round trip in turn (its CTA barrier orders them).
    rows = tl.arange(0, BM)[:, None]
    cols = tl.arange(0, BK)[None, :]
    left = 1
    while left > 0:
        seen = tl.zeros([BM, BK], tl.int32)
        for k0 in tl.static_range(0, K, BK):
            v = tl.load(ptr + rows * stride + k_lo + k0 + cols, mask=rows < M, other=0.0, volatile=True)
            seen += unwritten(v).to(tl.int32)
        left = tl.sum(seen)
    tl.debug_barrier()


@triton.jit
def await_sum(ptr, offs, mask, stride, KS: tl.constexpr):
    # sum_c ptr[c * stride + offs] over c < KS (fp32, in c's order), once no element of the KS
    # slices (where mask) holds the sentinel: the loads that see them all written are the ones
    # summed, so the wait costs no extra read. One reduction a round, after every load of it.
    s = tl.zeros(offs.shape, tl.float32)
    left = 1
    while left > 0:
        v = tl.load(ptr + offs, mask=mask, other=0.0, volatile=True)
        seen = unwritten(v).to(tl.int32)
        s = v.to(tl.float32)
        for c in tl.static_range(1, KS):
            v = tl.load(ptr + c * stride + offs, mask=mask, other=0.0, volatile=True)
            seen += unwritten(v).to(tl.int32)
            s += v.to(tl.float32)
        left = tl.sum(seen)
    return s
