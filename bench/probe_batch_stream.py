"""Probe: the 64-row decode's four GEMV phases (o_proj, gate_up + SiLU, down, qkv; 0.6B shapes)
in a Gluon persistent kernel whose weights stream through a shared-memory ring by TMA, issued
as far ahead as the ring holds: across the grid barriers, and at the launch's start before its
PDL wait. Each phase after its barrier only waits for x ([64, K] from L2, TMA) and runs wgmma.
Compared with engine/models/batch_kernel.py, whose tl.dot phases each start their weight reads
after their barrier (bench/RESULTS.md: 15.9 us of GEMV phases and ~5.4 us of barriers a launch).

One launch per layer, PDL between launches, six grid barriers per launch as the real kernel has
(two stand in for its norm phases, which this probe leaves out). Items as the real kernel deals
them: tiles of 32 output columns; K splits o_proj 4, down 4 (fp32 partials), gate_up and qkv 1.
RING chunks of [32, 128] bf16 (8 KB) per program; RING 2 issues each chunk just in time.

    python3 bench/probe_batch_stream.py --layers 28
"""

from __future__ import annotations

import argparse

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

BM, BN, BK = 64, 32, 128  # rows, output columns per item, K per chunk
HID, NH_D, INTER, QKV = 1024, 2048, 3072, 4096
KS_O, KS_D = 4, 4


@gluon.jit
def _asm(code: gl.constexpr):
    # A PTX statement without operands (code ends with a comment naming the dummy $0 and $1).
    gl.inline_asm_elementwise(code, "=r,r", [gl.program_id(0)], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _grid_barrier(bar_ptr, FIRST_ADD: gl.constexpr, BARRIER: gl.constexpr):
    gl.thread_barrier()
    if BARRIER:
        add = 1
        if gl.program_id(0) == 0:
            add = FIRST_ADD
        old = gl.atomic_add(bar_ptr, add, sem="release", scope="gpu")
        cur = gl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [bar_ptr], dtype=gl.int32, is_pure=False, pack=1)
        while (old ^ cur) >= 0:
            cur = gl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [bar_ptr], dtype=gl.int32, is_pure=False, pack=1)
    gl.thread_barrier()
    _asm("fence.proxy.async.global; // $0 $1")  # TMA reads what other programs stored before the barrier


@gluon.jit
def _counts(pid):
    # This program's weight chunks per phase (0: no item): o_proj, gate_up (gate and up), down, qkv.
    n_o = (pid < (HID // 32) * 4).to(gl.int32) * ((NH_D // 4) // 128)
    n_g = (pid < INTER // 32).to(gl.int32) * (2 * (HID // 128))
    n_d = (pid < (HID // 32) * 4).to(gl.int32) * ((INTER // 4) // 128)
    n_q = (pid < QKV // 32).to(gl.int32) * (HID // 128)
    return n_o, n_g, n_d, n_q


@gluon.jit
def _issue_w(s, layer, wo, wg, wd, wq, w_smem, w_bars, RING: gl.constexpr):
    # Weight chunk s of this program's stream in this launch into ring slot s % RING.
    pid = gl.program_id(0)
    n_o, n_g, n_d, n_q = _counts(pid)
    if s < n_o + n_g + n_d + n_q:
        bar = w_bars.index(s % RING)
        dst = w_smem.index(s % RING)
        mbarrier.expect(bar, 32 * 128 * 2)
        if s < n_o:  # item (tile pid // 4, K split pid % 4)
            tma.async_copy_global_to_shared(wo, [layer * HID + (pid // 4) * 32, ((pid % 4) * 4 + s) * 128], bar, dst)
        elif s < n_o + n_g:  # gate, up, gate, ... per K chunk
            j = s - n_o
            tma.async_copy_global_to_shared(wg, [layer * 2 * INTER + (j % 2) * INTER + pid * 32, (j // 2) * 128], bar, dst)
        elif s < n_o + n_g + n_d:
            j = s - n_o - n_g
            tma.async_copy_global_to_shared(wd, [layer * HID + (pid // 4) * 32, ((pid % 4) * 6 + j) * 128], bar, dst)
        else:
            j = s - n_o - n_g - n_d
            tma.async_copy_global_to_shared(wq, [layer * QKV + pid * 32, j * 128], bar, dst)


@gluon.jit
def _issue_x(xd, k, xc, x_smem, x_bars, XS: gl.constexpr):
    slot = xc % XS
    mbarrier.expect(x_bars.index(slot), 64 * 128 * 2)
    tma.async_copy_global_to_shared(xd, [0, k * 128], x_bars.index(slot), x_smem.index(slot))


@gluon.jit
def _wait_w(s, w_smem, w_bars, RING: gl.constexpr):
    mbarrier.wait(w_bars.index(s % RING), (s // RING) & 1)
    return w_smem.index(s % RING).permute((1, 0))  # [128, 32]: B of x @ w.T


@gluon.jit
def _phase(xd, k0, nk, used, xc, layer, wo, wg, wd, wq, w_smem, w_bars, x_smem, x_bars, out_ptr, col0, out_n,
           mma: gl.constexpr, RING: gl.constexpr, XS: gl.constexpr, SILU: gl.constexpr):  # fmt: skip
    # x chunks k0 .. k0 + nk (of 128 columns) against this program's next nk (SILU: 2 nk) weight
    # chunks; out [64, out_n] at columns col0: fp32 (partials) or, SILU, bf16 silu(gate) * up.
    for k in gl.static_range(XS):
        if k < nk:
            _issue_x(xd, k0 + k, xc + k, x_smem, x_bars, XS)
    acc = gl.zeros([64, 32], gl.float32, mma)
    acc_u = gl.zeros([64, 32], gl.float32, mma)
    for k in range(nk):
        slot = (xc + k) % XS
        mbarrier.wait(x_bars.index(slot), ((xc + k) // XS) & 1)
        x = x_smem.index(slot)
        acc = warpgroup_mma(x, _wait_w(used, w_smem, w_bars, RING), acc, is_async=True)
        if SILU:
            acc_u = warpgroup_mma(x, _wait_w(used + 1, w_smem, w_bars, RING), acc_u, is_async=True)
        acc, acc_u = warpgroup_mma_wait(0, deps=(acc, acc_u))
        _issue_w(used + RING, layer, wo, wg, wd, wq, w_smem, w_bars, RING)
        used += 1
        if SILU:
            _issue_w(used + RING, layer, wo, wg, wd, wq, w_smem, w_bars, RING)
            used += 1
        if k + XS < nk:
            _issue_x(xd, k0 + k + XS, xc + k + XS, x_smem, x_bars, XS)
    if nk > 0:
        rows = gl.arange(0, 64, layout=gl.SliceLayout(1, mma))[:, None]
        cols = col0 + gl.arange(0, 32, layout=gl.SliceLayout(0, mma))[None, :]
        if SILU:
            act = (acc / (1.0 + gl.exp(-acc))) * acc_u
            gl.store(out_ptr + rows * out_n + cols, act.to(gl.bfloat16))
        else:
            gl.store(out_ptr + rows * out_n + cols, acc)
    return used, xc + nk


@gluon.jit
def stream_kernel(wo, wg, wd, wq, xa, xn, xact, act_ptr, o_ptr, d_ptr, q_ptr, bar_ptr, layer,
                  RING: gl.constexpr, XS: gl.constexpr, FIRST_ADD: gl.constexpr, BARRIER: gl.constexpr):  # fmt: skip
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 32, 16])
    w_smem = gl.allocate_shared_memory(gl.bfloat16, [RING, 32, 128], wo.layout)
    x_smem = gl.allocate_shared_memory(gl.bfloat16, [XS, 64, 128], xa.layout)
    w_bars = gl.allocate_shared_memory(gl.int64, [RING, 1], mbarrier.MBarrierLayout())
    x_bars = gl.allocate_shared_memory(gl.int64, [XS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(RING):
        mbarrier.init(w_bars.index(i), count=1)
    for i in gl.static_range(XS):
        mbarrier.init(x_bars.index(i), count=1)
    pid = gl.program_id(0)
    # Weights depend on no kernel: the ring fills while the kernel before still runs.
    for s in gl.static_range(RING):
        _issue_w(s, layer, wo, wg, wd, wq, w_smem, w_bars, RING)
    _asm("griddepcontrol.wait; // $0 $1")
    _asm("griddepcontrol.launch_dependents; // $0 $1")
    n_o, n_g, n_d, n_q = _counts(pid)
    used = 0
    xc = 0
    # o_proj: item (tile pid // 4, K split pid % 4) -> o_part[c] [64, HID] fp32
    used, xc = _phase(xa, (pid % 4) * 4, n_o, used, xc, layer, wo, wg, wd, wq, w_smem, w_bars, x_smem, x_bars,
                      o_ptr + (pid % 4) * 64 * HID, (pid // 4) * 32, HID, mma, RING, XS, False)
    _grid_barrier(bar_ptr, FIRST_ADD, BARRIER)
    _grid_barrier(bar_ptr, FIRST_ADD, BARRIER)  # (the norm phase)
    used, xc = _phase(xn, 0, n_g // 2, used, xc, layer, wo, wg, wd, wq, w_smem, w_bars, x_smem, x_bars,
                      act_ptr, pid * 32, INTER, mma, RING, XS, True)
    _grid_barrier(bar_ptr, FIRST_ADD, BARRIER)
    used, xc = _phase(xact, (pid % 4) * 6, n_d, used, xc, layer, wo, wg, wd, wq, w_smem, w_bars, x_smem, x_bars,
                      d_ptr + (pid % 4) * 64 * HID, (pid // 4) * 32, HID, mma, RING, XS, False)
    _grid_barrier(bar_ptr, FIRST_ADD, BARRIER)
    _grid_barrier(bar_ptr, FIRST_ADD, BARRIER)  # (the norm phase)
    used, xc = _phase(xn, 0, n_q, used, xc, layer, wo, wg, wd, wq, w_smem, w_bars, x_smem, x_bars,
                      q_ptr, pid * 32, QKV, mma, RING, XS, False)
    _grid_barrier(bar_ptr, FIRST_ADD, BARRIER)  # (before the rope phase)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--rings", default="2,8,16,20")
    args = p.parse_args()
    dev, bf = torch.device("cuda"), torch.bfloat16
    P = torch.cuda.get_device_properties(dev).multi_processor_count
    L = args.layers
    g = torch.Generator(device=dev).manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, device=dev, generator=g) * 0.05).to(bf)

    wo, wg, wd, wq = rand(L * HID, NH_D), rand(L * 2 * INTER, HID), rand(L * HID, INTER), rand(L * QKV, HID)
    xa, xn = rand(BM, NH_D), rand(BM, HID)
    act = torch.zeros(BM, INTER, device=dev, dtype=bf)
    o_part = torch.zeros(KS_O, BM, HID, device=dev)
    d_part = torch.zeros(KS_D, BM, HID, device=dev)
    q = torch.zeros(BM, QKV, device=dev)
    bar = torch.zeros(1, dtype=torch.int32, device=dev)
    w_layout = gl.NVMMASharedLayout.get_default_for([BN, BK], gl.bfloat16)
    x_layout = gl.NVMMASharedLayout.get_default_for([BM, BK], gl.bfloat16)
    wdesc = [TensorDescriptor.from_tensor(w, [BN, BK], w_layout) for w in (wo, wg, wd, wq)]
    xdesc = [TensorDescriptor.from_tensor(x, [BM, BK], x_layout) for x in (xa, xn, act)]
    nbytes = sum(w.numel() * 2 for w in (wo, wg, wd, wq)) / L
    src = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    for ring in (int(r) for r in args.rings.split(",")):
        for barrier in (1, 0):

            def step() -> None:
                bar.zero_()
                for layer in range(L):
                    stream_kernel[(P,)](*wdesc, *xdesc, act, o_part, d_part, q, bar, layer, RING=ring, XS=3,  # noqa: B023
                                        FIRST_ADD=2**31 - (P - 1), BARRIER=barrier, num_warps=4,  # noqa: B023
                                        launch_cooperative_grid=True, launch_pdl=True)  # fmt: skip

            step()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            graph.replay()
            torch.cuda.synchronize()
            if barrier:  # the last layer's outputs against torch
                ref_o = xa.float() @ wo[-HID:].float().T
                ref_act = (torch.nn.functional.silu(xn.float() @ wg[-2 * INTER : -INTER].float().T) * (xn.float() @ wg[-INTER:].float().T))
                ref_d = act.float() @ wd[-HID:].float().T
                ref_q = xn.float() @ wq[-QKV:].float().T
                errs = [((a - b).abs().max() / b.abs().max()).item() for a, b in
                        ((o_part.sum(0), ref_o), (act.float(), ref_act), (d_part.sum(0), ref_d), (q, ref_q))]  # fmt: skip
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(args.reps):
                graph.replay()
            end.record()
            end.synchronize()
            us = start.elapsed_time(end) * 1e3 / args.reps / L
            start.record()
            for _ in range(5):
                dst.copy_(src)
            end.record()
            end.synchronize()
            floor = nbytes / (2 * src.numel() * 5 / (start.elapsed_time(end) / 1e3)) * 1e6
            print(f"RING={ring} ({ring * 8} KB) BARRIER={barrier}: {us:.2f} us a launch; weights {nbytes / 1e6:.1f} MB = "
                  f"{floor:.2f} us at the copy bandwidth; errors o/act/down/qkv {', '.join(f'{e:.1e}' for e in errs)}")


if __name__ == "__main__":
    main()
