"""engine/kernels/batch_kernel.py under Triton's interpreter (tests/interpreted.py), fp16, one
program (a grid of one needs no barrier; its norm phases then take one row, so a step of one row).

The default kernel: a middle launch against the layer in fp32, up to its roundings, with GEMV
items 32 and 64 columns wide (the K splits of a 132-SM part). The GPU's: tests/test_gpu_batch_decode.py.

Its `--deterministic` variant (INVARIANT): a launch's outputs against the mode's unfused
ops on the same inputs (invariant_matmul, fused_add_rms_norm, silu_and_mul, rotary), bit for bit, for the
three launches a step makes: HEAD (the embedding rows, layer 0's norm and qkv), a middle one
(layer l's o_proj and MLP, layer l+1's norm and qkv) and TAIL (the last layer's, the final norm);
the qkv's q and k normed and rotated and the new K/V rows in the cache as rope.rotary leaves them.
The weights' K in 2 and 4 chunks. ATTEND (steps of few rows, GEMV tiles of 16 rows, the norms
EVERYWHERE as at one row): the same, and the fixed-split attention's output on that q
(attention_fixed.py, its two paths) over a context of two pieces, the items' slots 3. The GPU's
bits, through the engine's layers: tests/test_gpu_deterministic_decode.py.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from interpreted import interpret

HID, INTER, NH, NKV, D, M, ROWS, VOCAB, EPS = 1024, 2048, 8, 4, 128, 1, 64, 50, 1e-6
BLOCKS, BLOCK_SIZE, MAX_POS, CONTEXT = 16, 16, 256, 200
QKV = (NH + 2 * NKV) * D


def randoms(g: torch.Generator, dt: torch.dtype, device: str) -> Callable[..., torch.Tensor]:
    """rand(*shape, scale=1.0): normal values from `g`, times scale, in dt on device."""

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(dt).to(device)

    return rand


def layer_weights(rand: Callable[..., torch.Tensor]) -> dict[str, torch.Tensor]:
    """A layer's weights as the kernel takes them, o_proj to the next layer's qkv."""
    return dict(o=rand(HID, NH * D, scale=0.03), post=rand(HID, scale=0.5) + 1, gate_up=rand(2 * INTER, HID, scale=0.03),
                down=rand(HID, INTER, scale=0.03), norm=rand(HID, scale=0.5) + 1, qkv=rand(QKV, HID, scale=0.03))  # fmt: skip


def check_invariant_launches(device: str, attend: bool, rope_later: bool = False, rope_items: bool = True) -> None:
    from engine.decode.batch_consts import FEW_BM, kernel_consts
    from engine.decode.rules import LayerShape
    from engine.kernels.attention import LOG2E
    from engine.kernels.attention_fixed import Workspace, fixed_split_attention
    from engine.kernels.batch_kernel import batch_layer_kernel
    from engine.kernels.fused_ops import fused_add_rms_norm, rms_norm, silu_and_mul
    from engine.kernels.invariant_matmul import invariant_matmul as mm
    from engine.kernels.rope import rotary

    g = torch.Generator().manual_seed(0)
    dt = torch.float16
    rand = randoms(g, dt, device)
    w = layer_weights(rand)
    emb, ids = rand(VOCAB, HID), torch.randint(0, VOCAB, (M,), generator=g).to(device)
    attn, h0 = rand(M, NH * D), rand(M, HID)
    qw, kw = rand(D, scale=0.5) + 1, rand(D, scale=0.5) + 1
    cos_sin = torch.randn(MAX_POS, D, generator=g).to(device)
    # the row's new token is the last of its context, its slot where the block table puts it
    positions = torch.full((M,), CONTEXT - 1).to(device)
    tables = torch.randperm(BLOCKS, generator=g).to(torch.int32).view(M, BLOCKS).to(device)
    slots = (tables[0, (CONTEXT - 1) // BLOCK_SIZE] * BLOCK_SIZE + (CONTEXT - 1) % BLOCK_SIZE).view(M).long()
    seq_lens, qsl = torch.full((M,), CONTEXT, dtype=torch.int32).to(device), torch.arange(M + 1, dtype=torch.int32).to(device)
    cache0 = rand(2, BLOCKS, BLOCK_SIZE, NKV, D)
    scale = D**-0.5

    def rotated(qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(qkv, cache) as the mode's rotary leaves them: q, k normed and rotated, K/V stored."""
        qkv, cache = qkv.clone(), cache0.clone()
        q, k, v = qkv.split([NH * D, NKV * D, NKV * D], dim=-1)
        rotary(q.view(M, NH, D), k.view(M, NKV, D), positions, cos_sin, qw, kw, EPS, kv_store=(v.view(M, NKV, D), cache[0], cache[1], slots))
        return qkv, cache
    shape = LayerShape(hidden=HID, inter=INTER, nh=NH, nkv=NKV, d=D, eps=EPS, qk_norm=True, device=torch.device(device), dtype=dt)
    # no L2 prefetch (inline PTX, which the interpreter cannot run; scheduling only, not the bits)
    # bk 64 as the GEMM's: the interpreter's dots are numpy's, whose sums follow BLOCK_K (a GPU's do
    # not: invariant_tiles.py)
    consts = kernel_consts(shape, 1, ROWS, use_pdl=False, g_pre=0, d_pre=0, q_pre=0, invariant=True, rope_later=rope_later,
                           **(dict(bm=FEW_BM, attend_block=BLOCK_SIZE, everywhere_rows=1, rope_items=rope_items) if attend else {}))  # fmt: skip
    assert consts["KS_O"] == consts["KS_Q"] == consts["WALK_G"] == 2 and consts["KS_D"] == 4
    assert consts.get("ATTEND", False) == consts["EVERYWHERE"] == attend
    assert consts.get("ROPE_ITEMS", False) == (attend and rope_items)
    scratch_qkv = attend and rope_items  # qkv: the items' own rows (q shows in attn, K/V in the cache)

    def attended(qkv: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        """The mode's attention on qkv's q over the cache, by the split path (as the kernel's items)
        and by the one-program path: the same bits."""
        q = qkv[:, : NH * D].reshape(M, NH, D)
        ws = Workspace.allocate(NH, D, MAX_POS, torch.device(device))
        outs = [fixed_split_attention(q, cache[0], cache[1], tables, seq_lens, qsl, torch.empty_like(q), scale, M, w)
                for w in (ws, None)]  # fmt: skip
        assert ws.m.shape[1] == 2 and torch.equal(outs[0], outs[1])
        return outs[0].view(M, NH * D)

    def launch(head: bool, tail: bool) -> dict[str, torch.Tensor]:
        f32 = dict(dtype=torch.float32, device=device)
        b = dict(h=torch.zeros(ROWS, HID, dtype=dt, device=device), h_mid=torch.zeros(ROWS, HID, dtype=dt, device=device),
                 xn=torch.zeros(ROWS, HID, dtype=dt, device=device), out=torch.zeros(M, HID, dtype=dt, device=device),
                 qkv=torch.zeros(ROWS, QKV, dtype=dt, device=device), cache=cache0.clone())  # fmt: skip
        b["h"][:M] = h0
        act = torch.zeros(ROWS, INTER, dtype=dt, device=device)
        parts = [torch.zeros(consts[k], ROWS, n, **f32) for k, n in (("KS_O", HID), ("KS_D", HID), ("KS_Q", QKV))]
        bar = torch.zeros(1, dtype=torch.int32, device=device)
        b["attn"] = attn.clone()  # o_proj's input; ATTEND: the next layer's attention output
        ws = Workspace.allocate(NH, D, MAX_POS, torch.device(device))
        batch_layer_kernel[(1,)](
            emb, ids, b["attn"], b["h"], b["h_mid"], w["o"], w["post"], w["gate_up"], w["down"], w["norm"], w["qkv"],
            b["xn"], b["out"] if tail else b["xn"], act, *parts, b["qkv"], positions, cos_sin, qw, kw, b["cache"][0], b["cache"][1],
            slots, cos_sin.stride(0), b["cache"].stride(2), b["cache"].stride(3), EPS,
            tables, seq_lens, ws.m, ws.total, ws.acc, ws.counts, tables.stride(0), b["cache"].stride(1), scale * LOG2E,
            ws.m.shape[1], 3, bar, bar, M, EPS, HEAD=head, TAIL=tail, TIMING=False, **consts,
        )  # fmt: skip
        assert not ws.counts.any()  # the last item of each (row, KV head) zeroed its counter
        if rope_later and not tail:  # no last phase: qkv is its partials, summed in chunk order, for the attention to rotate
            assert not b["qkv"].any() and torch.equal(b["cache"], cache0)
            b["qkv"], b["cache"] = rotated((parts[2][0] + parts[2][1])[:M].to(dt))
        return {k: v if k == "cache" else v[:M] for k, v in b.items()}

    # HEAD: h = the embedding rows, xn = layer 0's norm of them, qkv = its qkv
    got = launch(head=True, tail=False)
    h = emb[ids]
    xn = rms_norm(h, w["norm"], EPS)
    assert torch.equal(got["h"], h) and torch.equal(got["xn"], xn)
    qkv, cache = rotated(mm(xn, w["qkv"]))
    assert torch.equal(got["cache"], cache) and (scratch_qkv or torch.equal(got["qkv"], qkv))
    assert not torch.equal(cache, cache0)
    assert torch.equal(got["attn"], attended(qkv, cache) if attend else attn)
    # a middle launch: layer l's o_proj, norm, MLP, norm of layer l+1, its qkv
    got = launch(head=False, tail=False)
    xn, h_mid = fused_add_rms_norm(mm(attn, w["o"]), h0.clone(), w["post"], EPS)
    down = mm(silu_and_mul(mm(xn, w["gate_up"])), w["down"])
    xn, h = fused_add_rms_norm(down, h_mid.clone(), w["norm"], EPS)
    assert torch.equal(got["h_mid"], h_mid) and torch.equal(got["h"], h) and torch.equal(got["xn"], xn)
    qkv, cache = rotated(mm(xn, w["qkv"]))
    assert torch.equal(got["cache"], cache) and (scratch_qkv or torch.equal(got["qkv"], qkv))
    assert torch.equal(got["attn"], attended(qkv, cache) if attend else attn)
    # TAIL: the same through the final norm (`norm` its weight), into out; no qkv
    got = launch(head=False, tail=True)
    assert torch.equal(got["out"], xn) and torch.equal(got["h"], h)
    assert not got["qkv"].any() and torch.equal(got["cache"], cache0) and torch.equal(got["attn"], attn)


def check_default_launch(device: str, bn: int) -> None:
    """The default kernel's middle launch (layer l's o_proj and MLP, layer l+1's norm and qkv
    partials) against the same layer in fp32, up to its fp16 roundings: GEMV items of `bn` columns,
    K split as on a 132-SM part (32: 4 / 4 / 2 splits; 64, the steps of few rows: 8 / 8 / 4), dealt
    to one program."""
    from engine.decode.batch_consts import kernel_consts
    from engine.decode.rules import LayerShape
    from engine.kernels.batch_kernel import batch_layer_kernel

    dt = torch.float16
    rand = randoms(torch.Generator().manual_seed(1), dt, device)
    w = layer_weights(rand)
    rows = 1  # one program runs the norms of one row (program P - 1 - r: row r)
    attn, h0 = rand(rows, NH * D), rand(rows, HID)
    shape = LayerShape(hidden=HID, inter=INTER, nh=NH, nkv=NKV, d=D, eps=EPS, qk_norm=True, device=torch.device(device), dtype=dt)
    consts = kernel_consts(shape, 132, ROWS, use_pdl=False, g_pre=0, d_pre=0, q_pre=0, bn=bn)
    assert [consts[k] for k in ("KS_O", "KS_D", "KS_Q")] == ([4, 4, 2] if bn == 32 else [8, 8, 4])
    consts.update(P=1, FIRST_ADD=2**31)  # every item on one program: no barrier waits on another
    f32 = dict(dtype=torch.float32, device=device)
    h, h_mid, xn = (torch.zeros(ROWS, HID, dtype=dt, device=device) for _ in range(3))
    h[:rows] = h0
    act = torch.zeros(ROWS, INTER, dtype=dt, device=device)
    parts = [torch.zeros(consts[k], ROWS, n, **f32) for k, n in (("KS_O", HID), ("KS_D", HID), ("KS_Q", QKV))]
    bar = torch.zeros(1, dtype=torch.int32, device=device)
    batch_layer_kernel[(1,)](
        attn, attn, attn, h, h_mid, w["o"], w["post"], w["gate_up"], w["down"], w["norm"], w["qkv"], xn, xn, act, *parts,
        parts[2], *(bar,) * 7, 0, 0, 0, 0.0, *(bar,) * 6, 0, 0, 0.0, 0, 1, bar, bar, rows, EPS,
        HEAD=False, TAIL=False, TIMING=False, **consts,
    )  # fmt: skip

    def norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight.float()

    f = {k: v.float() for k, v in w.items()}
    want_mid = h0.float() + attn.float() @ f["o"].T
    want_xn = norm(want_mid, f["post"])
    gate, up = (want_xn @ f["gate_up"].T).split(INTER, dim=-1)
    want_h = want_mid + (torch.nn.functional.silu(gate) * up) @ f["down"].T
    want_qkv = norm(want_h, f["norm"]) @ f["qkv"].T
    for got, want in ((h_mid[:rows], want_mid), (h[:rows], want_h), (xn[:rows], norm(want_h, f["norm"])),
                      (parts[2][:, :rows].sum(0), want_qkv)):  # fmt: skip
        torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
    assert not h[rows:].any() and not parts[2][:, rows:].any()  # rows past the step untouched


@pytest.mark.parametrize("bn", [32, 64])
def test_the_default_batch_kernel_gives_the_layer_interpreted(bn: int) -> None:
    """GEMV items of 32 columns (steps of more than 8 rows) and of 64 (steps of at most 8,
    batch_consts.GEMV_BN_FEW) give the layer's values."""
    interpret("test_batch_kernel", f"check_default_launch('cpu', {bn})", timeout=900)


@pytest.mark.parametrize("attend, rope_later, rope_items", [(False, False, False), (True, False, True), (True, False, False),
                                                            (False, True, False)])  # fmt: skip
def test_the_invariant_batch_kernel_gives_the_unfused_bits_interpreted(attend: bool, rope_later: bool, rope_items: bool) -> None:
    """ROPE_LATER: the launch leaves qkv as its partials, whose chunk sum is the GEMM's. ROPE_ITEMS:
    the attention's items rotate qkv (3 slots of a (row, KV head) over 2 pieces: two store, one does not)."""
    interpret("test_batch_kernel", f"check_invariant_launches('cpu', {attend}, {rope_later}, {rope_items})", timeout=900)
