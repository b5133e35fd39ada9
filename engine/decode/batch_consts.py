"""The persistent batch kernel's constants (engine/kernels/batch_kernel.py, launched by
batch_decode.py `BatchDecode`): its row limits, tiles and pipelines, each with the measurement
that set it, and `kernel_consts`, its constexprs for a shape, a row count and a kind of step
(no device needed: bench/kernels/occupancy.py compiles them)."""

from __future__ import annotations

from engine.decode.rules import LayerShape, k_splits, prefetch_width

KERNEL_MAX_ROWS = 64  # one tl.dot tile of rows
GEMV_BN, GEMV_BN_GATE = 32, 32  # output columns of a GEMV item: o_proj, down and qkv; gate_up
# o_proj, down and qkv items of the default kernel in steps of at most rope_decode.FEW_ROWS rows
# (twice the K splits). H200, 0.6B, step ms at 32 / 64 columns (bench/history/2026-12-02.md, entry
# g): 1 / 4 / 8 rows at 8k 1.199 / 1.798 / 2.668 -> 1.172 / 1.779 / 2.653, 1 row at 32k 1.863 ->
# 1.839, 8 rows at 512 1.046 -> 1.022; past 8 rows slower (64 rows at 512 1.789 -> 1.833).
GEMV_BN_FEW = 64
GEMV_BK = 64  # K per step of the GEMV loops
GEMV_STAGES = 8  # of their software pipeline (bench/history/2026-11-27.md)
# `invariant` steps of at most ATTEND_ROWS rows run the fixed-split attention inside the launch
# (batch_kernel.py ATTEND), on GEMV tiles of tl.dot's smallest M with the fused decode's K step and
# pipeline (fused_decode.py). H200, 0.6B, context 512 (bench/history/2026-12-01.md, entry j): the
# step at 1 / 4 / 16 rows 1.094 / 1.165 / 1.457 ms with the attention its own launch, 1.006 / 1.129
# / 1.591 inside it. Its items (row, KV head, slot) are as many as the programs, so from 8 rows a
# slot walks two of a 512-token context's four pieces one after the other: a launch at 8 rows
# 38.9 us against 27.8 plus the attention kernel's. Steps of one row normalize on every program
# (EVERYWHERE, two grid barriers fewer: a launch 32.0 -> 30.7 us, the step 0.957 ms); at 2 and 4
# rows each program's serial norms cost more than the barriers (32.4 -> 33.0, 33.9 -> 37.2 us).
ATTEND_ROWS = 4
# `invariant` steps of more than ROPE_LATER_ROWS rows (and more than the attention's workspace
# holds) end the launch at the qkv partials: the one-token-a-program attention after it sums, norms
# and rotates them (batch_kernel.py ROPE_LATER), with no last phase and no grid barrier. H200, 0.6B,
# context 512 (bench/history/2026-12-01.md, entry l): the step at 64 rows 2.020 -> 1.966 / 1.961 ms,
# at 32 rows 1.632 -> 1.692 / 1.683 (each program's serial sums cost more than the barrier saves).
ROPE_LATER_ROWS = 32
# `invariant` steps that attend in the launch (ATTEND_ROWS) rotate a row's qkv on its attention
# items, each (row, KV head) its own heads (batch_kernel.py ROPE_ITEMS), not on one program a row
# behind a barrier of its own. H200, 0.6B, context 512 (bench/history/2026-12-02.md, entry a): the
# step at 1 / 2 / 4 rows 0.949 / 1.011 / 1.124 -> 0.905 / 0.968 / 1.069 ms.
ROPE_ITEMS = True
FEW_BM, FEW_BK, FEW_STAGES = 16, 128, 5
# L2 prefetches (batch_kernel.py; bench/history/2026-11-27.md): the first weights of
# each row of a program's gate_up, down_proj and next-layer qkv items, issued once its GEMV item
# before them is done, so they land during the barrier (and norm) between.
G_PRE_WIDTH, D_PRE_WIDTH, Q_PRE_WIDTH = 256, 512, 256
# `invariant`: a gate_up item walks its K chunks in one software-pipelined loop, not a loop a chunk
# (grid_phases.gemv_phase FLAT_WALK: the same sums; its bits checked on an H200, bench/history/
# 2026-12-02.md entry h). Off until its step is measured against the loop a chunk.
FLAT_WALK = False


def kernel_consts(
    shape: LayerShape, programs: int, rows: int, use_pdl: bool, num_warps: int = 4, bn: int = 32,
    bn_gate: int = 32, bk: int = GEMV_BK, stages: int = GEMV_STAGES, g_pre: int = G_PRE_WIDTH, d_pre: int = D_PRE_WIDTH, q_pre: int = Q_PRE_WIDTH,
    invariant: bool = False, bm: int = KERNEL_MAX_ROWS, attend_block: int = 0, everywhere_rows: int = 0,
    rope_later: bool = False, rope_items: bool | None = None,
) -> dict[str, object]:  # fmt: skip
    """The persistent kernel's constexprs and launch options, the same at every layer and step of
    `rows` rows at most on `programs` SMs (no device needed: bench/kernels/occupancy.py compiles them).
    `invariant`: the K splits are invariant_tiles.config's chunks (`--deterministic`), and the
    last phase sums qkv and rotates it (batch_kernel.py INVARIANT); with `attend_block` (the KV
    cache's block size) the fixed-split attention follows it in the launch (ATTEND). `bm`: rows
    of a GEMV tile, the most a step may have. `everywhere_rows`: every program normalizes the
    rows, up to that many, into its own xn rows (EVERYWHERE: no grid barrier after a norm).
    `rope_later` (`invariant`): no last phase; the attention kernel after it sums and rotates qkv
    (ROPE_LATER). `rope_items` (with `attend_block`; None: ROPE_ITEMS): the attention's items
    sum and rotate it (ROPE_ITEMS)."""
    import triton

    qkv = (shape.nh + 2 * shape.nkv) * shape.d
    order: dict[str, object] = {}
    if invariant:
        (ks_o, ck_o), (ks_d, ck_d), (ks_q, ck_q), (walk_g, ck_g) = (
            invariant_chunks(n, k, bk) for n, k in
            ((shape.hidden, shape.nh * shape.d), (shape.hidden, shape.inter), (qkv, shape.hidden), (2 * shape.inter, shape.hidden))
        )  # fmt: skip
        order = dict(INVARIANT=True, CK_O=ck_o, CK_D=ck_d, CK_Q=ck_q, CK_G=ck_g, WALK_G=walk_g, FLAT_WALK=FLAT_WALK, QK_NORM=shape.qk_norm,
                     BLOCK_HQ=triton.next_power_of_2(shape.nh), BLOCK_HK=triton.next_power_of_2(shape.nkv),
                     BN_D=one_wave(shape.hidden, ks_d, programs, bn), BN_Q=one_wave(qkv, ks_q, programs, bn),
                     ROPE_LATER=rope_later)  # fmt: skip
        if attend_block:
            from engine.kernels import attention_fixed as af

            group = shape.nh // shape.nkv
            order.update(ATTEND=True, GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_SIZE=attend_block,
                         BLOCK_N_=af.BLOCK_N, SPLIT_=af.SPLIT, ROPE_ITEMS=ROPE_ITEMS if rope_items is None else rope_items)  # fmt: skip
        split_d, split_q = ck_d, ck_q
    else:
        ks_o = k_splits(shape.hidden // bn, shape.nh * shape.d, programs, bk)
        ks_d = k_splits(shape.hidden // bn, shape.inter, programs, bk)
        ks_q = k_splits(-(-qkv // bn), shape.hidden, programs, bk)
        split_d, split_q = shape.inter // ks_d, shape.hidden // ks_q
    return dict(
        HID=shape.hidden, NH=shape.nh, NKV=shape.nkv, D=shape.d, INTER=shape.inter,
        KS_O=ks_o, KS_D=ks_d, KS_Q=ks_q, MAX_M=rows, BM=bm, BN=bn, BN_G=bn_gate, BK=bk,
        BLOCK_HID=triton.next_power_of_2(shape.hidden), P=programs, FIRST_ADD=2**31 - (programs - 1), USE_PDL=use_pdl, launch_pdl=use_pdl,
        num_warps=num_warps, num_stages=stages, launch_cooperative_grid=True, enable_fp_fusion=False,
        G_PRE=prefetch_width(shape.hidden, g_pre), D_PRE=prefetch_width(split_d, d_pre), Q_PRE=prefetch_width(split_q, q_pre),
        EVERYWHERE=everywhere_rows > 0, XN_ROWS=everywhere_rows, **order,
    )  # fmt: skip


def one_wave(n: int, chunks: int, programs: int, bn: int) -> int:
    """Columns an item of an invariant GEMV phase of N = n over `chunks` K chunks: the narrowest of
    bn, 2 bn, 4 bn whose items fit one wave of the programs (the chunks are fixed, so the width
    sets the rounds; the 0.6B's down and qkv at bn 32 took two). The width never sets the bits."""
    return next((w for w in (bn, 2 * bn) if -(-n // w) * chunks <= programs), 4 * bn)


def invariant_chunks(n: int, k: int, bk: int) -> tuple[int, int]:
    """(chunks, chunk length) of K for a weight [n, k] in `--deterministic`'s GEMM order
    (invariant_tiles.config), in K steps of the kernel's bk, which must divide the chunks and K
    (BLOCK_K itself is not in the bits: invariant_tiles.py)."""
    from engine.kernels.invariant_tiles import chunking, config

    chunk, chunks = chunking(k, config(n, k))
    if chunk % bk or k % bk:
        raise ValueError(f"weight [{n}, {k}]: K chunks of {chunk}, which the kernel's K step {bk} does not divide")
    return chunks, chunk
