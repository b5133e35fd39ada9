"""grid_phases.py's GEMV phase (the GEMMs of the persistent decode kernels, batch_kernel.py and
layer_kernel.py) over `--deterministic`'s K order: with its splits the invariant GEMM's chunks
(invariant_tiles.config, the last chunk shorter) and the partial sums added in chunk order, it
gives invariant_matmul's bits; with an item walking those chunks (a loop a chunk, or one loop:
FLAT_WALK) and the SiLU epilogue, it gives silu_and_mul after invariant_matmul, bit for bit. A test kernel runs the phase, a program an
item (no grid barrier). CPU: Triton's interpreter (tests/interpreted.py), fp16; GPU (`pytest -m
gpu`): bf16, 1 to 64 rows. And the batch decode's `--deterministic` constants
(batch_consts.kernel_consts) are those chunks; the whole path: tests/test_gpu_deterministic_decode.py.
"""

from __future__ import annotations

import pytest
import torch
from interpreted import interpret

try:  # Triton is a dependency on Linux x86-64 only (pyproject.toml)
    import triton
    import triton.language as tl

    from engine.kernels.grid_phases import gemv_phase
except ImportError:
    triton = None
else:

    @triton.jit
    def _items(x_ptr, w_ptr, out_ptr, stride_out, M, N: tl.constexpr, K: tl.constexpr, KS: tl.constexpr,
               SILU: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, P: tl.constexpr, DTYPE: tl.constexpr,
               CHUNK: tl.constexpr, WALK: tl.constexpr, FLAT_WALK: tl.constexpr):  # fmt: skip
        # gemv_phase's items, a program each: PARTIAL sums unless SILU.
        gemv_phase(x_ptr, K, w_ptr, w_ptr, out_ptr, stride_out, M, N, K, KS, not SILU, SILU, False, BM, BN, 64, P,
                   DTYPE, CHUNK=CHUNK, WALK=WALK, FLAT_WALK=FLAT_WALK)  # fmt: skip


def gemv_chunks(x: torch.Tensor, w: torch.Tensor, silu: bool, bm: int = 64, bn: int = 32, flat: bool = False) -> torch.Tensor:
    """x [M, K] @ w [N, K].T through gemv_phase in the invariant K order of w's shape: split items
    and a chunk-order sum of their fp32 partials; or (silu) items walking the chunks of a gate | up
    weight (`flat`: in one loop, FLAT_WALK, where the chunks are even), its SiLU epilogue -> [M, N / 2]."""
    from engine.kernels.invariant_tiles import chunking, config

    (m, k), n = x.shape, w.shape[0]
    chunk, chunks = chunking(k, config(n, k))
    dtype = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}[x.dtype]
    if silu:
        out = torch.empty(m, n // 2, dtype=x.dtype, device=x.device)
        items = triton.cdiv(n // 2, bn)
        _items[(items,)](x, w, out, 0, m, N=n // 2, K=k, KS=1, SILU=True, BM=bm, BN=bn, P=items, DTYPE=dtype,
                                  CHUNK=chunk, WALK=chunks, FLAT_WALK=flat)  # fmt: skip
        return out
    parts = torch.full((chunks, bm, n), float("nan"), dtype=torch.float32, device=x.device)
    items = triton.cdiv(n, bn) * chunks
    _items[(items,)](x, w, parts, bm * n, m, N=n, K=k, KS=chunks, SILU=False, BM=bm, BN=bn, P=items,
                              DTYPE=dtype, CHUNK=chunk, WALK=1, FLAT_WALK=False)  # fmt: skip
    total = parts[0, :m].clone()
    for c in range(1, chunks):
        total += parts[c, :m]
    return total.to(x.dtype)


# (N, K): K in chunks of 640 + 576 (2) and 576 + 576 + 448 (3): the last one shorter; 4 x 512 even
# (FLAT_WALK's walk).
SHAPES = [(128, 1216), (128, 1600), (128, 2048)]


def check_chunks(device: str, dtype: torch.dtype, rows: list[int]) -> None:
    from engine.kernels.fused_ops import silu_and_mul
    from engine.kernels.invariant_matmul import invariant_matmul
    from engine.kernels.invariant_tiles import chunking, config

    g = torch.Generator().manual_seed(0)
    for n, k in SHAPES:
        chunk, chunks = chunking(k, config(n, k))
        assert chunks > 1 and chunk * chunks >= k, (n, k)  # what the phase's CHUNK is for
        w = torch.randn(n, k, generator=g) * 0.02
        if chunks > 2:
            w[:, chunk : 2 * chunk] = w[:, :chunk]
        w = w.to(dtype).to(device)
        for m in rows:
            x = torch.randn(m, k, generator=g)
            if chunks > 2:  # chunk 1 cancels chunk 0 (large): the sum's order shows in the last bits
                x[:, :chunk] *= 1000
                x[:, chunk : 2 * chunk] = -x[:, :chunk]
            x = x.to(dtype).to(device)
            want = invariant_matmul(x, w)
            assert torch.equal(gemv_chunks(x, w, silu=False), want), (n, k, m)
            for flat in (False, True):
                assert torch.equal(gemv_chunks(x, w, silu=True, flat=flat), silu_and_mul(want)), (n, k, m, flat)


@pytest.mark.skipif(triton is None, reason="needs Triton")
def test_gemv_phase_in_the_invariant_k_order_interpreted() -> None:
    interpret("test_grid_phases", "check_chunks('cpu', torch.float16, [1, 5, 16])", timeout=600)


@pytest.mark.gpu
def test_gemv_phase_in_the_invariant_k_order_on_the_gpu() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    check_chunks("cuda", torch.bfloat16, [1, 5, 16, 17, 40, 64])


@pytest.mark.skipif(triton is None, reason="needs Triton")
def test_the_invariant_batch_decode_takes_each_weights_chunks() -> None:
    """batch_consts.kernel_consts(invariant=True), Qwen3-0.6B's layer: each GEMV phase's splits
    (or the gate_up items' walk) are its weight's invariant chunks, its items one wave wide."""
    from engine.decode.batch_consts import invariant_chunks, kernel_consts
    from engine.decode.rules import LayerShape
    from engine.kernels.invariant_tiles import chunking, config

    shape = LayerShape(hidden=1024, inter=3072, nh=16, nkv=8, d=128, eps=1e-6, qk_norm=True, device=torch.device("cpu"),
                       dtype=torch.bfloat16)  # fmt: skip
    c = kernel_consts(shape, 132, 64, use_pdl=False, invariant=True)
    weights = {"O": (1024, 2048), "D": (1024, 3072), "Q": (4096, 1024)}  # [N, K]: o_proj, down_proj, qkv_proj
    for phase, (n, k) in weights.items():
        chunk, chunks = chunking(k, config(n, k))
        assert (c[f"KS_{phase}"], c[f"CK_{phase}"]) == (chunks, chunk), phase
    chunk, chunks = chunking(1024, config(6144, 1024))  # gate | up
    assert (c["WALK_G"], c["CK_G"]) == (chunks, chunk) == (2, 512)
    assert c["INVARIANT"] and not c["USE_PDL"]
    # the L2 prefetch covers the first weights of an item's chunk, as the default's of its split
    assert (c["G_PRE"], c["D_PRE"], c["Q_PRE"]) == (256, 512, 256)
    # down (6 chunks) and qkv (2 chunks) in items of 64 columns: one wave of 132 programs, not two
    assert (c["BN"], c["BN_D"], c["BN_Q"]) == (32, 64, 64)
    assert 1024 // 32 * c["KS_O"] <= 132 and 1024 // 64 * c["KS_D"] <= 132 and 4096 // 64 * c["KS_Q"] <= 132
    assert "INVARIANT" not in kernel_consts(shape, 132, 64, use_pdl=True)  # the default's constants as they were
    # any K step dividing the chunks (BLOCK_K is not in the bits), none that does not
    assert invariant_chunks(1024, 2048, bk=128) == (4, 512)
    with pytest.raises(ValueError, match="does not divide"):
        invariant_chunks(1024, 2048, bk=1024)
    # steps of few rows: 16-row tiles, and the fixed-split attention in the launch at the cache's blocks
    few = kernel_consts(shape, 132, 64, use_pdl=True, invariant=True, bm=16, bk=128, stages=5, attend_block=16)
    assert few["ATTEND"] and (few["BM"], few["BK"], few["MAX_M"], few["BLOCK_SIZE"]) == (16, 128, 64, 16)
    assert (few["GROUP"], few["BLOCK_H"], few["SPLIT_"], few["BLOCK_N_"]) == (2, 16, 128, 64)
    assert {k: few[k] for k in ("KS_O", "CK_O", "KS_D", "CK_D", "WALK_G")} == {k: c[k] for k in ("KS_O", "CK_O", "KS_D", "CK_D", "WALK_G")}
