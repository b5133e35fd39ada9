"""The pieces of Siesta's persistent decode kernels (layer_kernel.py, batch_kernel.py): the
row-norm phase, the GEMV phase and the L2 prefetch of a GEMV phase's weights; the grid barrier
between phases is grid_barrier.py's.
Triton functions inlined into those kernels, not kernels; only modules that import Triton import
this one.

L2 prefetch (`prefetch_items`, gemv_phase's dealing of items): a program pulls the first weights
of its items of a later GEMV phase into L2 where HBM would idle: once its own item before is
done, over the barrier (and norm) or launch boundary between, or under o_proj's split merge.
Issued between a barrier's `grid_arrive` and its `grid_wait`, a prefetch delays neither the
program's own loads nor its release (one-row kernel, bench/history/2026-11-27.md).
Whole tiles, or every weight phase at once, only take bandwidth from the phase running
(bench/history/2026-11-23.md, 2026-11-24.md, 2026-11-27.md).

Lamport (lamport.py): a gemv_phase can store no -0.0 (OUT_LAMPORT) or wait for its x slice to
hold no sentinel (X_LAMPORT), and a norm_phase can wait for its partial sums (PART_LAMPORT), so no
grid barrier is needed between producer and consumer; `unwrite_items` puts the sentinel back into
a producer's items.

Scratch written by other programs in an earlier phase is read with `.cg` (L2, not L1).
Roundings are the unfused layers' (fused_ops.py, skinny_linear.py): a GEMV rounds its fp32 sum
(plus bias) once; a residual add rounds the sum of its fp32 partials, then the add.

K order: a GEMV phase's splits may be `--deterministic`'s chunks (invariant_tiles.config,
CHUNK long, the last one shorter) and an item may walk them (WALK), each from zero, added in
chunk order: then a GEMV phase, its partials summed in order, has invariant_matmul's bits
(tests/test_grid_phases.py).
"""

from __future__ import annotations

import triton
import triton.language as tl

from engine.kernels.fused_ops import silu_mul
from engine.kernels.grid_barrier import grid_arrive, grid_wait, phase_end, stamp
from engine.kernels.lamport import await_rows, await_sum, sentinel_like, written
from engine.kernels.pdl import prefetch_l2


@triton.jit
def rnd(x, DTYPE: tl.constexpr):
    # fp32 -> DTYPE -> fp32: the rounding a torch op in that dtype does.
    return x.to(DTYPE).to(tl.float32)


@triton.jit
def phase_end_prefetching(
    bar_ptr, t_ptr, POINT: tl.constexpr, FIRST_ADD: tl.constexpr, TIMING: tl.constexpr, issue,
    w_ptr, N: tl.constexpr, K: tl.constexpr, KS: tl.constexpr, SILU: tl.constexpr, BN: tl.constexpr, P: tl.constexpr,
    KPRE: tl.constexpr, LAST_LEAVES: tl.constexpr = False, SYNC: tl.constexpr = True,
):  # fmt: skip
    # phase_end, with this program's prefetch_items(w_ptr, ...) of the next GEMV phase issued (KPRE
    # > 0 and `issue`) between its arrival and its wait: they land while it waits. Without SYNC
    # (the next phase waits on its data: lamport.py) no barrier, only the stamps and prefetches.
    stamp(t_ptr, POINT, TIMING)
    if SYNC:
        old = grid_arrive(bar_ptr, FIRST_ADD, LAST_LEAVES)
    if KPRE > 0:
        if issue:
            prefetch_items(w_ptr, N, K, KS, SILU, BN, P, KPRE)
    if SYNC:
        grid_wait(bar_ptr, old, FIRST_ADD, LAST_LEAVES)
    stamp(t_ptr, POINT + 1, TIMING)


@triton.jit
def part_sum(part_ptr, off, mask, stride_part, KS: tl.constexpr):
    # part[0][off] + part[1][off] + ... (KS >= 1 fp32 partials at stride_part, in that order),
    # through L2 (`.cg`: other programs wrote them).
    s = tl.load(part_ptr + off, mask=mask, other=0.0, cache_modifier=".cg")
    for c in tl.static_range(1, KS):
        s += tl.load(part_ptr + c * stride_part + off, mask=mask, other=0.0, cache_modifier=".cg")
    return s


@triton.jit
def _stream(base_ptr, part_ptr, off, mask, stride_part, KS: tl.constexpr, DTYPE: tl.constexpr, PART_LAMPORT: tl.constexpr):
    # [BLOCK] fp32 chunk of base + round(sum_c part[c]), rounded (the residual add); base_ptr and
    # part_ptr point at the row's start (base: the embedding's row of a token, at layer 0).
    # PART_LAMPORT: part is a Lamport buffer, summed once none of it is the sentinel.
    h = tl.load(base_ptr + off, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    if KS > 0:
        if PART_LAMPORT:
            s = await_sum(part_ptr, off, mask, stride_part, KS)
        else:
            s = part_sum(part_ptr, off, mask, stride_part, KS)
        h = rnd(h + rnd(s, DTYPE), DTYPE)
    return h


@triton.jit
def norm_weight(w_ptr, HID: tl.constexpr, BLOCK: tl.constexpr):
    # A norm's weight [BLOCK] (its dtype; zeros past HID), for norm_phase's W_LOADED: loaded
    # where nothing waits on it yet (it is no kernel's output), not after the row's sum of squares.
    offs = tl.arange(0, BLOCK)
    return tl.load(w_ptr + offs, mask=offs < HID, other=0.0)


@triton.jit
def norm_phase(
    row, base_ptr, part_ptr, stride_part, h_out_ptr, w_ptr, xn_ptr, M, eps, store_h,
    KS: tl.constexpr, HID: tl.constexpr, BLOCK: tl.constexpr, DTYPE: tl.constexpr, ids_ptr=None,
    EMBED: tl.constexpr = False, PART_LAMPORT: tl.constexpr = False, W_LOADED: tl.constexpr = False,
):  # fmt: skip
    # The program given row < M: the stream h = base + round(sum_c part[c]) (KS 0: base alone)
    # -> h_out (if store_h), and xn = norm(h) * w -> xn (fused_ops._rms_norm_kernel's roundings).
    # Rows at stride HID in every buffer; part [KS, *, HID] at stride_part. EMBED (KS 0): base is
    # the embedding table [V, HID], its row ids[row] the stream: the lookup folded into the norm.
    # PART_LAMPORT: part is a Lamport buffer (lamport.py), waited for here instead of a barrier.
    # W_LOADED: w_ptr is the weight itself (norm_weight's); else it is loaded before the stream,
    # so its latency overlaps the partial sums' instead of following the sum of squares.
    if row < M:
        offs = tl.arange(0, BLOCK)
        ok = offs < HID
        off = row * HID + offs
        if W_LOADED:
            w = w_ptr.to(tl.float32)
        else:
            w = norm_weight(w_ptr, HID, BLOCK).to(tl.float32)
        src = row
        if EMBED:
            src = tl.load(ids_ptr + row).to(tl.int64)
        h = _stream(base_ptr + src * HID, part_ptr + row * HID, offs, ok, stride_part, KS, DTYPE, PART_LAMPORT)
        tl.store(h_out_ptr + off, h.to(DTYPE), mask=ok & store_h)
        rstd = tl.math.rsqrt(tl.sum(h * h, 0) * (1.0 / HID) + eps)
        tl.store(xn_ptr + off, (w * rnd(h * rstd, DTYPE)).to(DTYPE), mask=ok)



@triton.jit
def norm_step(
    row, base_ptr, part_ptr, stride_part, h_out_ptr, w, xn_ptr, M, eps, ids_ptr, bar_ptr, t_ptr,
    POINT: tl.constexpr, KS: tl.constexpr, HID: tl.constexpr, BLOCK: tl.constexpr, DTYPE: tl.constexpr, EMBED: tl.constexpr,
    EVERYWHERE: tl.constexpr, FIRST_ADD: tl.constexpr, TIMING: tl.constexpr, PART_LAMPORT: tl.constexpr = False,
    BARRIER: tl.constexpr = True, LAST_LEAVES: tl.constexpr = False,
):  # fmt: skip
    # A norm phase (w: its weight, norm_weight's) and what ends it, stamped at POINT and POINT + 1.
    # EVERYWHERE: every program normalizes every row into its own xn rows (xn_ptr: this
    # program's), program 0 keeps the stream, a CTA barrier. Else the program given `row`
    # normalizes it (if any) into the shared rows, then (BARRIER) a grid barrier.
    if EVERYWHERE:
        for r in range(M):
            norm_phase(r, base_ptr, part_ptr, stride_part, h_out_ptr, w, xn_ptr, M, eps, tl.program_id(0) == 0, KS, HID, BLOCK, DTYPE,
                       ids_ptr, EMBED, PART_LAMPORT, True)  # fmt: skip
        stamp(t_ptr, POINT, TIMING)
        tl.debug_barrier()
        stamp(t_ptr, POINT + 1, TIMING)
    else:
        norm_phase(row, base_ptr, part_ptr, stride_part, h_out_ptr, w, xn_ptr, M, eps, True, KS, HID, BLOCK, DTYPE, ids_ptr, EMBED,
                   PART_LAMPORT, True)  # fmt: skip
        if BARRIER:
            phase_end(bar_ptr, t_ptr, POINT, FIRST_ADD, TIMING, LAST_LEAVES)

@triton.jit
def _item(item, N: tl.constexpr, K: tl.constexpr, KS: tl.constexpr, BN: tl.constexpr, KC: tl.constexpr):
    # A GEMV phase's item (of (N + BN - 1) // BN * KS: tiles of BN output columns x K splits of
    # KC, the last one shorter where KC * KS > K) -> (its K split c, its columns offs_n [BN], their
    # weight rows' offsets w_rows [BN, 1] int64, clamped to row N - 1, its split's first K index).
    c = item % KS
    offs_n = (item // KS) * BN + tl.arange(0, BN)
    w_rows = tl.minimum(offs_n, N - 1).to(tl.int64)[:, None] * K
    return c, offs_n, w_rows, c * KC


@triton.jit
def gemv_phase(
    x_ptr, stride_x, w_ptr, b_ptr, out_ptr, stride_out, M,
    N: tl.constexpr, K: tl.constexpr, KS: tl.constexpr, PARTIAL: tl.constexpr, SILU: tl.constexpr,
    HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, P: tl.constexpr, DTYPE: tl.constexpr,
    X_LAMPORT: tl.constexpr = False, OUT_LAMPORT: tl.constexpr = False, CHUNK: tl.constexpr = 0, WALK: tl.constexpr = 1,
    FLAT_WALK: tl.constexpr = False,
):  # fmt: skip
    # Items (tile of BN cols, K split c) dealt round-robin (item i -> program i % P); x [M, K] at
    # row stride stride_x, M <= BM. PARTIAL: out[c] [M, N] fp32 partial sums of x[:, c-th split] @
    # w[:, c-th split].T, at stride_out. Else (KS 1): out [M, N] = x @ w.T (+ bias), rounded once,
    # or silu(gate) * up of w = gate | up with SILU.
    # Splits are K / KS long, or CHUNK (a multiple of BK; the last split shorter where CHUNK * KS
    # > K). WALK > 1 (KS 1): an item walks WALK chunks of CHUNK, each summed from zero and added
    # in order, ((p_0 + p_1) + p_2) + ...: invariant_matmul.py's K order (`--deterministic`);
    # FLAT_WALK, in one loop over the walk's K steps (one pipeline ramp, not one a chunk), each
    # chunk's dots still from zero and its sum added at its last step: the same sums.
    # Lamport buffers (lamport.py), so no grid barrier between producer and consumer: X_LAMPORT,
    # an item first waits until its x slice holds no sentinel; OUT_LAMPORT, out gets no -0.0.
    pid = tl.program_id(0)
    rows = tl.arange(0, BM)
    m_ok = rows < M
    offs_k = tl.arange(0, BK)
    KC: tl.constexpr = CHUNK if CHUNK > 0 else K // (KS * WALK)
    SHORT: tl.constexpr = KC * KS * WALK > K  # the last chunk ends at K
    tl.static_assert(WALK == 1 or (KS == 1 and not X_LAMPORT), "an item walks its chunks only without K splits or Lamport x")
    items: tl.constexpr = (N + BN - 1) // BN * KS
    for item in range(pid, items, P):
        c, offs_n, w_rows, k_lo = _item(item, N, K, KS, BN, KC)
        n_ok = offs_n < N
        if X_LAMPORT:
            await_rows(x_ptr, stride_x, M, k_lo, KC, BM, BK)
        acc = tl.zeros([BM, BN], tl.float32)
        acc_up = tl.zeros([BM, BN], tl.float32)
        if FLAT_WALK and WALK > 1 and not SHORT:  # one software pipeline over the walk's K steps
            STEPS: tl.constexpr = KC // BK
            part = tl.zeros([BM, BN], tl.float32)
            part_up = tl.zeros([BM, BN], tl.float32)
            for t in range(0, WALK * STEPS):
                cols = (k_lo + t * BK + offs_k)[None, :]
                x = tl.load(x_ptr + rows[:, None] * stride_x + cols, mask=m_ok[:, None], other=0.0, cache_modifier=".cg")
                first, last = t % STEPS == 0, t % STEPS == STEPS - 1  # of a chunk: its sum starts from zero
                part = tl.dot(x, tl.trans(tl.load(w_ptr + w_rows + cols)), tl.where(first, 0.0, part))
                acc = tl.where(last, tl.where(t < STEPS, part, acc + part), acc)
                if SILU:
                    part_up = tl.dot(x, tl.trans(tl.load(w_ptr + N * K + w_rows + cols)), tl.where(first, 0.0, part_up))
                    acc_up = tl.where(last, tl.where(t < STEPS, part_up, acc_up + part_up), acc_up)
        else:
            for j in tl.static_range(WALK):
                part = tl.zeros([BM, BN], tl.float32)
                part_up = tl.zeros([BM, BN], tl.float32)
                lo = k_lo + j * KC
                hi = lo + KC
                if SHORT:
                    hi = tl.minimum(hi, K)
                for k0 in range(lo, hi, BK):
                    cols = (k0 + offs_k)[None, :]
                    x = tl.load(x_ptr + rows[:, None] * stride_x + cols, mask=m_ok[:, None], other=0.0, cache_modifier=".cg")
                    part = tl.dot(x, tl.trans(tl.load(w_ptr + w_rows + cols)), part)
                    if SILU:
                        part_up = tl.dot(x, tl.trans(tl.load(w_ptr + N * K + w_rows + cols)), part_up)
                if j == 0:
                    acc = part
                    acc_up = part_up
                else:
                    acc += part
                    acc_up += part_up
        mask = m_ok[:, None] & n_ok[None, :]
        if PARTIAL:
            if OUT_LAMPORT:
                acc = written(acc)
            tl.store(out_ptr + c * stride_out + rows[:, None] * N + offs_n[None, :], acc, mask=mask)
        else:
            if HAS_BIAS:
                acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            if SILU:
                out = silu_mul(rnd(acc, DTYPE), rnd(acc_up, DTYPE), DTYPE)
            else:
                out = acc.to(DTYPE)
            if OUT_LAMPORT:
                out = written(out)
            tl.store(out_ptr + rows[:, None] * N + offs_n[None, :], out, mask=mask)


@triton.jit
def unwrite_items(
    out_ptr, stride_out, N: tl.constexpr, KS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, P: tl.constexpr,
    MAX_M: tl.constexpr, DTYPE: tl.constexpr,
):  # fmt: skip
    # The sentinel (lamport.py) back into rows < MAX_M of this program's items of an OUT_LAMPORT
    # gemv_phase's out ([*, N], or [KS, *, N] at stride_out if PARTIAL; its dealing), once their
    # consumers have read them.
    rows = tl.arange(0, BM)[:, None]
    minus_zero = sentinel_like(tl.zeros([BM, BN], DTYPE))
    for item in range(tl.program_id(0), (N + BN - 1) // BN * KS, P):
        c = item % KS
        cols = (item // KS) * BN + tl.arange(0, BN)[None, :]
        tl.store(out_ptr + c * stride_out + rows * N + cols, minus_zero, mask=(rows < MAX_M) & (cols < N))


@triton.jit
def prefetch_items(
    w_ptr, N: tl.constexpr, K: tl.constexpr, KS: tl.constexpr, SILU: tl.constexpr, BN: tl.constexpr,
    P: tl.constexpr, KPRE: tl.constexpr, CHUNK: tl.constexpr = 0,
):  # fmt: skip
    # The first KPRE weights of each row of this program's items of a gemv_phase (the same dealing,
    # its splits K / KS long or CHUNK) pulled into L2: one prefetch per 128-byte line.
    items: tl.constexpr = (N + BN - 1) // BN * KS
    KC: tl.constexpr = CHUNK if CHUNK > 0 else K // KS
    for item in range(tl.program_id(0), items, P):
        _, _, w_rows, k_lo = _item(item, N, K, KS, BN, KC)
        ptrs = w_ptr + w_rows + k_lo + tl.arange(0, KPRE // 64)[None, :] * 64
        prefetch_l2(ptrs)
        if SILU:
            prefetch_l2(ptrs + N * K)
