"""Probe: does loading a GEMV phase's weights before the grid barrier that opens it (into shared
memory, by TMA, one phase ahead) shorten a chain of one-row GEMV phases? A Gluon persistent kernel
(one program per SM) runs LAYERS x 4 phases shaped as the 0.6B layer kernel's at one row (per
program: qkv 64 KB, o_proj 32 KB, gate_up 96 KB, down 48 KB; 128 programs with an item, ~30 MB a
layer), a grid barrier between phases, x read after each barrier. AHEAD=0: each phase's TMA
loads are issued after its barrier; AHEAD=1: after the phase two before it has read the buffer
(two buffers: one phase ahead). COMPUTE=0 skips the products, BARRIER=0 the grid barriers; each
combination runs in one process beside a copy that gives the bandwidth floor. Results:
bench/RESULTS.md, twenty-fourth session.

    python3 bench/probe_phase_weights.py --layers 28
"""

from __future__ import annotations

import argparse

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

BN: gl.constexpr = gl.constexpr(32)  # rows of an item's tile
BOX: gl.constexpr = gl.constexpr(256)  # columns per TMA box
ITEMS: gl.constexpr = gl.constexpr(128)  # programs with an item
NBMAX: gl.constexpr = gl.constexpr(6)
NB = (4, 2, 6, 3)  # boxes of BOX columns per item: qkv, o, gate_up, down


@gluon.jit
def grid_barrier(bar_ptr, FIRST_ADD: gl.constexpr, BARRIER: gl.constexpr = True):
    # engine/models/grid_phases.py's grid barrier (every program resident), skipped if not BARRIER.
    gl.thread_barrier()
    if not BARRIER:
        return
    add = 1
    if gl.program_id(0) == 0:
        add = FIRST_ADD
    old = gl.atomic_add(bar_ptr, add, sem="release", scope="gpu")
    cur = gl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [bar_ptr], dtype=gl.int32, is_pure=False, pack=1)
    while (old ^ cur) >= 0:
        cur = gl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [bar_ptr], dtype=gl.int32, is_pure=False, pack=1)
    gl.thread_barrier()


@gluon.jit
def _issue(desc, layer, smem, bars, b: gl.constexpr, N: gl.constexpr):
    pid = gl.program_id(0)
    if pid < ITEMS:
        row = (layer * ITEMS + pid) * BN
        mbarrier.expect(bars.index(b), N * BN * BOX * 2)
        for j in gl.static_range(N):
            tma.async_copy_global_to_shared(desc, [row, j * BOX], bars.index(b), smem.index(b * NBMAX + j))


@gluon.jit
def _compute(smem, bars, b: gl.constexpr, parity: gl.constexpr, N: gl.constexpr, x_ptr, y_ptr, layout: gl.constexpr,
             COMPUTE: gl.constexpr = True):
    pid = gl.program_id(0)
    if pid < ITEMS:
        mbarrier.wait(bars.index(b), parity)
        if not COMPUTE:
            return
        acc = gl.zeros([BN], gl.float32, gl.SliceLayout(1, layout))
        ks = gl.arange(0, BOX, layout=gl.SliceLayout(0, layout))
        for j in gl.static_range(N):
            w = smem.index(b * NBMAX + j).load(layout).to(gl.float32)
            x = gl.load(x_ptr + j * BOX + ks).to(gl.float32)
            acc += gl.sum(w * gl.expand_dims(x, 0), axis=1)
        gl.store(y_ptr + pid * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, layout)), acc)


@gluon.jit
def _phase(bar_ptr, d_now, layer, d_ahead, layer_ahead, ahead_ok, smem, bars, x_ptr, y_ptr,
           b: gl.constexpr, parity: gl.constexpr, N: gl.constexpr, N_AHEAD: gl.constexpr, layout: gl.constexpr,
           AHEAD: gl.constexpr, COMPUTE: gl.constexpr, BARRIER: gl.constexpr, FIRST_ADD: gl.constexpr):  # fmt: skip
    # One phase on buffer b: the barrier, its weights (issued now, or two phases ago), the
    # products; then (AHEAD) the weights of the phase two later into the buffer just read.
    grid_barrier(bar_ptr, FIRST_ADD, BARRIER)
    if not AHEAD:
        _issue(d_now, layer, smem, bars, b, N)
    _compute(smem, bars, b, parity, N, x_ptr, y_ptr, layout, COMPUTE)
    gl.thread_barrier()
    if AHEAD:
        if ahead_ok:
            _issue(d_ahead, layer_ahead, smem, bars, b, N_AHEAD)


@gluon.jit
def probe_kernel(dq, do, dg, dd, x_ptr, y_ptr, bar_ptr, LAYERS, AHEAD: gl.constexpr, FIRST_ADD: gl.constexpr,
                 COMPUTE: gl.constexpr, BARRIER: gl.constexpr,
                 SMEM_LAYOUT: gl.constexpr, NQ: gl.constexpr, NO: gl.constexpr, NG: gl.constexpr, ND: gl.constexpr):  # fmt: skip
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
    smem = gl.allocate_shared_memory(gl.bfloat16, [2 * NBMAX, BN, BOX], SMEM_LAYOUT)
    bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(bars.index(0), count=1)
    mbarrier.init(bars.index(1), count=1)
    if AHEAD:
        _issue(dq, 0, smem, bars, 0, NQ)
        _issue(do, 0, smem, bars, 1, NO)
    for layer in range(LAYERS):
        more = layer + 1 < LAYERS
        # (weights, buffer, its use this layer = the mbarrier parity): qkv 0/0, o 1/0, gate_up 0/1, down 1/1
        _phase(bar_ptr, dq, layer, dg, layer, True, smem, bars, x_ptr, y_ptr, 0, 0, NQ, NG, layout, AHEAD, COMPUTE, BARRIER, FIRST_ADD)
        _phase(bar_ptr, do, layer, dd, layer, True, smem, bars, x_ptr, y_ptr, 1, 0, NO, ND, layout, AHEAD, COMPUTE, BARRIER, FIRST_ADD)
        _phase(bar_ptr, dg, layer, dq, layer + 1, more, smem, bars, x_ptr, y_ptr, 0, 1, NG, NQ, layout, AHEAD, COMPUTE, BARRIER, FIRST_ADD)
        _phase(bar_ptr, dd, layer, do, layer + 1, more, smem, bars, x_ptr, y_ptr, 1, 1, ND, NO, layout, AHEAD, COMPUTE, BARRIER, FIRST_ADD)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args()
    dev = torch.device("cuda")
    P = torch.cuda.get_device_properties(dev).multi_processor_count
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)
    ws = [torch.randn(args.layers * ITEMS.value * BN.value, n * BOX.value, device=dev, dtype=torch.bfloat16) for n in NB]
    descs = [TensorDescriptor.from_tensor(w, [BN.value, BOX.value], layout) for w in ws]
    x = torch.randn(NBMAX.value * BOX.value, device=dev, dtype=torch.bfloat16)
    y = torch.zeros(ITEMS.value * BN.value, device=dev, dtype=torch.float32)
    bar = torch.zeros(1, dtype=torch.int32, device=dev)
    nbytes = sum(w.numel() * 2 for w in ws)
    bw_src = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    bw_dst = torch.empty_like(bw_src)
    for ahead, compute, barrier in ((0, 1, 1), (1, 1, 1), (0, 0, 1), (1, 0, 1), (0, 1, 0), (1, 1, 0), (1, 0, 0), (0, 1, 1), (1, 1, 1)):
        def run() -> None:
            probe_kernel[(P,)](*descs, x, y, bar, args.layers, AHEAD=ahead, FIRST_ADD=2**31 - (P - 1), SMEM_LAYOUT=layout,  # noqa: B023
                               COMPUTE=compute, BARRIER=barrier,  # noqa: B023
                               NQ=NB[0], NO=NB[1], NG=NB[2], ND=NB[3], num_warps=4, launch_cooperative_grid=True)  # fmt: skip
        run()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.reps):
            run()
        end.record()
        end.synchronize()
        us = start.elapsed_time(end) * 1e3 / args.reps
        start.record()
        for _ in range(5):
            bw_dst.copy_(bw_src)
        end.record()
        end.synchronize()
        copy_bw = 2 * bw_src.numel() * 5 / (start.elapsed_time(end) / 1e3)
        floor = nbytes / copy_bw * 1e6
        print(f"AHEAD={ahead} COMPUTE={compute} BARRIER={barrier}: {us:.1f} us for {args.layers} layers = {us / args.layers:.2f} us a layer "
              f"({nbytes / args.layers / 1e6:.1f} MB); copy floor {floor / args.layers:.2f} us a layer; y[0]={y[0].item():.3f}")


if __name__ == "__main__":
    main()
