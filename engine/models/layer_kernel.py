"""One decoder layer of a decode step in one kernel launch: a persistent Triton kernel whose
programs (one per SM) run the layer's phases back to back, separated by grid barriers, instead
of ten kernels each paying its own launch, ramp and tail (the 0.6B step at batch 1: 310
kernels, each GEMV 5-8 us for a 2-12 MB read; bench/RESULTS.md). Only engine/models/
fused_decode.py imports this module (it imports Triton).

Phases of layer l, M rows (M <= 16), P programs, GEMV items dealt round-robin (item i -> program
i % P), a grid barrier after each but the last:
  0. (no barrier) the program's attention item's loads that need nothing of this layer
     (layer_attention.attention_prologue): they land while the norm and qkv phases run.
  1. norm (programs P-1..P-M, a row each: the ones qkv leaves idle): h = h_mid[l-1] +
     round(sum_c down_part[c]) (the embedding at layer 0) -> h; its RMSNorm -> xn.
  2. qkv = xn @ w_qkv.T (+ bias), tiles of BN columns.
  3. attention (layer_attention.py): q/k norm and rope in registers, the new K/V row into the
     cache, split-KV over each row's context; every split writes its partial output and lse.
  4. o_proj, one item per program (tile, K split c of whole heads): the item merges the splits
     of its heads into its own scratch (combine_heads), then o_part[c] [M, hidden] fp32 partial
     sums.
  5. norm (programs P-1..P-M): h_mid = h + round(sum_c o_part[c]) -> h_mid; its RMSNorm -> xn.
  6. act = silu(gate) * up of xn @ w_gate_up.T.
  7. down_proj, items (tile, K split c): down_part[c] [M, hidden] fp32; the next layer's phase 1
     (or `finish_kernel`) adds them to h_mid.
Every rounding is the unfused layers' (fused_ops.py, skinny_linear.py): results match them up
to the order of fp32 sums (split-K partials, two half-dim dots for q.k, the split-KV partition).

Grid barrier: one int32 counter; program 0 adds 2^31 - (P - 1), the others 1, so the sign bit
flips once all P have arrived and the low bits return to 0 (no reset between barriers or
launches; fused_decode.py zeroes it once per step). Release on arrival, acquire loads while
waiting, CTA barriers around both; every program must be resident (cooperative launch, grid <=
SMs).
Scratch written by other programs is read with `.cg` (L2, not L1).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

from engine.models.layer_attention import attention_phase, attention_prologue, combine_heads, rnd


@triton.jit
def _load_acquire(ptr):
    return tl.inline_asm_elementwise(
        "ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def _grid_barrier(bar_ptr, FIRST_ADD: tl.constexpr):
    tl.debug_barrier()
    add = 1
    if tl.program_id(0) == 0:
        add = FIRST_ADD
    old = tl.atomic_add(bar_ptr, add, sem="release", scope="gpu")
    cur = _load_acquire(bar_ptr)
    while (old ^ cur) >= 0:  # same sign bit: someone has not arrived
        cur = _load_acquire(bar_ptr)
    tl.debug_barrier()


@triton.jit
def _stamp(t_ptr, i: tl.constexpr, TIMING: tl.constexpr):
    # bench only (TIMING): this program's %globaltimer (ns) at point i of the layer.
    if TIMING:
        t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer; // $1", "=l,r", [tl.program_id(0)], dtype=tl.int64, is_pure=False, pack=1)
        tl.store(t_ptr + tl.program_id(0) * 16 + i, t)


@triton.jit
def _phase_end(bar_ptr, t_ptr, POINT: tl.constexpr, FIRST_ADD: tl.constexpr, TIMING: tl.constexpr):
    # The grid barrier after a phase, stamped (TIMING) at arrival (POINT) and on leaving (POINT + 1).
    _stamp(t_ptr, POINT, TIMING)
    _grid_barrier(bar_ptr, FIRST_ADD)
    _stamp(t_ptr, POINT + 1, TIMING)


@triton.jit
def _stream(base_ptr, part_ptr, off, mask, stride_part, KS: tl.constexpr, DTYPE: tl.constexpr):
    # [BM, BK] fp32 chunk of base + round(sum_c part[c]), rounded (the residual add).
    h = tl.load(base_ptr + off, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    if KS > 0:
        s = tl.load(part_ptr + off, mask=mask, other=0.0, cache_modifier=".cg")
        for c in tl.static_range(1, KS):
            s += tl.load(part_ptr + c * stride_part + off, mask=mask, other=0.0, cache_modifier=".cg")
        h = rnd(h + rnd(s, DTYPE), DTYPE)
    return h


@triton.jit
def _norm_phase(
    row, base_ptr, part_ptr, stride_part, h_out_ptr, w_ptr, xn_ptr, M, eps,
    KS: tl.constexpr, HID: tl.constexpr, BLOCK: tl.constexpr, DTYPE: tl.constexpr,
):  # fmt: skip
    # The program given row < M (one per row): the stream h = base + round(sum_c part[c]) ->
    # h_out, and xn = norm(h) * w -> xn (fused_ops._rms_norm_kernel's roundings).
    if row < M:
        offs = tl.arange(0, BLOCK)
        ok = offs < HID
        off = row * HID + offs
        h = _stream(base_ptr, part_ptr, off, ok, stride_part, KS, DTYPE)
        tl.store(h_out_ptr + off, h.to(DTYPE), mask=ok)
        rstd = tl.math.rsqrt(tl.sum(h * h, 0) * (1.0 / HID) + eps)
        w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        tl.store(xn_ptr + off, (w * rnd(h * rstd, DTYPE)).to(DTYPE), mask=ok)


@triton.jit
def _gemv_phase(
    x_ptr, stride_x, w_ptr, b_ptr, out_ptr, stride_out, M,
    N: tl.constexpr, K: tl.constexpr, KS: tl.constexpr, PARTIAL: tl.constexpr, SILU: tl.constexpr,
    HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, P: tl.constexpr, DTYPE: tl.constexpr,
):  # fmt: skip
    # Items (tile of BN cols, K split c); x [M, K] at row stride stride_x. PARTIAL: out[c] [M, N] fp32 partial sums of
    # x[:, c-th K/KS] @ w[:, c-th K/KS].T. Else (KS 1): out [M, N] = x @ w.T (+ bias), rounded
    # once (skinny_linear's rule), or silu(gate) * up of w = gate | up with SILU.
    pid = tl.program_id(0)
    rows = tl.arange(0, BM)
    m_ok = rows < M
    offs_k = tl.arange(0, BK)
    tiles: tl.constexpr = (N + BN - 1) // BN
    KC: tl.constexpr = K // KS
    for item in range(pid, tiles * KS, P):
        c = item % KS
        offs_n = (item // KS) * BN + tl.arange(0, BN)
        n_ok = offs_n < N
        w_rows = tl.minimum(offs_n, N - 1).to(tl.int64)[:, None] * K
        acc = tl.zeros([BM, BN], tl.float32)
        acc_up = tl.zeros([BM, BN], tl.float32)
        for k0 in range(c * KC, c * KC + KC, BK):
            cols = (k0 + offs_k)[None, :]
            x = tl.load(x_ptr + rows[:, None] * stride_x + cols, mask=m_ok[:, None], other=0.0, cache_modifier=".cg")
            acc = tl.dot(x, tl.trans(tl.load(w_ptr + w_rows + cols)), acc)
            if SILU:
                acc_up = tl.dot(x, tl.trans(tl.load(w_ptr + N * K + w_rows + cols)), acc_up)
        mask = m_ok[:, None] & n_ok[None, :]
        if PARTIAL:
            tl.store(out_ptr + c * stride_out + rows[:, None] * N + offs_n[None, :], acc, mask=mask)
        else:
            if HAS_BIAS:
                acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            if SILU:
                g = rnd(acc, DTYPE)
                acc = rnd(tl.math.div_rn(g, 1.0 + libdevice.exp(-g)), DTYPE) * rnd(acc_up, DTYPE)
            tl.store(out_ptr + rows[:, None] * N + offs_n[None, :], acc.to(DTYPE), mask=mask)


@triton.jit(do_not_specialize=["M", "num_splits", "stride_bt"])
def decoder_layer_kernel(
    h_prev_ptr,  # [M, HID]: the stream before the previous layer's MLP (h_mid), or the embedding
    down_prev_ptr,  # [KS_D, MAX_M, HID] fp32: the previous layer's down_proj partials (KS_PREV > 0)
    h_ptr,  # [M, HID]: this layer's input stream (written)
    h_mid_ptr,  # [M, HID]: the stream after attention (written)
    in_norm_ptr, qkv_w_ptr, qkv_b_ptr, qn_ptr, kn_ptr, o_w_ptr, post_norm_ptr, gate_up_w_ptr, down_w_ptr,
    xn_ptr,  # [M, HID] scratch: the normed stream, input of qkv and gate_up
    qkv_ptr,  # [M, QKV] scratch
    pos_ptr, cos_sin_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, seq_lens_ptr, slot_ptr,
    part_o_ptr, part_lse_ptr,  # split-KV partials: [pairs * NH, D] fp32 and [pairs * NH] fp32
    xo_ptr,  # [P, BM, HID_O / KS_O] scratch: each o_proj item's merged attention output
    o_part_ptr,  # [KS_O, MAX_M, HID] fp32
    act_ptr,  # [M, I] scratch
    down_ptr,  # [KS_D, MAX_M, HID] fp32: this layer's down_proj partials
    bar_ptr,  # int32 grid-barrier counter
    t_ptr,  # [P, 16] int64 timestamps (TIMING only)
    M, num_splits, eps, sm_scale_log2, stride_part,
    stride_cblk, stride_ctok, stride_chead, stride_bt,
    HID: tl.constexpr, NH: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr, INTER: tl.constexpr,
    QK_NORM: tl.constexpr, HAS_QKV_BIAS: tl.constexpr, KS_PREV: tl.constexpr, KS_O: tl.constexpr, KS_D: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BLOCK_SIZE: tl.constexpr, ABN: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_HID: tl.constexpr, P: tl.constexpr, FIRST_ADD: tl.constexpr, TIMING: tl.constexpr = False,
):  # fmt: skip
    DTYPE: tl.constexpr = h_ptr.dtype.element_ty
    QKV: tl.constexpr = (NH + 2 * NKV) * D
    KCO: tl.constexpr = NH * D // KS_O  # o_proj's K per item: whole heads
    pid = tl.program_id(0)
    # The row phases run on the last programs, which the next GEMV phase leaves without an item
    # (its tiles fill at most P - M programs) or with the least to do.
    norm_row = P - 1 - pid
    _stamp(t_ptr, 0, TIMING)
    # The attention item's loads that need nothing of this layer: they land during norm and qkv.
    m, g, s, seq_len, start, end, k1, k2, v, cos, sin, slot = attention_prologue(
        pos_ptr, cos_sin_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, seq_lens_ptr, slot_ptr,
        M, num_splits, stride_cblk, stride_ctok, stride_chead, stride_bt, NKV, D, BLOCK_SIZE, ABN, DTYPE,
    )  # fmt: skip
    _norm_phase(norm_row, h_prev_ptr, down_prev_ptr, stride_part, h_ptr, in_norm_ptr, xn_ptr, M, eps, KS_PREV, HID, BLOCK_HID, DTYPE)
    _phase_end(bar_ptr, t_ptr, 1, FIRST_ADD, TIMING)
    _gemv_phase(xn_ptr, HID, qkv_w_ptr, qkv_b_ptr, qkv_ptr, 0, M, QKV, HID, 1, False, False, HAS_QKV_BIAS, BM, BN, BK, P, DTYPE)
    _phase_end(bar_ptr, t_ptr, 3, FIRST_ADD, TIMING)
    attention_phase(
        m, g, s, seq_len, start, end, k1, k2, v, cos, sin, slot,
        qkv_ptr, qn_ptr, kn_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, part_o_ptr, part_lse_ptr,
        M, num_splits, eps, sm_scale_log2, stride_cblk, stride_ctok, stride_chead, stride_bt,
        NH, NKV, D, QK_NORM, BLOCK_SIZE, ABN, DTYPE, t_ptr, TIMING,
    )  # fmt: skip
    _phase_end(bar_ptr, t_ptr, 5, FIRST_ADD, TIMING)
    # o_proj: at most one item per program (fused_decode.py), item = pid, K chunk c = pid % KS_O;
    # it merges the splits of its chunk's heads into its own scratch rows first.
    xo = xo_ptr + pid * (BM * KCO)
    if pid < (HID // BN) * KS_O:
        combine_heads(part_o_ptr, part_lse_ptr, xo, M, (pid % KS_O) * (KCO // D), num_splits, NH, D, KCO // D, 4, BLOCK_S, DTYPE)
    tl.debug_barrier()
    _stamp(t_ptr, 15, TIMING)
    _gemv_phase(xo - (pid % KS_O) * KCO, KCO, o_w_ptr, o_w_ptr, o_part_ptr, stride_part, M, HID, NH * D, KS_O, True, False, False, BM, BN, BK, P, DTYPE)
    _phase_end(bar_ptr, t_ptr, 7, FIRST_ADD, TIMING)
    _norm_phase(norm_row, h_ptr, o_part_ptr, stride_part, h_mid_ptr, post_norm_ptr, xn_ptr, M, eps, KS_O, HID, BLOCK_HID, DTYPE)
    _phase_end(bar_ptr, t_ptr, 9, FIRST_ADD, TIMING)
    _gemv_phase(xn_ptr, HID, gate_up_w_ptr, gate_up_w_ptr, act_ptr, 0, M, INTER, HID, 1, False, True, False, BM, BN, BK, P, DTYPE)
    _phase_end(bar_ptr, t_ptr, 11, FIRST_ADD, TIMING)
    _gemv_phase(act_ptr, INTER, down_w_ptr, down_w_ptr, down_ptr, stride_part, M, HID, INTER, KS_D, True, False, False, BM, BN, BK, P, DTYPE)
    _stamp(t_ptr, 13, TIMING)


@triton.jit
def finish_kernel(
    h_mid_ptr, down_ptr, norm_ptr, h_ptr, out_ptr, stride_part, M, eps,
    HID: tl.constexpr, KS_D: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # out [M, HID] = norm(h_mid + round(sum_c down[c])): the model's final norm, one program per
    # row; the stream itself lands in h (scratch).
    _norm_phase(tl.program_id(0), h_mid_ptr, down_ptr, stride_part, h_ptr, norm_ptr, out_ptr, M, eps, KS_D, HID, BLOCK, out_ptr.dtype.element_ty)
