"""Probe: the 64-row decode's four GEMV phases (o_proj, gate_up + SiLU, down, qkv; 0.6B shapes)
in a Gluon persistent kernel whose weights stream through a shared-memory ring by TMA, issued
as far ahead as the ring holds: across the grid barriers, and at the launch's start before its
PDL wait. Each phase after its barrier only waits for x ([64, K] from L2, TMA) and runs wgmma.
Compared with engine/models/batch_kernel.py, whose tl.dot phases each start their weight reads
after their barrier (bench/RESULTS.md: ~15.9 us of GEMV phases and ~5.4 us of barriers a launch).

Six grid barriers per layer as the real kernel has (two stand in for its norm phases, which this
probe leaves out). Items as the real kernel deals them: tiles of 32 output columns; K splits
o_proj 4, down 4 (fp32 partials), gate_up and qkv 1. Each variant is RING,XS,CK,LAG,BARRIER,NL:
RING weight chunks of [32, CK] bf16 and XS x chunks of [64, CK] per program; LAG frees each
chunk's slots one chunk late, so its MMAs overlap the next chunk's issue; BARRIER 0 drops the
grid barriers (timing only); NL layers a launch, the ring running on across them (1: one launch
per layer, PDL between launches, as the engine must launch with attention between). The last
layer's outputs are checked against torch. Results: bench/RESULTS.md, twenty-fifth session.

    python3 bench/probe_batch_stream.py --layers 28
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from probe_phase_weights import grid_barrier
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

BM, BN = 64, 32  # rows, output columns per item
SHAPE = dict(HID=1024, NH_D=2048, INTER=3072, QKV=4096)  # hidden, heads x head_dim, intermediate, q|k|v
KS_O, KS_D = 4, 4
HID, NH_D, INTER, QKV = (gl.constexpr(v) for v in SHAPE.values())  # the kernels' view


@gluon.jit
def _asm(code: gl.constexpr):
    # A PTX statement without operands (code ends with a comment naming the dummy $0 and $1).
    gl.inline_asm_elementwise(code, "=r,r", [gl.program_id(0)], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _barrier(bar_ptr, FIRST_ADD: gl.constexpr, BARRIER: gl.constexpr):
    grid_barrier(bar_ptr, FIRST_ADD, BARRIER)
    _asm("fence.proxy.async.global; // $0 $1")  # TMA reads what other programs stored before the barrier


@gluon.jit
def _counts(pid, CK: gl.constexpr):
    # This program's weight chunks per phase (0: no item): o_proj, gate_up (gate and up), down, qkv.
    n_o = (pid < (HID // 32) * 4).to(gl.int32) * ((NH_D // 4) // CK)
    n_g = (pid < INTER // 32).to(gl.int32) * (2 * (HID // CK))
    n_d = (pid < (HID // 32) * 4).to(gl.int32) * ((INTER // 4) // CK)
    n_q = (pid < QKV // 32).to(gl.int32) * (HID // CK)
    return n_o, n_g, n_d, n_q


@gluon.jit
def _issue_w(s, layer0, wo, wg, wd, wq, w_smem, w_bars, RING: gl.constexpr, CK: gl.constexpr, NL: gl.constexpr):
    # Weight chunk s ([32, CK]) of this program's stream in this launch (layers layer0 ..
    # layer0 + NL) into ring slot s % RING.
    pid = gl.program_id(0)
    n_o, n_g, n_d, n_q = _counts(pid, CK)
    per_layer = n_o + n_g + n_d + n_q
    if s < per_layer * NL:
        bar = w_bars.index(s % RING)
        layer = layer0 + s // per_layer
        r = s % per_layer
        dst = w_smem.index(s % RING)
        mbarrier.expect(bar, 32 * CK * 2)
        if r < n_o:  # item (tile pid // 4, K split pid % 4)
            tma.async_copy_global_to_shared(wo, [layer * HID + (pid // 4) * 32, (pid % 4) * (NH_D // 4) + r * CK], bar, dst)
        elif r < n_o + n_g:  # gate, up, gate, ... per K chunk
            j = r - n_o
            tma.async_copy_global_to_shared(wg, [layer * 2 * INTER + (j % 2) * INTER + pid * 32, (j // 2) * CK], bar, dst)
        elif r < n_o + n_g + n_d:
            j = r - n_o - n_g
            tma.async_copy_global_to_shared(wd, [layer * HID + (pid // 4) * 32, (pid % 4) * (INTER // 4) + j * CK], bar, dst)
        else:
            j = r - n_o - n_g - n_d
            tma.async_copy_global_to_shared(wq, [layer * QKV + pid * 32, j * CK], bar, dst)


@gluon.jit
def _issue_x(xd, col, xc, x_smem, x_bars, XS: gl.constexpr, CK: gl.constexpr):
    # x [64, CK] at column col into x slot xc % XS.
    slot = xc % XS
    mbarrier.expect(x_bars.index(slot), 64 * CK * 2)
    tma.async_copy_global_to_shared(xd, [0, col], x_bars.index(slot), x_smem.index(slot))


@gluon.jit
def _wait_w(s, w_smem, w_bars, RING: gl.constexpr):
    mbarrier.wait(w_bars.index(s % RING), (s // RING) & 1)
    return w_smem.index(s % RING).permute((1, 0))  # [CK, 32]: B of x @ w.T


@gluon.jit
def _release(k, nk, used, xd, k0, xc, layer, wo, wg, wd, wq, w_smem, w_bars, x_smem, x_bars,
             G: gl.constexpr, RING: gl.constexpr, XS: gl.constexpr, CK: gl.constexpr, NL: gl.constexpr):  # fmt: skip
    # Chunk k's MMAs are done: its G weight slots take the stream's chunks RING later, its x slot
    # this phase's x chunk k + XS.
    for g in gl.static_range(G):
        _issue_w(used + g + RING, layer, wo, wg, wd, wq, w_smem, w_bars, RING, CK, NL)
    if k + XS < nk:
        _issue_x(xd, k0 + (k + XS) * CK, xc + k + XS, x_smem, x_bars, XS, CK)


@gluon.jit
def _phase(xd, k0, nk, used, xc, layer, wo, wg, wd, wq, w_smem, w_bars, x_smem, x_bars, out_ptr, col0, out_n,
           mma: gl.constexpr, RING: gl.constexpr, XS: gl.constexpr, CK: gl.constexpr, SILU: gl.constexpr,
           LAG: gl.constexpr, NL: gl.constexpr):  # fmt: skip
    # x chunks of CK columns from column k0, nk of them, against this program's next nk (SILU: 2 nk)
    # weight chunks; out [64, out_n] at columns col0: fp32 (partials) or, SILU, bf16 silu(gate) * up.
    # LAG: each chunk's MMAs run while the next chunk's are issued (its slots freed one chunk late).
    G: gl.constexpr = 2 if SILU else 1
    for k in gl.static_range(XS):
        if k < nk:
            _issue_x(xd, k0 + k * CK, xc + k, x_smem, x_bars, XS, CK)
    acc = gl.zeros([64, 32], gl.float32, mma)
    acc_u = gl.zeros([64, 32], gl.float32, mma)
    for k in range(nk):
        slot = (xc + k) % XS
        mbarrier.wait(x_bars.index(slot), ((xc + k) // XS) & 1)
        x = x_smem.index(slot)
        acc = warpgroup_mma(x, _wait_w(used, w_smem, w_bars, RING), acc, is_async=True)
        if SILU:
            acc_u = warpgroup_mma(x, _wait_w(used + 1, w_smem, w_bars, RING), acc_u, is_async=True)
        if LAG:
            acc, acc_u = warpgroup_mma_wait(G, deps=(acc, acc_u))
            if k > 0:
                _release(k - 1, nk, used - G, xd, k0, xc, layer, wo, wg, wd, wq, w_smem, w_bars, x_smem, x_bars, G, RING, XS, CK, NL)
        else:
            acc, acc_u = warpgroup_mma_wait(0, deps=(acc, acc_u))
            _release(k, nk, used, xd, k0, xc, layer, wo, wg, wd, wq, w_smem, w_bars, x_smem, x_bars, G, RING, XS, CK, NL)
        used += G
    if nk > 0:
        if LAG:
            acc, acc_u = warpgroup_mma_wait(0, deps=(acc, acc_u))
            _release(nk - 1, nk, used - G, xd, k0, xc, layer, wo, wg, wd, wq, w_smem, w_bars, x_smem, x_bars, G, RING, XS, CK, NL)
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
                  RING: gl.constexpr, XS: gl.constexpr, CK: gl.constexpr, LAG: gl.constexpr, FIRST_ADD: gl.constexpr,
                  BARRIER: gl.constexpr, NL: gl.constexpr):  # fmt: skip
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 32, 16])
    w_smem = gl.allocate_shared_memory(gl.bfloat16, [RING, 32, CK], wo.layout)
    x_smem = gl.allocate_shared_memory(gl.bfloat16, [XS, 64, CK], xa.layout)
    w_bars = gl.allocate_shared_memory(gl.int64, [RING, 1], mbarrier.MBarrierLayout())
    x_bars = gl.allocate_shared_memory(gl.int64, [XS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(RING):
        mbarrier.init(w_bars.index(i), count=1)
    for i in gl.static_range(XS):
        mbarrier.init(x_bars.index(i), count=1)
    pid = gl.program_id(0)
    # Weights depend on no kernel: the ring fills while the kernel before still runs.
    for s in gl.static_range(RING):
        _issue_w(s, layer, wo, wg, wd, wq, w_smem, w_bars, RING, CK, NL)
    _asm("griddepcontrol.wait; // $0 $1")
    _asm("griddepcontrol.launch_dependents; // $0 $1")
    n_o, n_g, n_d, n_q = _counts(pid, CK)
    used = 0
    xc = 0
    for _ in range(NL):  # NL layers in this launch, the ring running on across them
        # o_proj: item (tile pid // 4, K split pid % 4) -> o_part[c] [64, HID] fp32
        used, xc = _phase(xa, (pid % 4) * (NH_D // 4), n_o, used, xc, layer, wo, wg, wd, wq, w_smem, w_bars, x_smem, x_bars,
                          o_ptr + (pid % 4) * 64 * HID, (pid // 4) * 32, HID, mma, RING, XS, CK, False, LAG, NL)
        _barrier(bar_ptr, FIRST_ADD, BARRIER)
        _barrier(bar_ptr, FIRST_ADD, BARRIER)  # (the norm phase)
        used, xc = _phase(xn, 0, n_g // 2, used, xc, layer, wo, wg, wd, wq, w_smem, w_bars, x_smem, x_bars,
                          act_ptr, pid * 32, INTER, mma, RING, XS, CK, True, LAG, NL)
        _barrier(bar_ptr, FIRST_ADD, BARRIER)
        used, xc = _phase(xact, (pid % 4) * (INTER // 4), n_d, used, xc, layer, wo, wg, wd, wq, w_smem, w_bars, x_smem, x_bars,
                          d_ptr + (pid % 4) * 64 * HID, (pid // 4) * 32, HID, mma, RING, XS, CK, False, LAG, NL)
        _barrier(bar_ptr, FIRST_ADD, BARRIER)
        _barrier(bar_ptr, FIRST_ADD, BARRIER)  # (the norm phase)
        used, xc = _phase(xn, 0, n_q, used, xc, layer, wo, wg, wd, wq, w_smem, w_bars, x_smem, x_bars,
                          q_ptr, pid * 32, QKV, mma, RING, XS, CK, False, LAG, NL)
        _barrier(bar_ptr, FIRST_ADD, BARRIER)  # (before the rope phase)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--variants", default="8,3,128,1,1,1;6,3,256,0,1,1;6,3,256,1,0,1;8,3,128,1,1,28;6,3,256,0,1,28;6,3,256,1,0,28;12,3,128,1,1,28",
                   help="';'-separated RING,XS,CK,LAG,BARRIER,NL (NL layers a launch)")
    args = p.parse_args()
    dev, bf = torch.device("cuda"), torch.bfloat16
    P = torch.cuda.get_device_properties(dev).multi_processor_count
    L = args.layers
    HID, NH_D, INTER, QKV = SHAPE.values()  # noqa: N806
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
    nbytes = sum(w.numel() * 2 for w in (wo, wg, wd, wq)) / L
    src = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    for variant in args.variants.split(";"):
        ring, xs, ck, lag, barrier, nl = (int(v) for v in variant.split(","))
        w_layout = gl.NVMMASharedLayout.get_default_for([BN, ck], gl.bfloat16)
        x_layout = gl.NVMMASharedLayout.get_default_for([BM, ck], gl.bfloat16)
        wdesc = [TensorDescriptor.from_tensor(w, [BN, ck], w_layout) for w in (wo, wg, wd, wq)]
        xdesc = [TensorDescriptor.from_tensor(x, [BM, ck], x_layout) for x in (xa, xn, act)]
        knobs = dict(RING=ring, XS=xs, CK=ck, LAG=lag, BARRIER=barrier, NL=nl, FIRST_ADD=2**31 - (P - 1))

        def step() -> None:
            bar.zero_()
            for layer in range(0, L, nl):  # noqa: B023
                stream_kernel[(P,)](*wdesc, *xdesc, act, o_part, d_part, q, bar, layer, **knobs, num_warps=4,  # noqa: B023
                                    launch_cooperative_grid=True, launch_pdl=True)  # fmt: skip

        step()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        graph.replay()
        torch.cuda.synchronize()
        errs = [float("nan")] * 4
        if barrier:  # the last layer's outputs against torch
            up = xn.float() @ wg[-INTER:].float().T
            ref = [xa.float() @ wo[-HID:].float().T, F.silu(xn.float() @ wg[-2 * INTER : -INTER].float().T) * up,
                   act.float() @ wd[-HID:].float().T, xn.float() @ wq[-QKV:].float().T]  # fmt: skip
            got = [o_part.sum(0), act.float(), d_part.sum(0), q]
            errs = [((a - b).abs().max() / b.abs().max()).item() for a, b in zip(got, ref, strict=True)]
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
        print(f"RING={ring} ({ring * ck // 16} KB) XS={xs} CK={ck} LAG={lag} BARRIER={barrier} NL={nl}: {us:.2f} us a launch; "
              f"weights {nbytes / 1e6:.1f} MB = {floor:.2f} us at the copy bandwidth; "
              f"errors o/act/down/qkv {', '.join(f'{e:.1e}' for e in errs)}")  # fmt: skip


if __name__ == "__main__":
    main()
