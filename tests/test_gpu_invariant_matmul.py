"""engine/kernels/invariant_matmul.py on a GPU (`pytest -m gpu` on the device machine):
- a fixed row placed at random positions (and last) among random companions of another scale,
  in batches of 1 to 2100 rows (16-, 64-, 128- and 256-row tiles), gets bit for bit the output it
  gets alone, at the Qwen3-8B linear shapes (qkv, gate_up, down, lm_head), the 0.6B's o_proj and
  down, and small ones whose N and K no tile divides; a batch that is a slice of a larger one
  (rows, or the first K columns) too;
- TMA descriptor loads (the default on Hopper) give the pointer loads' bits at every shape and
  batch above;
- a one-chunk weight's K step follows the rows (256, 128, 64 for the 8B's): a row's bits do not;
- the output equals F.linear in fp32 on the same bf16 inputs within bf16 rounding;
- a launch into a preallocated `out` captures in a CUDA graph and replays to the eager bits, new
  inputs included;
- `prefetch=True` (PDL launch, the weight's first lines into L2, then the wait) right after the
  RMSNorm that writes its input gives the plain launch's bits, eagerly and in a graph's replays;
- K split into chunks (the 0.6B's o_proj and down): few rows run a program per chunk and a chunk-
  order sum (a second kernel's, or with `Arrivals` the tile's last chunk to arrive), many rows
  one program per tile walking the chunks; all give a row the same bits (the batches above cross
  from one to the other, with and without `Arrivals`), in a CUDA graph's replays too.
GPU only: every test skips without CUDA.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# (K, N): Qwen3-8B's qkv, gate_up, down and lm_head (one chunk each, BLOCK_K 256, 128 and 64 as
# the rows grow), Qwen3-0.6B's o_proj and down (4 and 6 chunks), then shapes no tile divides
# (K < BLOCK_K too).
SHAPES = [(4096, 6144), (4096, 24576), (12288, 4096), (4096, 151936), (2048, 1024), (3072, 1024), (1024, 1000), (200, 100),
          (48, 10), (64, 32)]  # fmt: skip
ROWS = [1, 2, 3, 16, 17, 64, 100, 256, 1000, 1100, 2100]  # across FEW_ROWS, MANY_ROWS and the 128 x 256 tiles


def _bf16(*shape: int, g: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device="cuda", generator=g) * scale).to(torch.bfloat16)


@contextlib.contextmanager
def _no_tf32() -> Iterator[None]:
    """The fp32 reference in IEEE fp32 whatever another test set."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def _close_to_fp32(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    with _no_tf32():
        ref = F.linear(x.float(), w.float())
    # bf16 rounds to 2^-9 relative; the fp32 sums' order adds ~1e-6 of the largest value
    torch.testing.assert_close(y.float(), ref, rtol=1e-2, atol=1e-3 * ref.abs().max().item())


@pytest.mark.parametrize("k,n", SHAPES, ids=[f"K{k}-N{n}" for k, n in SHAPES])
def test_a_row_has_its_bits_alone_in_every_batch(k: int, n: int) -> None:
    from engine.kernels.invariant_matmul import Arrivals, invariant_matmul

    arrivals = Arrivals(torch.device("cuda"))

    g = torch.Generator(device="cuda").manual_seed(k * 100003 + n)
    w = _bf16(n, k, g=g, scale=0.02)
    x0 = _bf16(k, g=g)
    alone = invariant_matmul(x0[None], w)
    assert alone.shape == (1, n) and alone.dtype == torch.bfloat16
    for m in ROWS:
        x = _bf16(m, k, g=g, scale=4.0)  # companions of another scale: any leak would show
        pos = int(torch.randint(m, (1,), device="cuda", generator=g).item())
        x[pos] = x0
        x[m - 1] = x0  # the last row: in a partial row tile unless BLOCK_M divides m
        y = invariant_matmul(x, w)
        assert torch.equal(y[pos], alone[0]) and torch.equal(y[m - 1], alone[0]), (m, pos)
        assert torch.equal(invariant_matmul(x, w, arrivals=arrivals), y), m
        assert not arrivals.counts.any(), m
        _close_to_fp32(y, x, w)
    # A batch that is a slice of a larger one: rows 3.. of it, or its first K columns.
    big = _bf16(300, k + 64, g=g)
    big[7, :k] = x0
    assert torch.equal(invariant_matmul(big[3:, :k], w)[4], alone[0])
    rows = big[:, :k].contiguous()
    assert torch.equal(invariant_matmul(rows[3:], w)[4], alone[0])


@pytest.mark.parametrize("k,n", SHAPES, ids=[f"K{k}-N{n}" for k, n in SHAPES])
def test_tma_loads_give_the_pointer_loads_bits(k: int, n: int) -> None:
    from engine.kernels.invariant_matmul import Arrivals, invariant_matmul, tma_loads

    arrivals = Arrivals(torch.device("cuda"))
    g = torch.Generator(device="cuda").manual_seed(k * 7 + n)
    w = _bf16(n, k, g=g, scale=0.02)
    for m in ROWS:
        x = _bf16(m, k, g=g)
        assert tma_loads(x, w), (k, n)
        for a in (None, arrivals):
            assert torch.equal(invariant_matmul(x, w, arrivals=a, tma=True), invariant_matmul(x, w, arrivals=a, tma=False)), (m, a)


@pytest.mark.parametrize("with_arrivals", [False, True])
def test_a_preallocated_out_captures_and_replays_to_the_eager_bits(with_arrivals: bool) -> None:
    from engine.kernels.invariant_matmul import Arrivals, invariant_matmul

    g = torch.Generator(device="cuda").manual_seed(5)
    k, n, m = 1024, 4096, 37  # 64 column tiles, K in 2 chunks: the split path
    w, x = _bf16(n, k, g=g, scale=0.02), _bf16(m, k, g=g)
    out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    arrivals = Arrivals(torch.device("cuda")) if with_arrivals else None
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compiled outside the capture
        invariant_matmul(x, w, out=out, arrivals=arrivals)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        assert invariant_matmul(x, w, out=out, arrivals=arrivals) is out
    for step in range(3):
        if step:
            x.copy_(_bf16(m, k, g=g))  # the graph's static input, new values
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, invariant_matmul(x, w)), step
        assert torch.equal(out[m // 2], invariant_matmul(x[m // 2 : m // 2 + 1], w)[0]), step
    _close_to_fp32(out, x, w)


@pytest.mark.parametrize("k,n", SHAPES[:4], ids=[f"K{k}-N{n}" for k, n in SHAPES[:4]])
def test_a_prefetching_launch_after_the_norm_gives_the_plain_launch_bits(k: int, n: int) -> None:
    from engine.kernels import fused_ops
    from engine.kernels.invariant_matmul import Arrivals, invariant_matmul

    arrivals = Arrivals(torch.device("cuda"))
    g = torch.Generator(device="cuda").manual_seed(k + 3 * n)
    w, norm_w = _bf16(n, k, g=g, scale=0.02), _bf16(k, g=g)
    for m in (1, 16, 17, 64, 256, 1000):
        x = _bf16(m, k, g=g)
        plain = invariant_matmul(fused_ops.rms_norm(x, norm_w, 1e-6), w, arrivals=arrivals)
        out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
        # The norm writes what the GEMM reads, launched right after it: the GEMM's wait orders them.
        assert torch.equal(invariant_matmul(fused_ops.rms_norm(x, norm_w, 1e-6), w, out=out, arrivals=arrivals, prefetch=True), plain), m
        if m > 64:
            continue
        graph = torch.cuda.CUDAGraph()  # both kernels compiled above, outside the capture
        with torch.cuda.graph(graph):
            invariant_matmul(fused_ops.rms_norm(x, norm_w, 1e-6), w, out=out, arrivals=arrivals, prefetch=True)
        for step in range(3):
            x.copy_(_bf16(m, k, g=g))
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, invariant_matmul(fused_ops.rms_norm(x, norm_w, 1e-6), w, arrivals=arrivals)), (m, step)


def test_the_06b_shapes_split_k_and_the_rows_choose_where_the_chunks_run() -> None:
    from engine.kernels.invariant_matmul import SPLIT_BELOW_TILES
    from engine.kernels.invariant_tiles import chunking, config

    for n, k in ((1024, 2048), (1024, 3072)):  # the 0.6B's o_proj and down
        c = config(n, k)
        chunk_k, chunks = chunking(k, c)
        assert chunks > 1 and chunk_k % c.block_k == 0 and (chunks - 1) * chunk_k < k
        tiles_n = -(-n // c.block_n)
        assert tiles_n < SPLIT_BELOW_TILES <= -(-max(ROWS) // c.block_m) * tiles_n, "ROWS must cross from split programs to one per tile"


def test_bad_arguments_are_refused_and_empty_batches_return() -> None:
    from engine.kernels.invariant_matmul import invariant_matmul

    g = torch.Generator(device="cuda").manual_seed(6)
    w, x = _bf16(64, 128, g=g), _bf16(4, 128, g=g)
    for args in ((x.float(), w.float()), (x, w[:, :64]), (x, w.t().contiguous().t()), (x.cpu(), w.cpu())):
        with pytest.raises(ValueError, match="invariant_matmul"):
            invariant_matmul(*args)
    with pytest.raises(ValueError, match="out"):
        invariant_matmul(x, w, out=torch.empty(4, 65, dtype=torch.bfloat16, device="cuda"))
    assert invariant_matmul(x[:0], w).shape == (0, 64)
