"""The attention phase of the one-kernel-per-layer decode (layer_kernel.py), and the L2
prefetch of its KV: Triton functions inlined into `decoder_layer_kernel`, not kernels.

Items (row m, KV head g, split s), dealt round-robin over the P programs. An item normalizes
(Qwen3) and rotates its GROUP query heads and the new key in registers, with the roundings of
fused_ops._norm_rope_heads; split 0 stores the new K/V row into the cache, and every split takes
it from registers instead of the cache, so no barrier waits for that store. Each split runs the
online softmax (base 2) over its chunk of the row's context, in tiles of ABN tokens; the chunk is
an even share rounded up to whole tiles (engine/attention/triton_kernels.py's `split_chunk`). With
more than one split, each writes its normalized output and log-sum-exp, then adds one to the
(m, g) counter (acq_rel); the split that arrives last combines the group's heads into attn and
puts the counter back to 0. Empty splits write lse -inf and zeros. Rows of seq_len 0 (graph
padding) write zeros and no cache row.
"""

from __future__ import annotations

import triton
import triton.language as tl

from engine.attention.triton_kernels import split_chunk
from engine.pdl import prefetch_l2


@triton.jit
def rnd(x, DTYPE: tl.constexpr):
    return x.to(DTYPE).to(tl.float32)


@triton.jit
def _norm_rope(x1, x2, w_ptr, cos, sin, eps, QK_NORM: tl.constexpr, HALF: tl.constexpr, DTYPE: tl.constexpr):
    # x1, x2 [R, HALF] fp32: the halves of R heads -> normed (Qwen3) and rotated, in DTYPE;
    # the roundings of fused_ops._norm_rope_heads.
    if QK_NORM:
        rstd = tl.math.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) * (1.0 / (2 * HALF)) + eps)[:, None]
        d = tl.arange(0, HALF)[None, :]
        x1 = rnd(tl.load(w_ptr + d).to(tl.float32) * rnd(x1 * rstd, DTYPE), DTYPE)
        x2 = rnd(tl.load(w_ptr + HALF + d).to(tl.float32) * rnd(x2 * rstd, DTYPE), DTYPE)
    o1 = rnd(x1 * cos, DTYPE) - rnd(x2 * sin, DTYPE)
    o2 = rnd(x2 * cos, DTYPE) + rnd(x1 * sin, DTYPE)
    return o1.to(DTYPE), o2.to(DTYPE)


@triton.jit
def _kv_tile(k_cache_ptr, v_cache_ptr, bt_row, n0, end, cur, g, stride_cblk, stride_ctok, stride_chead,
             HALF: tl.constexpr, D: tl.constexpr, BLOCK_SIZE: tl.constexpr, ABN: tl.constexpr):
    # Cached K (two halves) and V rows of tokens n0..n0+ABN-1 below `end`, except the new one.
    offs_n = n0 + tl.arange(0, ABN)
    ok = (offs_n < end) & (offs_n != cur)
    page = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=ok, other=0).to(tl.int64)
    kv = (page * stride_cblk + (offs_n % BLOCK_SIZE) * stride_ctok + g * stride_chead)[:, None]
    d = tl.arange(0, HALF)[None, :]
    k1 = tl.load(k_cache_ptr + kv + d, mask=ok[:, None], other=0.0)
    k2 = tl.load(k_cache_ptr + kv + HALF + d, mask=ok[:, None], other=0.0)
    v = tl.load(v_cache_ptr + kv + tl.arange(0, D)[None, :], mask=ok[:, None], other=0.0)
    return k1, k2, v


@triton.jit
def _item(item, seq_lens_ptr, num_splits, NKV: tl.constexpr, ABN: tl.constexpr):
    # Attention item -> (row m, KV head g, split s, row's seq_len, the split's token range).
    m = item // (NKV * num_splits)
    g = (item // num_splits) % NKV
    s = item % num_splits
    seq_len = tl.load(seq_lens_ptr + m)
    chunk = split_chunk(seq_len, num_splits, ABN)
    start = s * chunk
    end = tl.minimum(start + chunk, seq_len)
    return m, g, s, seq_len, start, end


@triton.jit
def prefetch_kv(
    k_cache_ptr, v_cache_ptr, bt_ptr, seq_lens_ptr, M, num_splits, stride_cblk, stride_ctok, stride_chead, stride_bt,
    NKV: tl.constexpr, D: tl.constexpr, BLOCK_SIZE: tl.constexpr, ABN: tl.constexpr, P: tl.constexpr,
):  # fmt: skip
    # Pull the cached K/V rows of this program's attention items (the same deal as
    # `attention_phase`) into L2 while the norm and qkv phases run: none of them is this
    # layer's output, and the attention phase is a chain of dependent loads.
    pid = tl.program_id(0)
    lines = tl.arange(0, D // 64)[None, :] * 64  # the 128-byte lines of a bf16/fp16 row
    for item in range(pid, M * NKV * num_splits, P):
        m, g, s, seq_len, start, end = _item(item, seq_lens_ptr, num_splits, NKV, ABN)
        bt_row = bt_ptr + m.to(tl.int64) * stride_bt
        for n0 in range(start, end, ABN):
            offs_n = tl.minimum(n0 + tl.arange(0, ABN), end - 1)
            page = tl.load(bt_row + offs_n // BLOCK_SIZE).to(tl.int64)
            kv = (page * stride_cblk + (offs_n % BLOCK_SIZE) * stride_ctok + g * stride_chead)[:, None] + lines
            prefetch_l2(k_cache_ptr + kv)
            prefetch_l2(v_cache_ptr + kv)


@triton.jit
def attention_phase(
    qkv_ptr, pos_ptr, cos_sin_ptr, qn_ptr, kn_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, seq_lens_ptr, slot_ptr,
    part_o_ptr, part_lse_ptr, count_ptr, attn_ptr,
    M, num_splits, eps, sm_scale_log2, stride_cblk, stride_ctok, stride_chead, stride_bt,
    NH: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr, QK_NORM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    ABN: tl.constexpr, BLOCK_S: tl.constexpr, BG: tl.constexpr, P: tl.constexpr, DTYPE: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    GROUP: tl.constexpr = NH // NKV
    BH: tl.constexpr = 16 if GROUP < 16 else GROUP  # tl.dot's smallest M
    HALF: tl.constexpr = D // 2
    QKV: tl.constexpr = (NH + 2 * NKV) * D
    hh = tl.arange(0, BH)
    h_ok = hh < GROUP
    d = tl.arange(0, HALF)[None, :]
    dd = tl.arange(0, D)[None, :]
    for item in range(pid, M * NKV * num_splits, P):
        m, g, s, seq_len, start, end = _item(item, seq_lens_ptr, num_splits, NKV, ABN)
        heads = g * GROUP + hh
        attn_rows = attn_ptr + m * NH * D + heads[:, None] * D
        if seq_len == 0:  # graph padding: zeros, no cache write
            if s == 0:
                tl.store(attn_rows + dd, tl.zeros([BH, D], DTYPE), mask=h_ok[:, None])
        else:
            cur = seq_len - 1  # the new token: taken from registers, not the cache
            bt_row = bt_ptr + m.to(tl.int64) * stride_bt
            # The first tile's loads go out before q and k are ready (they need no phase-1 output).
            k1, k2, v = _kv_tile(k_cache_ptr, v_cache_ptr, bt_row, start, end, cur, g, stride_cblk, stride_ctok,
                                    stride_chead, HALF, D, BLOCK_SIZE, ABN)  # fmt: skip
            pos = tl.load(pos_ptr + m).to(tl.int64)
            cos = rnd(tl.load(cos_sin_ptr + pos * D + d), DTYPE)
            sin = rnd(tl.load(cos_sin_ptr + pos * D + HALF + d), DTYPE)
            row = qkv_ptr + m * QKV
            qp = row + heads[:, None] * D + d
            kp = row + NH * D + g * D + d
            q1, q2 = _norm_rope(
                tl.load(qp, mask=h_ok[:, None], other=0.0, cache_modifier=".cg").to(tl.float32),
                tl.load(qp + HALF, mask=h_ok[:, None], other=0.0, cache_modifier=".cg").to(tl.float32),
                qn_ptr, cos, sin, eps, QK_NORM, HALF, DTYPE,
            )  # fmt: skip
            k1c, k2c = _norm_rope(
                tl.load(kp, cache_modifier=".cg").to(tl.float32), tl.load(kp + HALF, cache_modifier=".cg").to(tl.float32),
                kn_ptr, cos, sin, eps, QK_NORM, HALF, DTYPE,
            )  # fmt: skip
            vc = tl.load(row + (NH + NKV) * D + g * D + dd, cache_modifier=".cg")  # [1, D]
            slot = tl.load(slot_ptr + m)
            if (s == 0) & (slot >= 0):
                dst = slot * stride_ctok + g * stride_chead
                tl.store(k_cache_ptr + dst + d, k1c)
                tl.store(k_cache_ptr + dst + HALF + d, k2c)
                tl.store(v_cache_ptr + dst + dd, vc)
            m_i = tl.full([BH], float("-inf"), tl.float32)
            l_i = tl.zeros([BH], tl.float32)
            acc = tl.zeros([BH, D], tl.float32)
            for n0 in range(start, end, ABN):
                if n0 != start:
                    k1, k2, v = _kv_tile(k_cache_ptr, v_cache_ptr, bt_row, n0, end, cur, g, stride_cblk,
                                         stride_ctok, stride_chead, HALF, D, BLOCK_SIZE, ABN)  # fmt: skip
                offs_n = n0 + tl.arange(0, ABN)
                is_cur = (offs_n == cur)[:, None]
                k1 = tl.where(is_cur, k1c, k1)
                k2 = tl.where(is_cur, k2c, k2)
                v = tl.where(is_cur, vc, v)
                sc = (tl.dot(q1, tl.trans(k1)) + tl.dot(q2, tl.trans(k2))) * sm_scale_log2
                sc = tl.where((offs_n < end)[None, :], sc, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(sc, 1))
                alpha = tl.exp2(m_i - m_new)
                p = tl.exp2(sc - m_new[:, None])
                l_i = l_i * alpha + tl.sum(p, 1)
                acc = acc * alpha[:, None] + tl.dot(p.to(DTYPE), v)
                m_i = m_new
            if num_splits == 1:
                tl.store(attn_rows + dd, (acc / l_i[:, None]).to(DTYPE), mask=h_ok[:, None])
            else:
                # Empty splits write lse -inf and zeros.
                part = (m * NH + heads) * num_splits + s  # [BH]
                tl.store(part_o_ptr + part[:, None] * D + dd, acc / tl.where(l_i > 0, l_i, 1.0)[:, None], mask=h_ok[:, None])
                tl.store(part_lse_ptr + part, tl.where(l_i > 0, m_i + tl.log2(l_i), float("-inf")), mask=h_ok)
                tl.debug_barrier()
                done = tl.atomic_add(count_ptr + m * NKV + g, 1, sem="acq_rel", scope="gpu")
                tl.debug_barrier()
                if done == num_splits - 1:  # the last split of (m, g) combines the group's heads
                    r = tl.arange(0, BG * BLOCK_S)
                    j = r // BLOCK_S
                    ok = (j < GROUP) & (r % BLOCK_S < num_splits)
                    idx = (m * NH + g * GROUP + j) * num_splits + r % BLOCK_S
                    lse = tl.reshape(tl.load(part_lse_ptr + idx, mask=ok, other=float("-inf"), cache_modifier=".cg"), [BG, BLOCK_S])
                    po = tl.load(part_o_ptr + idx[:, None] * D + dd, mask=ok[:, None], other=0.0, cache_modifier=".cg")
                    mx = tl.max(lse, 1)
                    w = tl.exp2(lse - tl.where(mx == float("-inf"), 0.0, mx)[:, None])  # [BG, BLOCK_S]
                    out = tl.sum(tl.reshape(po, [BG, BLOCK_S, D]) * w[:, :, None], 1)
                    out = out / tl.where(tl.sum(w, 1) > 0, tl.sum(w, 1), 1.0)[:, None]  # [BG, D]
                    jj = tl.arange(0, BG)[:, None]
                    tl.store(attn_ptr + m * NH * D + (g * GROUP + jj) * D + dd, out.to(DTYPE), mask=jj < GROUP)
                    tl.atomic_xchg(count_ptr + m * NKV + g, 0)


