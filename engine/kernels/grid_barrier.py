"""The grid barrier of Siesta's persistent decode kernels (layer_kernel.py, batch_kernel.py; their
phases are grid_phases.py's) and their bench-only timestamps. Triton functions inlined into those
kernels, not kernels; only modules that import Triton import this one.

Grid barrier: one int32 counter; program 0 adds 2^31 - (P - 1), the others 1, so the sign bit
flips once all P have arrived and the low bits return to 0 (no reset between barriers or
launches; the kernels' owners zero it when built and after a resume). Release on arrival, acquire loads while
waiting, CTA barriers around both; every program must be resident (cooperative launch, grid <=
SMs). LAST_LEAVES (the one-row kernel's barriers): the arrival is acq_rel, and the program whose
own add flips the sign leaves without polling. It arrived last, so the rest of the grid waits on
it anyway; its poll cost a round trip to L2 (0.6B step, H100: 1 / 2 / 4 rows 0.856 / 1.011-1.018
/ 1.142-1.145 -> 0.848-0.853 / 1.004 / 1.135-1.136 ms). The batch kernel keeps the plain wait:
64 rows 2.308-2.313 -> 2.319 ms with it (bench/history/2026-11-27.md).

Stamps (TIMING, bench only): a program's %globaltimer at numbered points of its launch, and its
SM, into a [P, STAMPS] int64 tensor (`stamp`; `phase_end` stamps a barrier's arrival and leaving).
"""

from __future__ import annotations

import triton
import triton.language as tl

from engine.kernels.attention import stamp_row

STAMPS: tl.constexpr = tl.constexpr(32)  # stamp slots per program (TIMING): points 0..30, then its SM
SM_SLOT: tl.constexpr = tl.constexpr(31)


@triton.jit
def _load_acquire(ptr):
    return tl.inline_asm_elementwise(
        "ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def _add(FIRST_ADD: tl.constexpr):
    # This program's share of a barrier: FIRST_ADD for program 0, 1 for the others.
    add = 1
    if tl.program_id(0) == 0:
        add = FIRST_ADD
    return add


@triton.jit
def grid_arrive(bar_ptr, FIRST_ADD: tl.constexpr, LAST_LEAVES: tl.constexpr = False):
    # The barrier's first half: this program's writes released, its arrival counted; returns the
    # counter before it, for grid_wait. LAST_LEAVES: the atomic acquires too, so the program
    # that arrives last can leave on its result (grid_wait).
    tl.debug_barrier()
    if LAST_LEAVES:
        return tl.atomic_add(bar_ptr, _add(FIRST_ADD), sem="acq_rel", scope="gpu")
    else:
        return tl.atomic_add(bar_ptr, _add(FIRST_ADD), sem="release", scope="gpu")


@triton.jit
def grid_wait(bar_ptr, old, FIRST_ADD: tl.constexpr, LAST_LEAVES: tl.constexpr = False):
    # The barrier's second half: wait until every program has arrived (the sign bit flipped).
    # LAST_LEAVES (grid_arrive's): the program whose own add flipped it leaves without a load, a
    # round trip to L2 sooner; it was the last to arrive, and the others' next phase waits on it.
    if LAST_LEAVES:
        cur = old + _add(FIRST_ADD)
    else:
        cur = _load_acquire(bar_ptr)
    while (old ^ cur) >= 0:  # same sign bit: someone has not arrived
        cur = _load_acquire(bar_ptr)
    tl.debug_barrier()


@triton.jit
def stamp(t_ptr, i: tl.constexpr, TIMING: tl.constexpr):
    # bench only (TIMING): this program's %globaltimer (ns) at point i < SM_SLOT, into t [P, STAMPS]
    # int64; at point 0 also its %smid, into t[:, SM_SLOT].
    if TIMING:
        stamp_row(t_ptr + tl.program_id(0) * STAMPS, i, SM_SLOT)


@triton.jit
def stamp_landed(t_ptr, i: tl.constexpr, x, TIMING: tl.constexpr):
    # bench only (TIMING): stamp point i once x's loads have landed (the stamp depends on x's
    # values; a NaN sum skips it), not when they were issued.
    if TIMING:
        if tl.sum(x.to(tl.float32)) > float("-inf"):
            stamp_row(t_ptr + tl.program_id(0) * STAMPS, i, SM_SLOT)


@triton.jit
def phase_end(
    bar_ptr, t_ptr, POINT: tl.constexpr, FIRST_ADD: tl.constexpr, TIMING: tl.constexpr, LAST_LEAVES: tl.constexpr = False
):  # fmt: skip
    # The grid barrier after a phase, stamped (TIMING) at arrival (POINT) and on leaving (POINT + 1).
    # A grid of one program (FIRST_ADD 2^31: Triton's interpreter, the CPU tests) needs none.
    stamp(t_ptr, POINT, TIMING)
    if FIRST_ADD < 2**31:
        grid_wait(bar_ptr, grid_arrive(bar_ptr, FIRST_ADD, LAST_LEAVES), FIRST_ADD, LAST_LEAVES)
    stamp(t_ptr, POINT + 1, TIMING)
