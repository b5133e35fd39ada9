"""engine/kernels/invariant_matmul.py under Triton's interpreter (tests/interpreted.py), fp16:
the split path (fewer output tiles than SPLIT_BELOW_TILES, K in chunks) with `Arrivals`, where
a tile's last chunk to arrive sums the chunks, gives the bits of the two-launch path (a second
kernel sums them) and of the same row alone, and leaves every counter at zero for the next call;
the counters' zeroing after a resume; a program that walks every chunk of its tile (many
tiles), in one loop or a pipeline a chunk, gives the split path's bits, K a whole number of steps
or not. The GPU's bits: tests/test_gpu_invariant_matmul.py.
"""

from __future__ import annotations

import torch
from interpreted import interpret


def check_last_sums(device: str) -> None:
    from engine.kernels.invariant_matmul import (
        SPLIT_BELOW_TILES,
        Arrivals,
        chunking,
        config,
        invariant_matmul,
    )

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
    from engine.kernels.invariant_matmul import (
        SPLIT_BELOW_TILES,
        Arrivals,
        chunking,
        config,
        invariant_matmul,
    )

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
        ref = x.float() @ w.float().T
        assert (walked.float() - ref).abs().max().item() < 2e-2 * ref.abs().max().item()


def test_a_program_walking_every_chunk_gives_the_split_bits_interpreted() -> None:
    interpret("test_invariant_matmul", "check_walk('cpu')", timeout=600)
