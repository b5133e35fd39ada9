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
  (tl.dot), BN output columns (twice as many for o_proj, down and qkv in steps of at most 8 rows:
  batch_consts.GEMV_BN_FEW); K splits (1, 2, 4, 8) fill one wave of items.

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
qkv_parts.QkvParts). Those row limits, the GEMV tiles and the kernel's constexprs
(`kernel_consts`) are batch_consts.py's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.attention import ForwardContext
from engine.attention.base import AttentionMetadata
from engine.decode import batch_consts as bc
from engine.decode import rules
from engine.decode.rules import LayerShape

if TYPE_CHECKING:
    from engine.kernels.qkv_parts import QkvParts

# Steps the runner hands it: above fused_decode.MAX_ROWS, up to this (measured in bench/RESULTS.md).
MAX_ROWS = 64


def unsupported(model: nn.Module, backend: object, invariant: bool = False) -> str | None:
    """Why `BatchDecode` (`invariant`: in `--deterministic`) cannot serve this model and backend
    (None: it can): rules.py (the same shapes, measured on the same one)."""
    return rules.unsupported(model, backend, invariant)


class BatchDecode:
    def __init__(
        self, model: nn.Module, backend: object, min_rows: int, max_rows: int, num_warps: int = 4,
        bn: int = bc.GEMV_BN, bn_gate: int = bc.GEMV_BN_GATE, bk: int = bc.GEMV_BK, bn_few: int = bc.GEMV_BN_FEW, stages: int = bc.GEMV_STAGES, use_pdl: int = 1,
        g_pre: int = bc.G_PRE_WIDTH, d_pre: int = bc.D_PRE_WIDTH, q_pre: int = bc.Q_PRE_WIDTH, invariant: bool = False,
        attend: bool = True, few_bk: int = bc.FEW_BK, few_stages: int = bc.FEW_STAGES, everywhere: bool = True,
    ) -> None:  # fmt: skip
        from engine.kernels import pdl, rope_decode

        self.lm = model.model
        self.backend = backend
        self.shape = LayerShape.of(model)
        device, dtype = self.shape.device, self.shape.dtype
        qkv = (self.shape.nh + 2 * self.shape.nkv) * self.shape.d
        self.programs = torch.cuda.get_device_properties(device).multi_processor_count
        self.min_rows, self.max_rows = min_rows, min(max_rows, bc.KERNEL_MAX_ROWS)
        rows = self.max_rows
        # engine/kernels/pdl.py: each attention kernel launches while the kernel before runs its qkv phase.
        self.invariant = invariant
        if invariant and num_warps != rules.INVARIANT_WARPS:
            raise ValueError(f"the invariant kernel runs {rules.INVARIANT_WARPS} warps (rules.py), not {num_warps}")
        self.pdl = pdl.enabled(device) and bool(use_pdl)
        # The kernel's arguments that are the same at every layer and step; the first launch's plain.
        self.consts = bc.kernel_consts(self.shape, self.programs, rows, self.pdl, num_warps, bn, bn_gate, bk, stages, g_pre, d_pre,
                                    q_pre, invariant)  # fmt: skip
        # invariant: steps of at most `attend_rows` rows run the fixed-split attention in the launch
        # (ATTEND), on GEMV tiles of FEW_BM rows, its partials in the backend's workspace; steps of
        # one row (`everywhere`) their norms on every program (EVERYWHERE).
        self.attend_rows = min(bc.ATTEND_ROWS, backend.workspace.m.shape[0]) if invariant and attend else 0
        few = [bc.kernel_consts(self.shape, self.programs, rows, self.pdl, num_warps, bn, bn_gate, few_bk, few_stages, g_pre, d_pre,
                             q_pre, True, bc.FEW_BM, backend.kv_cache.shape[3], r)
               for r in ((1 if everywhere else 0), 0)] if self.attend_rows else [self.consts] * 2  # fmt: skip
        # invariant: steps of more rows than ROPE_LATER_ROWS and the backend's workspace holds take
        # the attention's one-token-a-program kernel, which sums and rotates their qkv partials itself.
        self.wide_rows = max(bc.ROPE_LATER_ROWS, backend.workspace.m.shape[0]) if invariant else rows
        wide = bc.kernel_consts(self.shape, self.programs, rows, self.pdl, num_warps, bn, bn_gate, bk, stages, g_pre, d_pre, q_pre,
                             True, rope_later=True) if invariant else self.consts  # fmt: skip
        # default: steps of at most the attention's FEW_ROWS rows take GEMV items of bn_few columns
        # (batch_consts.GEMV_BN_FEW), more K splits
        self.narrow_rows = 0 if invariant else rope_decode.FEW_ROWS
        narrow = self.consts if invariant else bc.kernel_consts(
            self.shape, self.programs, rows, self.pdl, num_warps, bn_few, bn_gate, bk, stages, g_pre, d_pre, q_pre)  # fmt: skip
        # (constants of a layer's launch, of the step's first launch: a plain one) by kind of step
        self.launch_sets = {k: (c, {**c, "launch_pdl": False}) for k, c in
                            zip(("one", "few", "many", "wide", "narrow"), (*few, self.consts, wide, narrow), strict=True)}  # fmt: skip
        # the partials' buffers hold every kind's K splits
        ks_o, ks_d, ks_q = (max(c[k] for c, _ in self.launch_sets.values()) for k in ("KS_O", "KS_D", "KS_Q"))
        # The attention kernel's (kernels/rope_decode.py), reading qkv_part [KS_Q, rows, qkv] of its steps' kind.
        attn0 = self.lm.layers[0].self_attn
        elem_bytes = backend.kv_cache.element_size()
        # One set for steps of few rows and one for more (rope_decode.batch_tile_config).
        self.attention_consts = [] if invariant else [rope_decode.kernel_consts(
            self.shape.nh, self.shape.nkv, self.shape.d, c["KS_Q"], rows * qkv, attn0.qkv_proj.bias is not None,
            self.shape.qk_norm, backend.kv_cache.shape[3], elem_bytes, self.pdl,
            rope_decode.batch_tile_config(self.shape.d, elem_bytes, m), rope_decode.merge_for(m),
        ) for m, c in ((rope_decode.FEW_ROWS, narrow), (rows, self.consts))]  # fmt: skip
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
        kind = ("one" if m == 1 else "few") if few else "wide" if m > self.wide_rows else "narrow" if m <= self.narrow_rows else "many"
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
