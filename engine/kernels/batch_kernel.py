"""Everything of a decode step between two attention calls in one kernel launch: a persistent
Triton kernel (one program per SM, phases separated by grid barriers) that takes layer l's
attention output to layer l+1's qkv projection. The attention kernel after it (rope_decode.py)
norms and rotates q and k from these partial sums itself. Only engine/decode/batch_decode.py
imports this module (it imports Triton).

Phases, M rows (M <= BM <= 64), P programs, GEMV items dealt round-robin (grid_phases.py), a grid
barrier after each but the last:
  1. o_proj of layer l, items (tile, K split c): o_part[c] [M, HID] fp32 partial sums of attn.
  2. norm (programs P-1..P-M, a row each): h_mid = h + round(sum_c o_part[c]); its RMSNorm -> xn.
  3. act = silu(gate) * up of xn @ w_gate_up.T.
  4. down_proj, items (tile, K split c): down_part[c] [M, HID] fp32.
  5. norm: h = h_mid + round(sum_c down_part[c]); the RMSNorm of layer l+1 (the final norm: TAIL)
     -> xn (TAIL: the model's output).
  6. qkv of layer l+1, items (tile, K split c): qkv_part[c] [M, QKV] fp32, no bias (the
     attention kernel adds it).
L2 prefetches (grid_phases.prefetch_items; weights only): once a program's item of phase 1, 3
or 4 is done, the first G_PRE, D_PRE or Q_PRE weights of each row of its items of phase 3, 4 or
6, so they land over the barriers and norm between.
HEAD (the step's first launch, no layer l): phase 5 on the embedding alone (each row's token's
row of the table, looked up by the norm: no launch of its own), then 6. TAIL (the
last layer): phases 1-5. Roundings are the unfused layers' (grid_phases.py): results match them
up to the order of fp32 sums.

INVARIANT (`--deterministic`, batch_decode.py `invariant`): the GEMV phases take the invariant
GEMM's K order (their splits CK_O / CK_D / CK_Q long, the gate_up items walking WALK_G chunks of
CK_G: invariant_tiles.config's chunks, in one pipelined loop with FLAT_WALK), and after phase 6 a barrier and
  7. qkv (programs P-1..P-M, a row each): the partials summed in chunk order, rounded, into qkv
     [M, QKV]; then the rotary kernel's q/k norm and rope in place and the new K/V rows into
     layer l+1's cache (`_qkv_rope_phase`),
so each phase has the unfused mode's bits (invariant_matmul, fused_add_rms_norm, silu_and_mul,
rope.rotary): the mode's fixed-split attention runs on qkv's q between the launches, or
  ROPE_LATER (steps of more than batch_consts.ROPE_LATER_ROWS rows): no phase 7; the
     attention's one-token-a-program kernel does its work per (row, KV head) from the partials
     (rope.rope_kv_head, the same sums and the rotary kernel's blocks), or
  8. ATTEND (steps of few rows: batch_consts.ATTEND_ROWS, within the workspace's FEW_TOKENS,
     attention_fixed.py): after a barrier, that attention itself, items (row, KV head, slot)
     dealt round-robin, each some of the row's pieces into the backend's workspace, the last of
     (row, KV head) to arrive merging them into attn (fixed_rows.piece_item: the split path's
     arithmetic, so its bits). attn is the next launch's input; this launch read it in phase
     1, barriers before. ROPE_ITEMS: no phase 7 and no barrier before 8; each item with pieces
     first sums, norms and rotates its (row, KV head)'s q heads, key and value from the partials
     into its program's own rows of qkv ([P, GROUP + 2, D]: the slots of a (row, KV head) each
     compute them) and stores the new K/V row (rope.rope_kv_head, as ROPE_LATER's attention
     kernel), so a row's rope runs on its KV heads' items at once, not on one program. The slots
     store the same K/V row; each reads back only what it stored itself.
EVERYWHERE (steps of one row): phases 2 and 5 on every program, each into its own XN_ROWS rows
of xn (and of the output, but at TAIL), program 0 storing the stream, and no grid barrier after
them (layer_kernel.py's NORM_EVERYWHERE: the same norm_phase, so the same bits).

USE_PDL (engine/kernels/pdl.py): the launch waits before phase 1 for the attention kernel before it, and
triggers before phase 6, so the attention kernel after it is scheduled during the qkv phase and
issues its first K/V tile's prefetch then (forward at 32 rows 1.490 -> 1.412-1.417 ms,
bench/history/2026-11-24.md).
"""

from __future__ import annotations

import triton
import triton.language as tl

from engine.kernels.fixed_rows import locate, piece_item
from engine.kernels.grid_barrier import phase_end, stamp
from engine.kernels.grid_phases import (
    gemv_phase,
    norm_step,
    norm_weight,
    part_sum,
    prefetch_items,
)
from engine.kernels.rope import rope_kv_head, rope_token


@triton.jit
def _qkv_rope_phase(
    row, part_ptr, stride_part, qkv_ptr, M, pos_ptr, cos_sin_ptr, qw_ptr, kw_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_cos, stride_cslot, stride_chead, qk_eps,
    KS: tl.constexpr, NH: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr, QK_NORM: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK: tl.constexpr, DTYPE: tl.constexpr,
):  # fmt: skip
    # The program given row < M: qkv[row] = part[0][row] + part[1][row] + ... (KS fp32 partials
    # at stride_part, in that order), rounded once (invariant_matmul's chunk sum); then
    # rope.rope_token on it (the rotary kernel's bits: same blocks, same warps): q and k
    # normed (QK_NORM) and rotated in place, the rotated K and the V into the cache at the row's slot.
    if row < M:
        QKV: tl.constexpr = (NH + 2 * NKV) * D
        t = row.to(tl.int64)
        offs = tl.arange(0, BLOCK)
        for b in tl.static_range(0, QKV, BLOCK):  # unrolled: every load in flight at once
            idx = t * QKV + b + offs
            ok = b + offs < QKV
            tl.store(qkv_ptr + idx, part_sum(part_ptr, idx, ok, stride_part, KS).to(DTYPE), mask=ok)
        tl.debug_barrier()  # the row's qkv, stored by every thread, read back by others
        rope_token(
            t, qkv_ptr, qkv_ptr + NH * D, pos_ptr, cos_sin_ptr, qw_ptr, kw_ptr, qkv_ptr + (NH + NKV) * D,
            k_cache_ptr, v_cache_ptr, slot_ptr, QKV, D, QKV, D, stride_cos, QKV, D, stride_cslot, stride_chead,
            NH, NKV, 1.0 / D, qk_eps, QK_NORM, D // 2, D // 2, BLOCK_HQ, BLOCK_HK, True,
        )  # fmt: skip


@triton.jit(do_not_specialize=["M", "stride_bt", "pieces", "slots"])
def batch_layer_kernel(
    emb_ptr,  # [V, HID]: the embedding table (HEAD only)
    ids_ptr,  # [M] int64: the step's token ids (HEAD only)
    attn_ptr,  # [M, NH * D]: layer l's attention output
    h_ptr,  # [MAX_M, HID]: the stream entering layer l, left as the stream entering l + 1
    h_mid_ptr,  # [MAX_M, HID] scratch: the stream after layer l's attention
    o_w_ptr, post_norm_ptr, gate_up_w_ptr, down_w_ptr,  # layer l's
    norm_ptr,  # layer l+1's input norm; the model's final norm (TAIL)
    qkv_w_ptr,  # layer l+1's
    xn_ptr,  # [MAX_M, HID] scratch: the normed stream
    out_ptr,  # [M, HID]: the model's output (TAIL); else xn
    act_ptr,  # [MAX_M, INTER] scratch
    o_part_ptr, down_part_ptr,  # [KS_O | KS_D, MAX_M, HID] fp32
    qkv_part_ptr,  # [KS_Q, MAX_M, QKV] fp32
    qkv_ptr,  # [MAX_M, QKV]: qkv summed, rounded, q and k rotated (INVARIANT only)
    pos_ptr, cos_sin_ptr, qk_w_ptr, kk_w_ptr,  # INVARIANT: positions [M], the rope's cos | sin, layer l+1's q/k norm
    k_cache_ptr, v_cache_ptr, slot_ptr,  # INVARIANT: layer l+1's cache [slots, NKV, D] each, the step's slots [M]
    stride_cos, stride_cslot, stride_chead, qk_eps,  # INVARIANT
    bt_ptr, seq_lens_ptr, ws_m_ptr, ws_l_ptr, ws_acc_ptr, count_ptr,  # ATTEND: the step's block tables, seq_lens; the workspace
    stride_bt, stride_cblk, sm_scale_log2, pieces, slots,  # ATTEND
    bar_ptr,  # int32 grid-barrier counter
    t_ptr,  # [P, STAMPS] int64 timestamps and SM (TIMING only: grid_barrier.stamp)
    M, eps,
    HID: tl.constexpr, NH: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr, INTER: tl.constexpr,
    KS_O: tl.constexpr, KS_D: tl.constexpr, KS_Q: tl.constexpr, MAX_M: tl.constexpr, BM: tl.constexpr,
    BN: tl.constexpr, BN_G: tl.constexpr, BK: tl.constexpr, BLOCK_HID: tl.constexpr, P: tl.constexpr,
    FIRST_ADD: tl.constexpr, HEAD: tl.constexpr, TAIL: tl.constexpr, USE_PDL: tl.constexpr,
    G_PRE: tl.constexpr, D_PRE: tl.constexpr, Q_PRE: tl.constexpr, TIMING: tl.constexpr = False,
    INVARIANT: tl.constexpr = False, CK_O: tl.constexpr = 0, CK_D: tl.constexpr = 0, CK_Q: tl.constexpr = 0,
    CK_G: tl.constexpr = 0, WALK_G: tl.constexpr = 1, FLAT_WALK: tl.constexpr = False, QK_NORM: tl.constexpr = False, BLOCK_HQ: tl.constexpr = 1,
    BLOCK_HK: tl.constexpr = 1, BN_D: tl.constexpr = 0, BN_Q: tl.constexpr = 0, ATTEND: tl.constexpr = False,
    GROUP: tl.constexpr = 1, BLOCK_H: tl.constexpr = 16, BLOCK_SIZE: tl.constexpr = 16, BLOCK_N_: tl.constexpr = 64,
    SPLIT_: tl.constexpr = 128, EVERYWHERE: tl.constexpr = False, XN_ROWS: tl.constexpr = 0, ROPE_LATER: tl.constexpr = False,
    ROPE_ITEMS: tl.constexpr = False,
):  # fmt: skip
    DTYPE: tl.constexpr = h_ptr.dtype.element_ty
    QKV: tl.constexpr = (NH + 2 * NKV) * D
    S_HID: tl.constexpr = MAX_M * HID  # stride of o_part and down_part
    BN_DOWN: tl.constexpr = BN_D if BN_D > 0 else BN  # the down and qkv phases' columns an item (0: BN)
    BN_QKV: tl.constexpr = BN_Q if BN_Q > 0 else BN
    pid = tl.program_id(0)
    # The row phases run on the last programs, which the GEMV phases fill last.
    row = P - 1 - pid
    stamp(t_ptr, 0, TIMING)
    # The norms' weights (the layers': no kernel writes them), so no norm waits on them.
    post_w = norm_weight(post_norm_ptr, HID, BLOCK_HID)
    in_w = norm_weight(norm_ptr, HID, BLOCK_HID)
    if USE_PDL:  # engine/kernels/pdl.py: scheduled as the attention kernel before ends; wait for all of it
        tl.extra.cuda.gdc_wait()
    stamp(t_ptr, 12, TIMING)  # the attention kernel before has ended (bench: the launch's clock)
    # EVERYWHERE: the norms' xn rows are this program's own (XN_ROWS rows a program); the final norm's
    # (TAIL: the model's output) are shared.
    LAST_EVERYWHERE: tl.constexpr = EVERYWHERE and not TAIL
    if EVERYWHERE:
        xn_ptr += pid * (XN_ROWS * HID)
    if LAST_EVERYWHERE:
        out_ptr += pid * (XN_ROWS * HID)
    if HEAD:
        norm_step(row, emb_ptr, emb_ptr, 0, h_ptr, in_w, out_ptr, M, eps, ids_ptr, bar_ptr, t_ptr, 9, 0, HID, BLOCK_HID, DTYPE, True,
                  LAST_EVERYWHERE, FIRST_ADD, TIMING, BARRIER=not TAIL)  # fmt: skip
    else:
        gemv_phase(attn_ptr, NH * D, o_w_ptr, o_w_ptr, o_part_ptr, S_HID, M, HID, NH * D, KS_O, True, False, False, BM, BN, BK, P, DTYPE,
                   CHUNK=CK_O)
        if G_PRE > 0:
            prefetch_items(gate_up_w_ptr, INTER, HID, 1, True, BN_G, P, G_PRE)
        phase_end(bar_ptr, t_ptr, 1, FIRST_ADD, TIMING)
        norm_step(row, h_ptr, o_part_ptr, S_HID, h_mid_ptr, post_w, xn_ptr, M, eps, ids_ptr, bar_ptr, t_ptr, 3, KS_O, HID, BLOCK_HID,
                  DTYPE, False, EVERYWHERE, FIRST_ADD, TIMING)  # fmt: skip
        gemv_phase(xn_ptr, HID, gate_up_w_ptr, gate_up_w_ptr, act_ptr, 0, M, INTER, HID, 1, False, True, False, BM, BN_G, BK, P, DTYPE,
                   CHUNK=CK_G, WALK=WALK_G, FLAT_WALK=FLAT_WALK)
        if D_PRE > 0:
            prefetch_items(down_w_ptr, HID, INTER, KS_D, False, BN_DOWN, P, D_PRE, CK_D)
        phase_end(bar_ptr, t_ptr, 5, FIRST_ADD, TIMING)
        gemv_phase(act_ptr, INTER, down_w_ptr, down_w_ptr, down_part_ptr, S_HID, M, HID, INTER, KS_D, True, False, False, BM, BN_DOWN, BK, P,
                   DTYPE, CHUNK=CK_D)
        if Q_PRE > 0:
            if not TAIL:
                prefetch_items(qkv_w_ptr, QKV, HID, KS_Q, False, BN_QKV, P, Q_PRE, CK_Q)
        phase_end(bar_ptr, t_ptr, 7, FIRST_ADD, TIMING)
        norm_step(row, h_mid_ptr, down_part_ptr, S_HID, h_ptr, in_w, out_ptr, M, eps, ids_ptr, bar_ptr, t_ptr, 9, KS_D, HID, BLOCK_HID,
                  DTYPE, False, LAST_EVERYWHERE, FIRST_ADD, TIMING, BARRIER=not TAIL)  # fmt: skip
    if not TAIL:
        if USE_PDL:  # engine/kernels/pdl.py: the attention kernel after this one gets scheduled now
            tl.extra.cuda.gdc_launch_dependents()
        gemv_phase(out_ptr, HID, qkv_w_ptr, qkv_w_ptr, qkv_part_ptr, MAX_M * QKV, M, QKV, HID, KS_Q, True, False, False, BM, BN_QKV, BK, P,
                   DTYPE, CHUNK=CK_Q)
        if INVARIANT and not ROPE_LATER:
            phase_end(bar_ptr, t_ptr, 13, FIRST_ADD, TIMING)
            if not ROPE_ITEMS:
                _qkv_rope_phase(row, qkv_part_ptr, MAX_M * QKV, qkv_ptr, M, pos_ptr, cos_sin_ptr, qk_w_ptr, kk_w_ptr, k_cache_ptr,
                                v_cache_ptr, slot_ptr, stride_cos, stride_cslot, stride_chead, qk_eps, KS_Q, NH, NKV, D, QK_NORM,
                                BLOCK_HQ, BLOCK_HK, BLOCK_HID, DTYPE)  # fmt: skip
            if ATTEND:  # layer l+1's fixed-split attention, items (row, KV head, slot), into attn
                if not ROPE_ITEMS:
                    phase_end(bar_ptr, t_ptr, 15, FIRST_ADD, TIMING)
                for item in range(pid, M * NKV * slots, P):
                    t, g = item // (NKV * slots), item // slots % NKV
                    seq, live, context = locate(t, seq_lens_ptr, seq_lens_ptr, M, 1, True)  # one row a sequence
                    q_ptr = qkv_ptr
                    if ROPE_ITEMS:  # q heads, key and value of (t, g) in this program's rows of qkv [P, GROUP + 2, D]
                        mine = qkv_ptr + pid * ((GROUP + 2) * D)
                        q_ptr = mine - (t * QKV + g * (GROUP * D))  # so that piece_item's q of (t, g) is `mine`
                        tl.debug_barrier()  # the item before has read them
                        if item % slots < tl.cdiv(context, SPLIT_):  # it has pieces: its q, the new K/V row
                            rope_kv_head(t, g, qkv_part_ptr, MAX_M * QKV, mine, mine + GROUP * D, mine + (GROUP + 1) * D, pos_ptr,
                                         cos_sin_ptr, qk_w_ptr, kk_w_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, stride_cos,
                                         stride_cslot, stride_chead, 1.0 / D, qk_eps, KS_Q, NH, NKV, D, QK_NORM, BLOCK_HQ, BLOCK_HK)  # fmt: skip
                            stamp(t_ptr, 17, TIMING)  # bench only: q, the new K/V row
                    piece_item(
                        t, g, item % slots, slots, seq, live, context, q_ptr, k_cache_ptr, v_cache_ptr, bt_ptr,
                        ws_m_ptr, ws_l_ptr, ws_acc_ptr, count_ptr, attn_ptr, QKV, D, NH * D, D, stride_bt, stride_cblk,
                        stride_cslot, stride_chead, sm_scale_log2, pieces, NH, GROUP, BLOCK_H, D, BLOCK_SIZE, BLOCK_N_, SPLIT_,
                        False, t_ptr, TIMING,
                    )  # fmt: skip
    stamp(t_ptr, 11, TIMING)  # the end (the qkv phase's, but at TAIL)
