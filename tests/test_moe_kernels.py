"""The fused-MoE kernels (engine/kernels/moe_routing.py, moe_align.py, fused_moe.py) against plain
torch references: routing against softmax + a stable descending sort (ties to the lower expert
id), the sort-and-align against a loop over experts (exactly), and fused_moe against a loop over
(token, expert) pairs in fp32 on the same inputs.

CPU: the kernels under Triton's interpreter (TRITON_INTERPRET=1), in a subprocess each so that the
variable never reaches the other tests' kernels, with tiny shapes in fp32 and fp16 (about 10 s
a subprocess): both align paths, and fused_moe's sorted and unsorted (one tile a pair) paths. Not bf16 there: the interpreter truncates fp32 -> bf16 conversions and its bf16
tl.dot multiplies raw bit patterns (fused_moe works around the second, not the first). Also on
the CPU: argument checks, and that a few-token grid does not grow with the number of experts.

GPU (`pytest -m gpu`): bf16 and fp32 at T = 1, 7, 64, 513 with E = 8 / 128 and k = 2 / 8, skewed
routing with unused experts (poisoned with NaN: a kernel that read them would show it); bf16
within 1.5x the error of the model-dtype torch reference (engine/models/moe.py's rounding);
the workspace reused across T without an allocation, in CUDA graphs too; a token's output bit
for bit the same whatever the other tokens of its batch and the batch size (every config, and
the unsorted few-token path against the sorted one, whose last-arriving program sums a token's
pairs). The router's one-launch path: tests/test_moe_router.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from interpreted import interpret as run_interpreted

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


# ---- references and inputs ------------------------------------------------------------------------


def ref_route(logits: torch.Tensor, k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.sort(probs, dim=-1, descending=True, stable=True)  # ties: lower id first
    weights, ids = weights[:, :k], ids[:, :k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def ref_align(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[list[int], list[int]]:
    """(sorted pair ids with padding P, expert of each tile): experts in order, pairs in order."""
    flat = ids.flatten().long().cpu()
    slots, experts = [], []
    for e in range(num_experts):
        pairs = (flat == e).nonzero().flatten().tolist()
        if pairs:
            n = -(-len(pairs) // block_m) * block_m
            slots += pairs + [flat.numel()] * (n - len(pairs))
            experts += [e] * (n // block_m)
    return slots, experts


def ref_moe(x, w13, w2, weights, ids, model_dtype: bool = False) -> torch.Tensor:
    """fp32 math on the given inputs; model_dtype: every op in x's dtype as engine/models/moe.py
    (its rounding), the k outputs summed in fp32."""
    inter = w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    dt = x.dtype if model_dtype else torch.float32
    for e in ids.unique().tolist():
        t, j = (ids == e).nonzero(as_tuple=True)
        h = F.linear(x[t].to(dt), w13[e].to(dt))
        y = F.linear(F.silu(h[:, :inter]) * h[:, inter:], w2[e].to(dt))
        out.index_add_(0, t, weights[t, j][:, None].float() * y.float())
    return out


def skewed_logits(T: int, E: int, seed: int, device: str = "cpu") -> torch.Tensor:
    """Router logits where a few experts are popular and the last quarter is never picked."""
    g = torch.Generator(device=device).manual_seed(seed)
    logits = torch.randn(T, E, generator=g, device=device)
    logits[:, : max(1, E // 8)] += 2.0
    logits[:, E - E // 4 :] = -1e4
    return logits


def moe_inputs(T: int, E: int, H: int, inter: int, dtype: torch.dtype, seed: int, device: str = "cpu"):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(T, H, generator=g, device=device).to(dtype)
    w13 = (torch.randn(E, 2 * inter, H, generator=g, device=device) * H**-0.5).to(dtype)
    w2 = (torch.randn(E, H, inter, generator=g, device=device) * inter**-0.5).to(dtype)
    return x, w13, w2


def poison_unused(w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor) -> None:
    """NaN in every expert no token routes to: a kernel that reads one poisons the output."""
    unused = torch.ones(w13.shape[0], dtype=torch.bool, device=w13.device)
    unused[ids.flatten().long()] = False
    w13[unused] = float("nan")
    w2[unused] = float("nan")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).abs().max() / ref.abs().max()).item()


# ---- checks run by both the interpreter (CPU) and the GPU tests -------------------------------------


def check_routing(device: str, cases: list[tuple[int, int, int]]) -> None:
    from engine.kernels.moe_routing import topk_softmax

    for T, E, k in cases:
        for renorm in (True, False):
            for dtype in (torch.float32, torch.bfloat16):
                logits = skewed_logits(T, E, seed=T + E, device=device).to(dtype)
                logits[0, :3] = 10.0  # an exact three-way tie at the top (k = 2 splits it)
                w, ids = topk_softmax(logits, k, renorm)
                rw, rids = ref_route(logits, k, renorm)
                assert w.dtype == torch.float32 and ids.dtype == torch.int32 and w.shape == (T, k)
                assert torch.equal(ids.long(), rids), (T, E, k, renorm, dtype)
                torch.testing.assert_close(w, rw, rtol=2e-6, atol=1e-7)


def check_align(device: str, cases: list[tuple[int, int, int, int]], max_pairs: int) -> None:
    from engine.kernels.moe_align import AlignBuffers, moe_align

    buffers = {}
    for T, E, k, block_m in cases:
        if E not in buffers:
            buffers[E] = AlignBuffers.allocate(max_pairs, E, device)
        ids = ref_route(skewed_logits(T, E, seed=T * k, device=device), k, False)[1]
        slots, experts = ref_align(ids, E, block_m)
        # twice: fresh buffers and int32 ids, the shared ones (an earlier call's sort in them) and int64
        for b, dtype in ((None, torch.int32), (buffers[E], torch.int64)):
            sorted_ids, expert_ids, num_padded = moe_align(ids.to(dtype), E, block_m, b)
            n = num_padded.item()
            assert n == len(slots) and n <= sorted_ids.numel(), (T, E, k, block_m)
            assert sorted_ids[:n].tolist() == slots, (T, E, k, block_m)
            assert expert_ids[: n // block_m].tolist() == experts, (T, E, k, block_m)


def check_fused_moe(device: str, cases: list[tuple[int, int, int, int, int]], dtype: torch.dtype, tol: float) -> None:
    """fused_moe against the fp32 reference: rel error <= tol for fp32, and within 1.5x the
    model-dtype torch reference's (or tol) for half precision; unused experts are NaN."""
    from engine.kernels.fused_moe import fused_moe, topk_softmax

    for T, E, k, H, inter in cases:
        x, w13, w2 = moe_inputs(T, E, H, inter, dtype, seed=T + E + k, device=device)
        weights, ids = topk_softmax(skewed_logits(T, E, seed=T, device=device), k, True)
        poison_unused(w13, w2, ids)
        out = fused_moe(x, w13, w2, weights, ids)
        assert out.shape == (T, H) and out.dtype == dtype and torch.isfinite(out).all(), (T, E, k)
        ref = ref_moe(x, w13, w2, weights, ids)
        err = rel_err(out, ref)
        if dtype == torch.float32:
            assert err <= tol, (T, E, k, err)
        else:
            torch_err = rel_err(ref_moe(x, w13, w2, weights, ids, model_dtype=True).to(dtype), ref)
            assert err <= max(1.5 * torch_err, tol), (T, E, k, err, torch_err)


# ---- CPU: Triton's interpreter, one subprocess a test -----------------------------------------------

def interpret(code: str) -> None:
    run_interpreted("test_moe_kernels", code)


def test_routing_interpreted() -> None:
    interpret("check_routing('cpu', [(1, 8, 2), (37, 128, 8), (5, 60, 4), (3, 4, 4)])")


def test_align_interpreted() -> None:
    # E=128: 8 and 512 pairs in one program, 2400 in three launches; E=8: 2052 pairs in one, 8400 in three
    interpret("check_align('cpu', [(300, 128, 8, 32), (1, 128, 8, 16), (64, 128, 8, 64), (1026, 8, 2, 128), "
              "(4200, 8, 2, 64), (7, 8, 2, 16), (90, 60, 4, 16)], max_pairs=8400)")  # fmt: skip


def test_fused_moe_interpreted() -> None:
    # T=1 of E=8 and of E=128: one tile a pair, no sort (moe_tiles.pair_tiles_apply); the rest sorted
    cases = "[(1, 8, 2, 64, 32), (1, 128, 8, 32, 16), (7, 8, 2, 64, 32), (40, 16, 4, 32, 48)]"
    interpret(f"check_fused_moe('cpu', {cases}, torch.float32, 1e-5)\ncheck_fused_moe('cpu', {cases}, torch.float16, 2e-3)")


def test_a_few_tokens_grid_does_not_grow_with_the_experts() -> None:
    from engine.kernels.moe_align import max_blocks
    from engine.kernels.moe_tiles import pair_tiles_apply

    # decode at top-8 of 128: T <= 4 skips the sort (one tile a pair), T = 5 sorts
    assert pair_tiles_apply(4 * 8, 128) and not pair_tiles_apply(5 * 8, 128)
    assert pair_tiles_apply(2, 8) and not pair_tiles_apply(4, 8)  # top-2 of 8: T = 1 only

    for E in (8, 128, 512):
        assert max_blocks(1 * 8, max(E, 8), 16) == 8  # one token, top-8: one tile per touched expert
    assert max_blocks(64 * 8, 128, 16) == (512 + 128 * 15) // 16  # at most one padded tile an expert


def test_refuses_what_it_does_not_compute() -> None:
    from engine.kernels.fused_moe import MoeWorkspace, fused_moe, topk_softmax

    x, w13, w2 = moe_inputs(4, 8, 32, 16, torch.float32, seed=0)
    w, ids = torch.ones(4, 2), torch.zeros(4, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="w13"):
        fused_moe(x, w13[:, :-1], w2, w, ids)
    with pytest.raises(ValueError, match="bf16, fp16, fp32"):
        fused_moe(x.double(), w13.double(), w2.double(), w, ids)
    with pytest.raises(ValueError, match="topk_ids"):
        fused_moe(x, w13, w2, w, ids.float())
    with pytest.raises(ValueError, match="out"):
        fused_moe(x, w13, w2, w, ids, out=torch.empty(4, 31))
    ws = MoeWorkspace.allocate(2, 8, 2, 32, 16, torch.float32, "cpu")
    with pytest.raises(ValueError, match="MoeWorkspace for 2 tokens"):
        fused_moe(x, w13, w2, w, ids, workspace=ws)
    with pytest.raises(ValueError, match="k"):
        topk_softmax(torch.randn(3, 4), 5, True)


# ---- GPU ------------------------------------------------------------------------------------------

TOKENS = [1, 7, 64, 513]


@pytest.mark.gpu
@needs_cuda
def test_routing_on_the_gpu() -> None:
    check_routing("cuda", [(T, E, k) for T in TOKENS for E, k in ((8, 2), (128, 8))])


@pytest.mark.gpu
@needs_cuda
def test_align_on_the_gpu() -> None:
    cases = [(T, E, k, bm) for T in [*TOKENS, 2048] for E, k in ((8, 2), (128, 8)) for bm in (16, 64, 128)]
    check_align("cuda", cases, max_pairs=2048 * 8)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_fused_moe_on_the_gpu(dtype: torch.dtype) -> None:
    cases = [(T, E, k, 256, 128) for T in TOKENS for E, k in ((8, 2), (128, 8))]
    cases.append((64, 128, 8, 2048, 768))  # Qwen3-30B-A3B's layer
    check_fused_moe("cuda", cases, dtype, 1e-5 if dtype == torch.float32 else 2**-8)


def _setup(T: int, seed: int, E: int = 128, k: int = 8, H: int = 512, inter: int = 256):
    from engine.kernels.fused_moe import topk_softmax

    x, w13, w2 = moe_inputs(T, E, H, inter, torch.bfloat16, seed, "cuda")
    weights, ids = topk_softmax(skewed_logits(T, E, seed, "cuda"), k, True)
    return x, w13, w2, weights, ids


@pytest.mark.gpu
@needs_cuda
def test_a_tokens_output_does_not_depend_on_its_batch() -> None:
    """Rows 0..T-1 of one set of tokens, for T crossing every config (16- to 128-row tiles):
    each row's bits equal its bits in the largest batch, and in a batch shuffled around it."""
    from engine.kernels.fused_moe import fused_moe

    x, w13, w2, weights, ids = _setup(2048, seed=5)
    full = fused_moe(x, w13, w2, weights, ids)
    for T in (1, 7, 64, 200, 513, 600):
        out = fused_moe(x[:T].clone(), w13, w2, weights[:T].clone(), ids[:T].clone())
        assert torch.equal(out, full[:T]), T
    perm = torch.randperm(2048, device="cuda")
    shuffled = fused_moe(x[perm], w13, w2, weights[perm], ids[perm])
    assert torch.equal(shuffled, full[perm])


@pytest.mark.gpu
@needs_cuda
def test_the_workspace_is_shared_across_sizes_and_graphs_without_allocating() -> None:
    from engine.kernels.fused_moe import MoeWorkspace, fused_moe

    sizes = (513, 1, 64, 7)
    ws = MoeWorkspace.allocate(max(sizes), 128, 8, 512, 256, torch.bfloat16, "cuda")
    inputs = {T: _setup(T, seed=T) for T in sizes}
    outs = {T: torch.empty(T, 512, device="cuda", dtype=torch.bfloat16) for T in sizes}
    want = {T: fused_moe(*inputs[T]) for T in sizes}  # the shared workspace; compiles every config
    warm = torch.cuda.CUDAGraph()  # kept: torch's first capture of work holds 1 KiB of its own (H200)
    with torch.cuda.graph(warm):
        outs[1].add_(0)
    torch.cuda.synchronize()
    before = (torch.cuda.memory_stats()["allocation.all.allocated"], torch.cuda.memory_allocated())
    for T in sizes:
        fused_moe(*inputs[T], out=outs[T], workspace=ws)
    torch.cuda.synchronize()
    assert (torch.cuda.memory_stats()["allocation.all.allocated"], torch.cuda.memory_allocated()) == before
    for T in sizes:  # (torch.equal allocates: after the count)
        assert torch.equal(outs[T], want[T]), T
    graphs = {}
    for T in (64, 1):  # two captured sizes on one workspace
        graphs[T] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[T]):
            fused_moe(*inputs[T], out=outs[T], workspace=ws)
    assert ws.captured
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before[1], "a capture allocated"
    for T in (1, 64, 1):
        fresh = _setup(T, seed=100 + T)
        for dst, src in zip(inputs[T], fresh, strict=True):
            dst.copy_(src)
        outs[T].zero_()
        graphs[T].replay()
        assert torch.equal(outs[T], fused_moe(*fresh)), T
