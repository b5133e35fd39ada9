"""The few-token router of engine/kernels/moe_router.py (its GEMV and top-k in one launch): on the
CPU, under Triton's interpreter, at one K split and at several, its top-k equals the reference's
on the logits it computed, and those are the fp32 GEMV's rounded; on the GPU, at one split, its
logits equal the router Linear's skinny GEMV's bit for bit, and at every split its ids are
`topk_softmax`'s of its logits and its weights within 1e-6 of them (a row's softmax sum reduces
in its own order), the same bits eagerly and in a CUDA graph; every arrival counter (the router's and the down GEMM's, fused_moe.py) is zero after
each call.
"""

from __future__ import annotations

import pytest
import torch
from test_moe_kernels import interpret, needs_cuda, ref_route


def check_router(device: str, cases: list[tuple[int, int, int, int]], dtype: torch.dtype, warps: int | None = None) -> None:
    """router_topk (at `warps` warps a program; None: its default): the logits it kept in the
    workspace are x @ gate.T rounded (fp32 sums), its weights and ids the reference top-k of those
    logits; the counter is zero after each call. `splits(H)` is more than one at some case's H
    (else the cases test one path)."""
    from engine.kernels.moe_router import router_topk, splits
    from engine.kernels.moe_workspace import MoeWorkspace

    assert max(splits(H) for *_, H in cases) > 1 and min(splits(H) for *_, H in cases) == 1
    for T, E, k, H in cases:
        g = torch.Generator(device=device).manual_seed(T * E + k)
        x = torch.randn(T, H, generator=g, device=device).to(dtype)
        gate = (torch.randn(E, H, generator=g, device=device) * H**-0.5).to(dtype)
        ws = MoeWorkspace.allocate(T, E, k, H, 32, dtype, device)
        for renorm in (True, False):
            weights, ids = router_topk(x, gate, k, renorm, ws, warps=warps)
            logits = ws.router_logits[:T]
            torch.testing.assert_close(logits.float(), (x.float() @ gate.float().T).to(dtype).float(), rtol=1e-2, atol=1e-2)
            rw, rids = ref_route(logits, k, renorm)
            assert torch.equal(ids.long(), rids), (T, E, k, renorm)
            torch.testing.assert_close(weights, rw, rtol=2e-6, atol=1e-7)
            assert ws.router_count.item() == 0


def test_router_interpreted() -> None:
    interpret("from test_moe_router import check_router\n"
              "check_router('cpu', [(1, 128, 8, 512), (4, 60, 4, 200), (16, 8, 2, 256)], torch.float16)")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("warps", [1, 4])
def test_the_router_in_one_launch_is_the_gemv_then_topk(warps: int) -> None:
    """router_topk at one K split: the router Linear's own decode GEMV (skinny_linear) bit for
    bit; at every split its ids are topk_softmax's of the logits it kept and its weights within
    1e-6 of them; the same bits eagerly and replayed from a graph; counters back at zero. At
    `warps` warps a program (moe_router.WARPS is one of them)."""
    from engine.kernels.fused_moe import fused_moe, topk_softmax
    from engine.kernels.moe_router import router_topk
    from engine.kernels.moe_workspace import MoeWorkspace
    from engine.kernels.skinny_linear import skinny_linear

    def like_topk_softmax(got: tuple[torch.Tensor, torch.Tensor], T: int) -> None:
        want = topk_softmax(ws.router_logits[:T], 8, True)
        assert torch.equal(got[1], want[1]), T
        torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-7)

    check_router("cuda", [(1, 128, 8, 2048), (4, 128, 8, 2048), (3, 60, 4, 1000)], torch.bfloat16, warps)
    ws = MoeWorkspace.allocate(4, 128, 8, 2048, 768, torch.bfloat16, "cuda")
    for T in (1, 2, 4):
        g = torch.Generator(device="cuda").manual_seed(T)
        x = torch.randn(T, 2048, generator=g, device="cuda").to(torch.bfloat16)
        gate = (torch.randn(128, 2048, generator=g, device="cuda") * 2048**-0.5).to(torch.bfloat16)
        out = (torch.empty(T, 8, device="cuda"), torch.empty(T, 8, dtype=torch.int32, device="cuda"))
        got = router_topk(x, gate, 8, True, ws, out=out, split=1, warps=warps)
        assert torch.equal(ws.router_logits[:T], skinny_linear(x, gate)), T
        like_topk_softmax(got, T)
        router_topk(x, gate, 8, True, ws, out=out, warps=warps)  # the default splits' kernel compiled outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            router_topk(x, gate, 8, True, ws, out=out, warps=warps)
        for seed in range(3):
            x.copy_(torch.randn(T, 2048, device="cuda").to(torch.bfloat16))
            graph.replay()
            replayed = (out[0].clone(), out[1].clone())
            like_topk_softmax(replayed, T)
            eager = router_topk(x, gate, 8, True, ws, warps=warps)
            assert torch.equal(replayed[0], eager[0]) and torch.equal(replayed[1], eager[1]), (T, seed)
        w13 = (torch.randn(128, 2 * 768, 2048, device="cuda") * 2048**-0.5).to(torch.bfloat16)
        w2 = (torch.randn(128, 2048, 768, device="cuda") * 768**-0.5).to(torch.bfloat16)
        fused_moe(x, w13, w2, *out, workspace=ws)  # one tile a pair: the down GEMM sums
        torch.cuda.synchronize()
        assert ws.router_count.item() == 0 and int(ws.sum_counts.abs().sum()) == 0, T


@pytest.mark.gpu
@needs_cuda
def test_a_prefetching_router_after_the_norm_gives_the_plain_launch_outputs() -> None:
    """router_topk(prefetch=True), launched with PDL right after the norm that writes its x (as
    in a MoE layer: the post-attention norm, then the router), gives the plain launch's weights
    and ids, eagerly and replayed from a graph; its counter back at zero."""
    from engine.kernels import fused_ops
    from engine.kernels.moe_router import router_topk
    from engine.kernels.moe_workspace import MoeWorkspace

    ws = MoeWorkspace.allocate(4, 128, 8, 2048, 768, torch.bfloat16, "cuda")
    g = torch.Generator(device="cuda").manual_seed(7)
    gate = (torch.randn(128, 2048, generator=g, device="cuda") * 2048**-0.5).to(torch.bfloat16)
    norm_w = torch.randn(2048, generator=g, device="cuda").to(torch.bfloat16)
    for T in (1, 2, 4):
        h = torch.randn(T, 2048, generator=g, device="cuda").to(torch.bfloat16)
        plain = router_topk(fused_ops.rms_norm(h, norm_w, 1e-6), gate, 8, True, ws)
        got = router_topk(fused_ops.rms_norm(h, norm_w, 1e-6), gate, 8, True, ws, prefetch=True)
        assert torch.equal(got[0], plain[0]) and torch.equal(got[1], plain[1]), T
        out = (torch.empty(T, 8, device="cuda"), torch.empty(T, 8, dtype=torch.int32, device="cuda"))
        graph = torch.cuda.CUDAGraph()  # both kernels compiled above, outside the capture
        with torch.cuda.graph(graph):
            router_topk(fused_ops.rms_norm(h, norm_w, 1e-6), gate, 8, True, ws, out=out, prefetch=True)
        for step in range(3):
            h.copy_(torch.randn(T, 2048, generator=g, device="cuda").to(torch.bfloat16))
            out[0].fill_(float("nan"))
            graph.replay()
            want = router_topk(fused_ops.rms_norm(h, norm_w, 1e-6), gate, 8, True, ws)
            assert torch.equal(out[0], want[0]) and torch.equal(out[1], want[1]), (T, step)
        torch.cuda.synchronize()
        assert ws.router_count.item() == 0, T
