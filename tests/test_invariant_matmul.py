"""engine/kernels/invariant_matmul.py under Triton's interpreter (tests/interpreted.py), fp16:
the split path (fewer output tiles than SPLIT_BELOW_TILES, K in chunks) with `Arrivals`, where
a tile's last chunk to arrive sums the chunks, gives the bits of the two-launch path (a second
kernel sums them) and of the same row alone, and leaves every counter at zero for the next call;
the counters' zeroing after a resume; a program that walks every chunk of its tile (many
tiles), in one loop or a pipeline a chunk, gives the split path's bits, K a whole number of steps
or not, also where the rule would split (`split_below`, the bench's override); TMA descriptor
loads give the pointer loads' bits on every path, and a tensor the copy engine cannot take
(unaligned) loads through pointers; the tile follows the rows, K's order never. The GPU's bits: tests/test_gpu_invariant_matmul.py.
"""

from __future__ import annotations

import pytest
import torch
from interpreted import interpret


def check_last_sums(device: str) -> None:
    from engine.kernels.invariant_matmul import SPLIT_BELOW_TILES, Arrivals, invariant_matmul
    from engine.kernels.invariant_tiles import chunking, config

    n, k = 256, 2048  # 4 column tiles of 64, K in 4 chunks: the split path at a few rows
    c = config(n, k)
    assert chunking(k, c)[1] > 1 and -(-n // c.block_n) < SPLIT_BELOW_TILES
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(n, k, generator=g) * 0.02).half().to(device)
    x = torch.randn(5, k, generator=g).half().to(device)
    arrivals = Arrivals(torch.device(device))
    two_launches = invariant_matmul(x, w)
    for _ in range(2):  # the counters are zero again after each call
        got = torch.full_like(two_launches, float("nan"))
        invariant_matmul(x, w, out=got, arrivals=arrivals)
        assert torch.equal(got, two_launches)
        assert not arrivals.counts.any()
    assert torch.equal(invariant_matmul(x[3:4], w, arrivals=arrivals)[0], got[3])
    ref = x.float() @ w.float().T
    assert (got.float() - ref).abs().max().item() < 2e-2 * ref.abs().max().item()
    arrivals.counts.fill_(7)  # what a resume may hand back
    arrivals.after_resume()
    assert torch.equal(invariant_matmul(x, w, arrivals=arrivals), two_launches)


def test_the_last_chunk_sums_the_split_path_interpreted() -> None:
    interpret("test_invariant_matmul", "check_last_sums('cpu')", timeout=600)


def check_walk(device: str) -> None:
    from engine.kernels.invariant_matmul import SPLIT_BELOW_TILES, Arrivals, invariant_matmul
    from engine.kernels.invariant_tiles import chunking, config

    g = torch.Generator().manual_seed(1)
    # 4 chunks of 8 steps (one loop: WALK_CHUNKS); the last step masked; 2 chunks (a pipeline each)
    for k, chunks in ((2048, 4), (2000, 4), (2048, 2)):
        n = 256
        c = config(n, k)._replace(block_m=16, block_n=16, split_k=chunks)  # small tiles: many at few rows
        assert chunking(k, c)[1] == chunks
        w = (torch.randn(n, k, generator=g) * 0.02).half().to(device)
        x = torch.randn(9 * 16, k, generator=g).half().to(device)
        assert 9 * (n // 16) >= SPLIT_BELOW_TILES > n // 16  # 144 rows walk, 16 rows split
        walked = invariant_matmul(x, w, cfg=c)
        split = invariant_matmul(x[-16:], w, cfg=c, arrivals=Arrivals(torch.device(device)))
        assert torch.equal(walked[-16:], split), k
        # The same 16 rows, one program a tile where the rule splits (split_below, the bench's
        # override): counters that never reach a tile's last chunk stop the split path, not it.
        stuck = Arrivals(torch.device(device))
        stuck.counts.fill_(1 << 20)
        for below, same in ((0, True), (SPLIT_BELOW_TILES, False)):
            got = torch.full_like(split, float("nan"))
            invariant_matmul(x[-16:], w, out=got, cfg=c, arrivals=stuck, split_below=below)
            assert torch.equal(got, split) is same, (k, below)
        ref = x.float() @ w.float().T
        assert (walked.float() - ref).abs().max().item() < 2e-2 * ref.abs().max().item()
    with pytest.raises(ValueError, match="split_below"):  # more tiles than Arrivals counts
        invariant_matmul(x, w, split_below=SPLIT_BELOW_TILES + 1)


def test_a_program_walking_every_chunk_gives_the_split_bits_interpreted() -> None:
    interpret("test_invariant_matmul", "check_walk('cpu')", timeout=600)


def check_tma(device: str) -> None:
    from engine.kernels.invariant_matmul import Arrivals, invariant_matmul, tma_loads
    from engine.kernels.invariant_tiles import config

    g = torch.Generator().manual_seed(2)
    # (n, k, m, tile override): the split path with its last-chunk sum; 4 chunks walked in one loop
    # and 2 summed as two pipelines (many small tiles); K not a whole number of steps; rows past M
    # and columns past N in partial tiles.
    cases = ((256, 2048, 5, None), (256, 2048, 144, dict(block_m=16, block_n=16, split_k=4)),
             (256, 2048, 144, dict(block_m=16, block_n=16, split_k=2)), (256, 2000, 144, dict(block_m=16, block_n=16, split_k=4)),
             (200, 1000, 20, None), (96, 64, 33, None))  # fmt: skip
    for n, k, m, tile in cases:
        c = config(n, k)._replace(**tile) if tile else None
        w = (torch.randn(n, k, generator=g) * 0.02).half().to(device)
        x = torch.randn(m, k, generator=g).half().to(device)
        assert tma_loads(x, w), (n, k)
        arrivals = Arrivals(torch.device(device))
        pointers = invariant_matmul(x, w, cfg=c, arrivals=arrivals, tma=False)
        assert torch.equal(invariant_matmul(x, w, cfg=c, arrivals=arrivals, tma=True), pointers), (n, k, m)
        ref = x.float() @ w.float().T
        assert (pointers.float() - ref).abs().max().item() < 2e-2 * ref.abs().max().item()
    # A row stride of 1001 halves (not 16-byte aligned): pointer loads, the contiguous rows' bits.
    wide = torch.randn(9, 1001, generator=g).half().to(device)
    x, w = wide[:, :1000], (torch.randn(64, 1000, generator=g) * 0.02).half().to(device)
    assert not tma_loads(x, w) and tma_loads(x.contiguous(), w)
    assert torch.equal(invariant_matmul(x, w), invariant_matmul(x.contiguous(), w))
    # One row broadcast to 8 (row stride 0): pointer loads, every row the row's own bits.
    x = x[2:3].contiguous().expand(8, 1000)
    assert not tma_loads(x, w)
    assert torch.equal(invariant_matmul(x, w), invariant_matmul(x[:1], w).expand(8, 64))


def test_tma_loads_give_the_pointer_loads_bits_interpreted() -> None:
    interpret("test_invariant_matmul", "check_tma('cpu')", timeout=600)


def test_the_tile_follows_the_rows_and_the_k_order_the_weight() -> None:
    from engine.kernels.invariant_tiles import LONG_K, MANY_ROWS, chunking, config, rows_tile

    # The Qwen3-0.6B and -8B linear weights (N, K): qkv, o_proj, gate_up, down, lm_head.
    weights = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (151936, 1024),
               (6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288), (151936, 4096)]  # fmt: skip
    seen = set()
    for n, k in weights:
        cfg = config(n, k)
        for m in (1, 16, 17, 64, 256, 1000, MANY_ROWS, 2048, 8192):
            t = rows_tile(cfg, n, k, m)
            assert chunking(k, t) == chunking(k, cfg), (n, k, m)  # K's order is the weight's
            # BLOCK_K follows the rows only in a one-chunk weight's tiles, and then divides K
            assert t.block_k == cfg.block_k or (chunking(k, cfg)[1] == 1 and k % t.block_k == 0), (n, k, m)
            assert (chunking(k, cfg)[1] == 1) >= (k >= LONG_K), (n, k)  # a long K is one chunk
            assert t.block_m * t.block_n <= 128 * 256 and t.num_warps * 32 * 128 >= t.block_m * t.block_n  # <= 128 fp32 a thread
            if t.block_n == 256:  # two accumulators of 128 registers a thread: only a walk of > 2 chunks
                assert chunking(k, cfg)[1] > 2 and m >= MANY_ROWS, (n, k, m)
            seen.add((t.block_m, t.block_n))
            seen.add(("k", t.block_k))
    assert {(16, 64), (16, 128), (64, 32), (64, 64), (64, 128), (128, 128), (128, 256), (256, 128)} <= seen
    assert {("k", 64), ("k", 128), ("k", 256)} <= seen
