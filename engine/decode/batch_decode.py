"""`BatchDecode`: the decode steps of a few to 64 rows in two launches per layer, a split-KV
attention kernel (engine/kernels/rope_decode.py) and one persistent kernel for everything
between two attention calls (engine/kernels/batch_kernel.py), instead of ten kernels per layer.

Past a few rows the one-kernel-per-layer decode (fused_decode.py) loses: its attention phase,
one program per SM, reads the rows' KV slower than the split-KV kernel's four programs per SM
(bench/RESULTS.md). So attention is the backend's split-KV kernel, with q/k norm, rope and the
new K/V rows' store folded in, and the rest of each layer, o_proj to the next layer's qkv
projection, is one launch.

Built by the model runner inside the `cuda_graph` region when `unsupported()` (rules.py's
rules) finds nothing against the model; the model's forward hands it the decode steps it `applies` to (rows
in min_rows..max_rows, its backend), eager or captured.

Rules:
- Scratch (streams, the normed stream, activations, fp32 partial sums, the attention output,
  the barrier counter) is allocated once, for max_rows; kernels index rows up to M, so
  every graph batch size shares it. The barrier counter needs no reset between steps (each
  barrier leaves its low bits 0): it is zeroed when built and after a resume (`after_resume`).
- The embedding lookup is the first launch's norm (batch_kernel.py HEAD), which launches plainly:
  the attention after it reads the step's metadata before its PDL wait, and the kernel before
  it (a decode graph's gather, engine/runner/graph_io.py) writes that metadata.
- One program per SM, launched cooperatively (grid barriers). GEMV tiles of BM = 64 rows
  (tl.dot), BN output columns; K splits (1, 2, 4, 8) fill one wave of items.

`--no-batch-decode` turns it off (engine/decode/attach.py).

`invariant` (`--deterministic`; rules.py `unsupported(..., invariant=True)`): the persistent
kernel in the invariant GEMM's K order, its last phase summing qkv into `qkv`, rotating q and k
there and storing the new K/V rows into the layer's cache (batch_kernel.py INVARIANT), and
between the launches the backend's fixed-split attention on that q (`attend`, launched with PDL), so that every
row has the bits of the mode's layers one op at a time (tests/test_gpu_deterministic_decode.py).
Steps of at most ATTEND_ROWS rows run that attention as the launch's last phase instead, its
split path's items and workspace (batch_kernel.py ATTEND), one launch a layer. Steps of more than
ROPE_LATER_ROWS rows end the launch at the qkv partials, and the attention's one-token-a-program
kernel sums and rotates them and stores the new K/V rows (batch_kernel.py ROPE_LATER,
qkv_parts.QkvParts).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.attention import ForwardContext
from engine.attention.base import AttentionMetadata
from engine.decode import rules
from engine.decode.rules import LayerShape, k_splits, prefetch_width

if TYPE_CHECKING:
    from engine.kernels.qkv_parts import QkvParts

KERNEL_MAX_ROWS = 64  # one tl.dot tile of rows
# Steps the runner hands it: above fused_decode.MAX_ROWS, up to this (measured in bench/RESULTS.md).
MAX_ROWS = 64
_BK = 64  # K per step of the GEMV loops
_STAGES = 8  # of their software pipeline (bench/history/2026-11-27.md)
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
_G_PRE, _D_PRE, _Q_PRE = 256, 512, 256


def unsupported(model: nn.Module, backend: object, invariant: bool = False) -> str | None:
    """Why `BatchDecode` (`invariant`: in `--deterministic`) cannot serve this model and backend
    (None: it can): rules.py (the same shapes, measured on the same one)."""
    return rules.unsupported(model, backend, invariant)


def kernel_consts(
    shape: LayerShape, programs: int, rows: int, use_pdl: bool, num_warps: int = 4, bn: int = 32,
    bn_gate: int = 32, bk: int = _BK, stages: int = _STAGES, g_pre: int = _G_PRE, d_pre: int = _D_PRE, q_pre: int = _Q_PRE,
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
        order = dict(INVARIANT=True, CK_O=ck_o, CK_D=ck_d, CK_Q=ck_q, CK_G=ck_g, WALK_G=walk_g, QK_NORM=shape.qk_norm,
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


class BatchDecode:
    def __init__(
        self, model: nn.Module, backend: object, min_rows: int, max_rows: int, num_warps: int = 4,
        bn: int = 32, bn_gate: int = 32, bk: int = _BK, stages: int = _STAGES, use_pdl: int = 1, g_pre: int = _G_PRE, d_pre: int = _D_PRE,
        q_pre: int = _Q_PRE, invariant: bool = False, attend: bool = True, few_bk: int = FEW_BK, few_stages: int = FEW_STAGES,
        everywhere: bool = True,
    ) -> None:  # fmt: skip
        from engine.kernels import pdl, rope_decode

        self.lm = model.model
        self.backend = backend
        self.shape = LayerShape.of(model)
        device, dtype = self.shape.device, self.shape.dtype
        qkv = (self.shape.nh + 2 * self.shape.nkv) * self.shape.d
        self.programs = torch.cuda.get_device_properties(device).multi_processor_count
        self.min_rows, self.max_rows = min_rows, min(max_rows, KERNEL_MAX_ROWS)
        rows = self.max_rows
        # engine/kernels/pdl.py: each attention kernel launches while the kernel before runs its qkv phase.
        self.invariant = invariant
        if invariant and num_warps != rules.INVARIANT_WARPS:
            raise ValueError(f"the invariant kernel runs {rules.INVARIANT_WARPS} warps (rules.py), not {num_warps}")
        self.pdl = pdl.enabled(device) and bool(use_pdl)
        # The kernel's arguments that are the same at every layer and step; the first launch's plain.
        self.consts = kernel_consts(self.shape, self.programs, rows, self.pdl, num_warps, bn, bn_gate, bk, stages, g_pre, d_pre,
                                    q_pre, invariant)  # fmt: skip
        # invariant: steps of at most `attend_rows` rows run the fixed-split attention in the launch
        # (ATTEND), on GEMV tiles of FEW_BM rows, its partials in the backend's workspace; steps of
        # one row (`everywhere`) their norms on every program (EVERYWHERE).
        self.attend_rows = min(ATTEND_ROWS, backend.workspace.m.shape[0]) if invariant and attend else 0
        few = [kernel_consts(self.shape, self.programs, rows, self.pdl, num_warps, bn, bn_gate, few_bk, few_stages, g_pre, d_pre,
                             q_pre, True, FEW_BM, backend.kv_cache.shape[3], r)
               for r in ((1 if everywhere else 0), 0)] if self.attend_rows else [self.consts] * 2  # fmt: skip
        # invariant: steps of more rows than ROPE_LATER_ROWS and the backend's workspace holds take
        # the attention's one-token-a-program kernel, which sums and rotates their qkv partials itself.
        self.wide_rows = max(ROPE_LATER_ROWS, backend.workspace.m.shape[0]) if invariant else rows
        wide = kernel_consts(self.shape, self.programs, rows, self.pdl, num_warps, bn, bn_gate, bk, stages, g_pre, d_pre, q_pre,
                             True, rope_later=True) if invariant else self.consts  # fmt: skip
        # (constants of a layer's launch, of the step's first launch: a plain one) by kind of step
        self.launch_sets = {k: (c, {**c, "launch_pdl": False})
                            for k, c in zip(("one", "few", "many", "wide"), (*few, self.consts, wide), strict=True)}
        ks_o, ks_d, ks_q = (self.consts[k] for k in ("KS_O", "KS_D", "KS_Q"))
        # The attention kernel's (kernels/rope_decode.py), reading qkv_part [ks_q, rows, qkv].
        attn0 = self.lm.layers[0].self_attn
        elem_bytes = backend.kv_cache.element_size()
        # One set for steps of few rows and one for more (rope_decode.batch_tile_config).
        self.attention_consts = [] if invariant else [rope_decode.kernel_consts(
            self.shape.nh, self.shape.nkv, self.shape.d, ks_q, rows * qkv, attn0.qkv_proj.bias is not None,
            self.shape.qk_norm, backend.kv_cache.shape[3], elem_bytes, self.pdl,
            rope_decode.batch_tile_config(self.shape.d, elem_bytes, m), rope_decode.merge_for(m),
        ) for m in (rope_decode.FEW_ROWS, rows)]  # fmt: skip
        f32 = dict(dtype=torch.float32, device=device)
        half = dict(dtype=dtype, device=device)
        self.h = torch.zeros(rows, self.shape.hidden, **half)
        self.h_mid = torch.zeros(rows, self.shape.hidden, **half)
        self.xn = torch.zeros(rows, self.shape.hidden, **half)
        # the one-row steps' normed row, each program's own (EVERYWHERE)
        self.xn_own = torch.zeros(self.programs if self.launch_sets["one"][0]["EVERYWHERE"] else 0, 1, self.shape.hidden, **half)
        self.act = torch.zeros(rows, self.shape.inter, **half)
        self.attn = torch.zeros(rows, self.shape.nh, self.shape.d, **half)
        self.o_part = torch.zeros(ks_o, rows, self.shape.hidden, **f32)
        self.down_part = torch.zeros(ks_d, rows, self.shape.hidden, **f32)
        self.qkv_part = torch.zeros(ks_q, rows, qkv, **f32)
        # invariant: the rounded qkv the layers' rotary takes; ROPE_ITEMS: [programs, GROUP + 2, D] in its first rows
        item_rows = -(-self.programs * (self.shape.nh // self.shape.nkv + 2) * self.shape.d // qkv)
        self.qkv = torch.zeros(max(rows, item_rows) if invariant else 0, qkv, **half)
        self.barrier = torch.zeros(1, dtype=torch.int32, device=device)
        self.nbytes = sum(
            t.numel() * t.element_size()
            for t in (self.h, self.h_mid, self.xn, self.xn_own, self.act, self.attn, self.o_part, self.down_part, self.qkv_part, self.qkv)
        )
        self.compiled: object = None  # the kernel as last launched (bench: registers, spills)

    def after_resume(self) -> None:
        """The `cuda_graph` region came back with undefined contents: the barrier counter starts at zero."""
        self.barrier.zero_()

    def applies(self, input_ids: torch.Tensor, ctx: ForwardContext) -> bool:
        return (
            ctx.backend is self.backend and ctx.meta.is_decode and not ctx.verify
            and self.min_rows <= input_ids.shape[0] <= self.max_rows
        )

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext, timing: torch.Tensor | None = None
    ) -> torch.Tensor:  # [M] int64, [M] int64 -> [M, hidden]; timing: [layers + 1, P, STAMPS] int64 (bench)
        lm, meta = self.lm, ctx.meta
        m = input_ids.shape[0]
        out = torch.empty(m, self.shape.hidden, dtype=self.h.dtype, device=self.h.device)
        layers = list(lm.layers)
        # the attention's splits and workspace, every layer's (the invariant path: the backend's own)
        plan = None if self.invariant else self.backend.merged_decode_plan(m)
        attn = self.attn
        few = 0 < m <= self.attend_rows and meta.seq_lens.shape[0] == m  # ATTEND: a decode row a sequence
        kind = ("one" if m == 1 else "few") if few else "wide" if m > self.wide_rows else "many"
        for i in range(len(layers) + 1):
            prev = layers[i - 1] if i > 0 else None  # whose o_proj and MLP run
            nxt = layers[i] if i < len(layers) else None  # whose norm, qkv and attention run
            self._launch(prev, nxt, i, input_ids, positions, meta, attn, out, timing[i] if timing is not None else None, kind)
            if nxt is not None and not few:  # (few: the launch attended, into self.attn)
                if self.invariant:  # q rotated, the new K/V rows in the cache: the kernel's last phase, or (wide) the attention's
                    q = self.qkv[:m, : self.shape.nh * self.shape.d].view(m, self.shape.nh, self.shape.d)
                    rope = self._qkv_parts(nxt, positions, meta) if kind == "wide" else None
                    attn = self.backend.attend(nxt.self_attn.layer_id, q, meta, pdl=self.pdl, rope=rope)
                else:
                    self.attention(i, nxt, positions, meta, plan)
        return out

    def _qkv_parts(self, layer: nn.Module, positions: torch.Tensor, meta: AttentionMetadata) -> QkvParts:
        """The invariant launch's qkv partials of `layer` as the fixed-split token kernel takes them
        (qkv_parts.QkvParts): it sums, norms and rotates them and stores the new K/V rows."""
        from engine.kernels.qkv_parts import QkvParts

        sa = layer.self_attn
        qw, kw = (sa.q_norm.weight, sa.k_norm.weight) if self.shape.qk_norm else (None, None)
        eps = sa.q_norm.eps if self.shape.qk_norm else 0.0
        return QkvParts(self.qkv_part, self.qkv, positions, self.lm.rotary_emb.cos_sin_cache, qw, kw, eps, meta.slot_mapping)

    def attention(
        self, i: int, layer: nn.Module, positions: torch.Tensor, meta: AttentionMetadata,
        plan: tuple[int, torch.Tensor, torch.Tensor, torch.Tensor],  # backend.merged_decode_plan(M)
    ) -> None:  # fmt: skip
        """Layer i's attention of a step of M = len(positions) rows from the qkv partials into
        `attn` (its new K/V rows into the cache): engine/kernels/rope_decode.py."""
        from engine.decode.decode_attention import norm_inputs
        from engine.kernels import rope_decode

        attn = layer.self_attn
        rope_decode.rope_decode(
            norm_inputs(attn), self.qkv_part, attn.qkv_proj.bias, self.backend.layer_caches[i], positions,
            self.lm.rotary_emb.cos_sin_cache, (meta.slot_mapping, meta.block_tables, meta.seq_lens), self.attn[: positions.shape[0]], self.backend.scale,
            plan, self.attention_consts[positions.shape[0] > rope_decode.FEW_ROWS],
        )  # fmt: skip

    def _launch(
        self, prev: nn.Module | None, nxt: nn.Module | None, i: int, input_ids: torch.Tensor, positions: torch.Tensor,
        meta: AttentionMetadata, attn: torch.Tensor, out: torch.Tensor, timing: torch.Tensor | None, kind: str = "many",
    ) -> None:  # fmt: skip
        from engine.kernels.attention import LOG2E
        from engine.kernels.batch_kernel import batch_layer_kernel

        lm, m = self.lm, input_ids.shape[0]
        consts = self.launch_sets[kind][0 if i else 1]
        xn = self.xn_own if consts["EVERYWHERE"] else self.xn
        # INVARIANT's last phase: rope and layer l+1's cache (else: any tensors, not read)
        rope_args: tuple = (self.barrier,) * 7 + (0, 0, 0, 0.0)
        if self.invariant and nxt is not None:
            sa = nxt.self_attn
            k_cache, v_cache, slots = self.backend.kv_target(sa.layer_id, meta)
            cos_sin = lm.rotary_emb.cos_sin_cache
            qw, kw = (sa.q_norm.weight, sa.k_norm.weight) if self.shape.qk_norm else (self.barrier, self.barrier)
            rope_args = (positions, cos_sin, qw, kw, k_cache, v_cache, slots, cos_sin.stride(0), k_cache.stride(1),
                         k_cache.stride(2), sa.q_norm.eps if self.shape.qk_norm else 0.0)  # fmt: skip
        # ATTEND's: the step's tables, the backend's workspace, its slots a (row, KV head) (else: not read)
        attend_args: tuple = (self.barrier,) * 6 + (0, 0, 0.0, 0, 1)
        if kind in ("one", "few") and nxt is not None:
            ws, m_kv = self.backend.workspace, m * self.shape.nkv
            attend_args = (meta.block_tables, meta.seq_lens, ws.m, ws.total, ws.acc, ws.counts, meta.block_tables.stride(0),
                           k_cache.stride(0), self.backend.scale * LOG2E, ws.m.shape[1], max(1, self.programs // m_kv))  # fmt: skip
            attn = self.attn
        # layer l's weights (HEAD: any tensor), layer l+1's (TAIL: any tensor)
        a, mlp = (prev.self_attn, prev.mlp) if prev is not None else (nxt.self_attn, nxt.mlp)
        post = (prev or nxt).post_attention_layernorm.weight
        norm = nxt.input_layernorm.weight if nxt is not None else lm.norm.weight
        self.compiled = batch_layer_kernel[(self.programs,)](
            lm.embed_tokens.weight, input_ids, attn, self.h, self.h_mid,
            a.o_proj.weight, post, mlp.gate_up_proj.weight, mlp.down_proj.weight,
            norm, (nxt or prev).self_attn.qkv_proj.weight,
            xn, out if nxt is None else xn, self.act, self.o_part, self.down_part, self.qkv_part,
            self.qkv if self.invariant else self.qkv_part, *rope_args, *attend_args, self.barrier,
            timing if timing is not None else self.barrier, m, self.shape.eps, HEAD=prev is None, TAIL=nxt is None,
            TIMING=timing is not None, **consts,
        )  # fmt: skip
