"""One decoder layer of a decode step in one kernel launch: a persistent Triton kernel whose
programs (one per SM) run the layer's phases back to back, separated by grid barriers, instead
of ten kernels each paying its own launch, ramp and tail (the 0.6B step at batch 1: 310
kernels, each GEMV 5-8 us for a 2-12 MB read; bench/RESULTS.md). Only engine/models/
fused_decode.py imports this module (it imports Triton).

Phases of layer l, M rows (M <= 16), P programs, GEMV items dealt round-robin (item i -> program
i % P), a grid barrier after each but the last (and LAMPORT's gate_up, LAMPORT_O's o_proj, and
NORM_EVERYWHERE's norms):
  0. (no barrier) the program's attention item's loads that need nothing of this layer
     (layer_attention.attention_prologue): they land while the norm and qkv phases run.
  1. norm (programs P-1..P-M, a row each: the ones qkv leaves idle): h = h_mid[l-1] +
     round(sum_c down_part[c]) (at layer 0 the embedding table's row of the row's token: the
     lookup is no launch of its own) -> h; its RMSNorm -> xn.
     NORM_EVERYWHERE (steps of one row): every program normalizes the row into its own xn rows
     and program 0 keeps h; no barrier after it. One row: 0.796 -> 0.783 ms a forward; two rows
     0.928 -> 0.957, every program then reads twice the partials (bench/history/2026-11-24.md).
  2. qkv = xn @ w_qkv.T (+ bias), tiles of BN columns.
  3. attention (layer_attention.py): q/k norm and rope in registers, the new K/V row into the
     cache, split-KV over each row's context; every split writes its partial output and lse,
     and the last split of each (row, KV head) merges them into ao [M, NH * D].
  4. o_proj, one item per program (tile, K split c): o_part[c] [M, hidden] fp32 partial sums.
  5. norm (programs P-1..P-M; NORM_EVERYWHERE as phase 1): h_mid = h + round(sum_c o_part[c])
     -> h_mid; its RMSNorm -> xn.
  6. act = silu(gate) * up of xn @ w_gate_up.T.
  7. down_proj, items (tile, K split c): down_part[c] [M, hidden] fp32; the next layer's phase 1
     (or `finish_kernel`) adds them to h_mid.
LAMPORT: act is a Lamport buffer (lamport.py), so no grid barrier between phases 6 and 7: each
down_proj item waits until its K split of act holds no -0.0, and gate_up stores no -0.0. Each
layer puts the sentinel back into its programs' gate_up columns of act (every row up to MAX_M)
after its PDL wait, when the layer before has ended and so every read of it (0.6B, H100: steps
of 2 / 4 rows 2.0 / 1.5 % faster, one row the same; the same wait between qkv and the attention
was slower at one row: bench/history/2026-11-27.md).
LAMPORT_O: o_part the same, between phases 4 and 5: o_proj stores no -0.0 and the norm sums the
partials it loaded once none is -0.0 (grid_phases.norm_phase's PART_LAMPORT), so the wait costs no
second read; the sentinel goes back into each program's o_proj tile (rows up to MAX_M) after the
next layer's PDL wait. One row, H100: the step 1.2 % faster (2 and 4 rows the same). Every
o_proj item waiting so on the attention's split partials instead of its barrier (when each
merged its heads' splits itself) was much slower (2.6 -> 7-8 us: bench/history/2026-11-27.md).
L2 prefetches (grid_phases.prefetch_items; weights only, so results do not change): O_PRE
weights of each row of the program's o_proj tile once it has arrived at the barrier after phase
3, so they land while it waits; G_PRE columns of its gate_up rows once its
o_proj item is done, over the wait (a barrier's, or LAMPORT_O's) and phase 5 (issued between a
barrier's arrival and its wait, they delay neither the program's own loads nor its release:
bench/history/2026-11-27.md); D_PRE columns of its down_proj item's K split once its
gate_up item is done (the same, with gate_up's barrier or without, LAMPORT), issued
only by the programs that had a gate_up item (the others arrive at once, and their fills would
queue ahead of gate_up's loads); Q_PRE columns of the next layer's qkv rows once its down_proj
item is done (has_next), over the launch boundary and the next layer's phase 1.
The norms' weights (layer weights: no kernel of the step writes them) are loaded ahead, phase
1's before the PDL wait and phase 5's before the attention's barrier, so neither norm waits on a
load after its sum of squares (one row, H200: the step 0.727-0.745 -> 0.710-0.731 ms;
bench/history/2026-11-28.md).
Every rounding is the unfused layers' (fused_ops.py, skinny_linear.py): results match them up
to the order of fp32 sums (split-K partials, two half-dim dots for q.k, the split-KV partition).

USE_PDL (engine/kernels/pdl.py): each layer's launch is programmatic. A layer triggers its dependents
after o_proj (each program once past its barrier, or its own item under LAMPORT_O), so the next
layer's programs get scheduled during phases 5-7, issue their
phase-0 loads (the layer's KV cache, its q/k norm weights and the step's metadata: nothing a
layer kernel writes), and wait before phase 1. No gap between layer launches (bench/history/2026-11-24.md). Layer 0 launches with PDL too, but its prologue reads the step's metadata,
which the kernel before it (a decode graph's gather, engine/runner/graph_io.py) writes: it pulls
its first Q_PRE qkv weights into L2, then waits, then runs its prologue. The gather triggers no
early launch (it ends in ~2 us): with it, layer 0's programs were placed beside the gather's and
the one-row step ran 70 us slower; without, the launch is prepared while the gather runs (one-row
step 0-3 us faster in five pairs: bench/history/2026-11-28.md).

The grid barrier is grid_barrier.py's; the norm and GEMV phases are grid_phases.py's.
"""

from __future__ import annotations

import triton
import triton.language as tl

from engine.kernels.grid_barrier import phase_end, stamp
from engine.kernels.grid_phases import (
    gemv_phase,
    norm_phase,
    norm_step,
    norm_weight,
    phase_end_prefetching,
    prefetch_items,
    unwrite_items,
)
from engine.kernels.layer_attention import attention_phase, attention_prologue


@triton.jit(do_not_specialize=["M", "num_splits", "stride_bt", "has_next"])
def decoder_layer_kernel(
    h_prev_ptr,  # [M, HID]: the stream before the previous layer's MLP (h_mid); layer 0: the embedding table [V, HID]
    ids_ptr,  # [M] int64 token ids (layer 0: the rows of h_prev that are the stream)
    down_prev_ptr,  # [KS_D, MAX_M, HID] fp32: the previous layer's down_proj partials (KS_PREV > 0)
    h_ptr,  # [M, HID]: this layer's input stream (written)
    h_mid_ptr,  # [M, HID]: the stream after attention (written)
    in_norm_ptr, qkv_w_ptr, qkv_b_ptr, qn_ptr, kn_ptr, o_w_ptr, post_norm_ptr, gate_up_w_ptr, down_w_ptr,
    next_qkv_w_ptr,  # the next layer's qkv weight (Q_PRE), or any weight with has_next 0
    xn_ptr,  # [P or 1, M, HID] scratch at stride_xn (0: one shared): the normed stream, input of qkv and gate_up
    qkv_ptr,  # [M, QKV] scratch
    pos_ptr, cos_sin_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, seq_lens_ptr, slot_ptr,
    part_o_ptr, part_lse_ptr,  # split-KV partials: [pairs * NH, D] fp32 and [pairs * NH] fp32
    ao_ptr,  # [MAX_M, NH * D] scratch: the attention output, its splits merged (layer_attention.merge_last)
    o_part_ptr,  # [KS_O, MAX_M, HID] fp32
    act_ptr,  # [M, I] scratch
    down_ptr,  # [KS_D, MAX_M, HID] fp32: this layer's down_proj partials
    bar_ptr,  # int32 grid-barrier counter
    t_ptr,  # [P, STAMPS] int64 timestamps and SM (TIMING only: grid_barrier.stamp)
    count_ptr,  # [MAX_M, NKV] int32: splits of each (row, KV head) done; zero between layers
    M, num_splits, eps, sm_scale_log2, stride_part, stride_xn, has_next,
    stride_cblk, stride_ctok, stride_chead, stride_bt,
    HID: tl.constexpr, NH: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr, INTER: tl.constexpr,
    QK_NORM: tl.constexpr, HAS_QKV_BIAS: tl.constexpr, KS_PREV: tl.constexpr, KS_O: tl.constexpr, KS_D: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BLOCK_SIZE: tl.constexpr, ABN: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_HID: tl.constexpr, P: tl.constexpr, FIRST_ADD: tl.constexpr,
    NORM_EVERYWHERE: tl.constexpr, USE_PDL: tl.constexpr, O_PRE: tl.constexpr, G_PRE: tl.constexpr, Q_PRE: tl.constexpr,
    D_PRE: tl.constexpr, LAMPORT: tl.constexpr, LAMPORT_O: tl.constexpr, MAX_M: tl.constexpr, GP: tl.constexpr,
    TIMING: tl.constexpr = False,
):  # fmt: skip
    DTYPE: tl.constexpr = h_ptr.dtype.element_ty
    QKV: tl.constexpr = (NH + 2 * NKV) * D
    EMBED: tl.constexpr = KS_PREV == 0  # layer 0: the stream is the embedding of the step's tokens
    pid = tl.program_id(0)
    # The row phases run on the last programs, which the next GEMV phase leaves without an item
    # (its tiles fill at most P - M programs) or with the least to do.
    norm_row = P - 1 - pid
    stamp(t_ptr, 0, TIMING)
    in_w = norm_weight(in_norm_ptr, HID, BLOCK_HID)  # a weight: loaded before any wait
    if EMBED and USE_PDL:  # layer 0: its prologue reads the step's metadata, so it waits first
        if Q_PRE > 0:  # over the launch: its first qkv weights into L2
            prefetch_items(qkv_w_ptr, QKV, HID, 1, False, BN, P, Q_PRE)
        tl.extra.cuda.gdc_wait()
    # The attention item's loads that need nothing of this layer: they land during norm and qkv.
    m, g, s, seq_len, start, end, k1, k2, v, cos, sin, slot, qw1, qw2, kw1, kw2 = attention_prologue(
        pos_ptr, cos_sin_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, seq_lens_ptr, slot_ptr, qn_ptr, kn_ptr,
        M, num_splits, stride_cblk, stride_ctok, stride_chead, stride_bt, NKV, D, BLOCK_SIZE, ABN, DTYPE, QK_NORM,
    )  # fmt: skip
    if USE_PDL and not EMBED:  # engine/kernels/pdl.py: everything above reads what no kernel of the step writes
        tl.extra.cuda.gdc_wait()
    # The previous layer's down_proj items have read act, and its norms o_part: the sentinel back.
    if LAMPORT:
        unwrite_items(act_ptr, 0, INTER, 1, BM, BN, P, MAX_M, DTYPE)
    if LAMPORT_O:
        unwrite_items(o_part_ptr, stride_part, HID, KS_O, BM, BN, P, MAX_M, tl.float32)
    xn_ptr += pid * stride_xn  # NORM_EVERYWHERE: this program's own rows
    norm_step(norm_row, h_prev_ptr, down_prev_ptr, stride_part, h_ptr, in_w, xn_ptr, M, eps, ids_ptr, bar_ptr, t_ptr,
              1, KS_PREV, HID, BLOCK_HID, DTYPE, EMBED, NORM_EVERYWHERE, FIRST_ADD, TIMING, LAST_LEAVES=True)  # fmt: skip
    gemv_phase(xn_ptr, HID, qkv_w_ptr, qkv_b_ptr, qkv_ptr, 0, M, QKV, HID, 1, False, False, HAS_QKV_BIAS, BM, BN, BK, P, DTYPE)
    phase_end(bar_ptr, t_ptr, 3, FIRST_ADD, TIMING, True)
    attention_phase(
        m, g, s, seq_len, start, end, k1, k2, v, cos, sin, slot, qw1, qw2, kw1, kw2,
        qkv_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, part_o_ptr, part_lse_ptr,
        M, num_splits, eps, sm_scale_log2, stride_cblk, stride_ctok, stride_chead, stride_bt,
        NH, NKV, D, QK_NORM, BLOCK_SIZE, ABN, DTYPE, t_ptr, TIMING, count_ptr, ao_ptr, GP, BLOCK_S,
    )  # fmt: skip
    post_w = norm_weight(post_norm_ptr, HID, BLOCK_HID)  # phase 5's weight, landing under the barrier and o_proj
    # o_proj's weight tile pulled into L2 while the barrier waits.
    phase_end_prefetching(bar_ptr, t_ptr, 5, FIRST_ADD, TIMING, True, o_w_ptr, HID, NH * D, KS_O, False, BN, P, O_PRE, True)
    # o_proj: at most one item per program (fused_decode.py), on the merged attention output.
    gemv_phase(ao_ptr, NH * D, o_w_ptr, o_w_ptr, o_part_ptr, stride_part, M, HID, NH * D, KS_O, True, False, False, BM, BN, BK, P, DTYPE,
               False, LAMPORT_O)  # fmt: skip
    # The first G_PRE columns of its gate_up rows, pulled into L2 over the barrier and the norm. No
    # barrier with LAMPORT_O: the norm waits for o_part itself.
    phase_end_prefetching(bar_ptr, t_ptr, 7, FIRST_ADD, TIMING, True, gate_up_w_ptr, INTER, HID, 1, True, BN, P, G_PRE, True, not LAMPORT_O)
    if USE_PDL:  # engine/kernels/pdl.py: the next layer's programs get scheduled and run their prologue
        tl.extra.cuda.gdc_launch_dependents()
    norm_step(norm_row, h_ptr, o_part_ptr, stride_part, h_mid_ptr, post_w, xn_ptr, M, eps, ids_ptr, bar_ptr, t_ptr,
              9, KS_O, HID, BLOCK_HID, DTYPE, False, NORM_EVERYWHERE, FIRST_ADD, TIMING, LAMPORT_O, LAST_LEAVES=True)  # fmt: skip
    gemv_phase(xn_ptr, HID, gate_up_w_ptr, gate_up_w_ptr, act_ptr, 0, M, INTER, HID, 1, False, True, False, BM, BN, BK, P, DTYPE,
               False, LAMPORT)  # fmt: skip
    # The first D_PRE columns of its down_proj items, by the programs that had a gate_up item. No
    # barrier with LAMPORT: each down_proj item waits for its own K split of act.
    phase_end_prefetching(bar_ptr, t_ptr, 11, FIRST_ADD, TIMING, pid < (INTER + BN - 1) // BN, down_w_ptr, HID, INTER, KS_D, False, BN, P,
                          D_PRE, True, not LAMPORT)  # fmt: skip
    gemv_phase(act_ptr, INTER, down_w_ptr, down_w_ptr, down_ptr, stride_part, M, HID, INTER, KS_D, True, False, False, BM, BN, BK, P,
               DTYPE, LAMPORT)  # fmt: skip
    if Q_PRE > 0:  # the next layer's first qkv columns, pulled into L2 over the launch boundary and its norm
        if has_next != 0:
            prefetch_items(next_qkv_w_ptr, QKV, HID, 1, False, BN, P, Q_PRE)
    stamp(t_ptr, 13, TIMING)


@triton.jit
def finish_kernel(
    h_mid_ptr, down_ptr, norm_ptr, h_ptr, out_ptr, stride_part, M, eps,
    HID: tl.constexpr, KS_D: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # out [M, HID] = norm(h_mid + round(sum_c down[c])): the model's final norm, one program per
    # row; the stream itself lands in h (scratch).
    norm_phase(tl.program_id(0), h_mid_ptr, down_ptr, stride_part, h_ptr, norm_ptr, out_ptr, M, eps, True, KS_D, HID, BLOCK, out_ptr.dtype.element_ty)
