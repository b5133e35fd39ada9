"""The tiles of the batch-invariant GEMM (engine/kernels/invariant_matmul.py): K's order per
weight shape (`config`: the chunks, the bits) and the output tile per number of rows
(`rows_tile`: where the arithmetic runs, never what it computes).

The configuration rule (`config`), reasoned for an H100 / H200 (132 SMs, wgmma), then timed
on one (bench/kernels/invariant_matmul.py times it against cuBLAS and `--sweep` ranks a grid of
configs per weight shape over all M at once, the only way a config may be chosen here):
- BLOCK_M = 64, 4 warps: one warp group, Hopper's smallest wgmma M. A decode step's few rows
  take 16-row tiles instead, 128 columns wide from N >= FEW_WIDE_N: at M = 1 that halves the
  64-row tile's time (the 0.6B lm_head 166 -> 84 us, cuBLAS 76; the 8B gate_up 96 -> 55, cuBLAS
  48; bench/history/2026-11-29.md, 2026-11-29t). From MANY_ROWS rows, `rows_tile`.
- BLOCK_N trades M = 1 bandwidth (programs to stream the weight) against large-M intensity
  (MACs per loaded element): 128 columns where N >= WIDE_N (>= 64 column tiles; the 8B's gate_up
  and every lm_head have 192 and more), else 64.
- SPLIT_K brings a few-rows GEMM's programs to about TARGET_PROGRAMS (two an SM), with chunks of
  at least MIN_CHUNK_STEPS BLOCK_K steps: the 0.6B's o_proj (16 column tiles, K 2048) takes 4
  chunks of 512, its down (K 3072) 6, its qkv and gate_up 2, its lm_head 1.
- BLOCK_K = 64 and 4 stages: 24 KB of shared memory a stage at 64 x 128, two programs an SM.
  K < 64 (tiny test models) takes one step of K rounded up to a power of two (>= 16).
- From K >= LONG_K (the 8B's layers, its lm_head) one chunk: a program walking all of K with
  BLOCK_K 128 or 256 and one program an SM has loads enough in flight for a GEMV, and a chunk
  fold costs the many-row tiles their pipeline (2026-12-01i: at 64 rows the 8B's o_proj 1.42x
  cuBLAS in 5 chunks, 0.98x in one; at 1 row 0.90x against 0.93x).

BLOCK_K is not in the bits: a tile's tensor-core dots add K's 16-wide slices into the fp32 sum
one after another in ascending order whatever BLOCK_K (on an H200, as for the tile's rows and
columns; tests/test_gpu_invariant_matmul.py crosses 64, 128 and 256). So `rows_tile` may deepen
the K step of a one-chunk weight whose K it divides; the chunks of a chunked weight stay on
their BLOCK_K steps here (the mode's persistent decode kernel steps them by 128:
engine/decode/batch_decode.py FEW_BK).
"""

from __future__ import annotations

from typing import NamedTuple

from triton import cdiv, next_power_of_2

BLOCK_M = 64  # rows of a tile: one warp group's wgmma M
WIDE_N = 8192  # N from which a tile is 128 columns wide, below it 64
TARGET_PROGRAMS = 264  # two an SM of an H100 / H200 (132 SMs)
MIN_CHUNK_STEPS = 8  # BLOCK_K steps a chunk of K walks at least
FEW_ROWS = 16  # at most this many rows: 16-row tiles (`rows_tile`)
FEW_WIDE_N = 4096  # N from which a few-rows tile is 128 columns wide, below it 64
MID_ROWS = 256  # at least this many rows (a large decode): a large weight's tiles 128 rows high
MANY_ROWS = 1024  # at least this many rows (prefill): 128-row tiles of 8 warps where SMS of them or more
WIDE_TILES = 256  # from this many 128 x 256 tiles (two waves of SMS), prefill's walked weights take them
SMS = 132  # an H100's / H200's
DEEP_STAGES = 6  # the pipeline of a tile that runs alone on its SM (one wave), or a narrow one
LONG_K = 4096  # K from which a weight is one chunk (`config`) and its tiles `_one_chunk_tile`'s
FEW_TILES = 64  # a few-rows tile of a one-chunk weight: the widest of 64, 32, 16 columns giving this many
FULL_WAVES = 0.9  # 256 x 128 tiles where their waves are this full on average (else 128 x 128)


class Config(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int = 1  # chunks of K (fewer where K has fewer whole BLOCK_K steps)


def config(n: int, k: int) -> Config:
    """The one configuration of a weight [N = n, K = k], whatever the rows: the rules above."""
    block_n = min(128 if n >= WIDE_N else 64, max(16, next_power_of_2(n)))
    block_k = 64 if k >= 64 else max(16, next_power_of_2(k))
    tiles_n = cdiv(n, block_n)
    split = 1 if k >= LONG_K else max(1, min(cdiv(TARGET_PROGRAMS, tiles_n), cdiv(k, block_k) // MIN_CHUNK_STEPS))
    return Config(BLOCK_M, block_n, block_k, num_warps=4, num_stages=4, split_k=split)


def rows_tile(cfg: Config, n: int, k: int, m: int) -> Config:
    """The output tile that runs m rows of the weight whose configuration is `cfg`; K's chunks
    (and BLOCK_K, but in a one-chunk weight's tiles) are cfg's whatever m, so the tile never
    changes the bits. First rule that holds:
    - m <= FEW_ROWS: 16-row tiles, 128 columns from N >= FEW_WIDE_N, else 64.
    - m >= MANY_ROWS with SMS 128 x 128 tiles or more, 8 warps: 256 x 128 (3 stages) for a weight
      of one chunk (the 0.6B's lm_head); 128 x 256 (3 stages) for one of more than 2 chunks (walked in
      one loop) where WIDE_TILES of them or more; else 128 x 128 (4 stages). (128 x 256 over 2
      chunks holds two fp32 accumulators of 128 registers a thread and spills.)
    - m >= MID_ROWS and N >= WIDE_N (the 0.6B's lm_head): 128 x 128, two warp groups.
    - m >= MID_ROWS where 64 x 128 tiles make one wave of more than SMS / 2 (the 0.6B's qkv at
      256 rows: 128 tiles): those, one program an SM, DEEP_STAGES deep,
      walking their chunks (invariant_sums.SPLIT_BELOW_TILES).
    - m <= 64 and N below WIDE_N (the 0.6B's layers): 64 x 32, DEEP_STAGES.
    - else cfg's 64-row tile.
    A one-chunk weight of K >= LONG_K takes `_one_chunk_tile`'s instead.
    Each rule is the best of `bench/kernels/invariant_matmul.py --sweep` at its rows on an H200,
    against cuBLAS (bench/history/2026-11-30.md, entries e, h and m; docs/KERNELS.md)."""
    if k >= LONG_K and chunking(k, cfg)[1] == 1:
        return _one_chunk_tile(cfg, n, k, m)
    width = max(16, next_power_of_2(n))
    if m <= FEW_ROWS:
        return cfg._replace(block_m=16, block_n=min(128 if n >= FEW_WIDE_N else 64, width))
    if m >= MANY_ROWS and cdiv(m, 128) * cdiv(n, 128) >= SMS:
        chunks = chunking(k, cfg)[1]
        if chunks == 1 and cdiv(m, 256) * cdiv(n, 128) >= SMS:
            return cfg._replace(block_m=256, block_n=min(128, width), num_warps=8, num_stages=3)
        if chunks > 2 and cdiv(m, 128) * cdiv(n, 256) >= WIDE_TILES:
            return cfg._replace(block_m=128, block_n=min(256, width), num_warps=8, num_stages=3)
        return cfg._replace(block_m=128, block_n=min(128, width), num_warps=8, num_stages=4)
    if m >= MID_ROWS and n >= WIDE_N:
        return cfg._replace(block_m=128, block_n=min(128, width), num_warps=8, num_stages=4)
    if m >= MID_ROWS and SMS // 2 < cdiv(m, 64) * cdiv(n, 128) <= SMS:
        return cfg._replace(block_m=64, block_n=min(128, width), num_warps=4, num_stages=DEEP_STAGES)
    if m <= 64 and n < WIDE_N:
        return cfg._replace(block_n=min(32, width), num_stages=DEEP_STAGES)
    return cfg


def _one_chunk_tile(cfg: Config, n: int, k: int, m: int) -> Config:
    """The output tile and K step that run m rows of a one-chunk weight [n, k >= LONG_K]: the
    best of bench/history/2026-12-01.md entry i's probes at 1-8,192 rows, the 8B's weights on an
    H200. A deeper K step only where it divides K (`_deep_k`). First rule that holds:
    - m <= FEW_ROWS: 16 x (64, 32 or 16: the widest giving FEW_TILES tiles), BLOCK_K 256 where
      fewer than 2 SMS tiles (one program an SM, 160 KB of loads in flight), else 128; 4 stages.
    - m <= 64: N >= WIDE_N cfg's 64 x 128, else 64 x 64 with BLOCK_K 128, DEEP_STAGES.
    - m >= MID_ROWS: 256 x 128 (3 stages) where its waves are FULL_WAVES full or more (the
      lm_head from 256 rows, everything from 1,024 but the 8B's qkv).
    - m < MANY_ROWS and N < WIDE_N: 64 x 128 tiles making one wave of more than SMS / 2, BLOCK_K
      128 (the 8B's qkv at 65-255 rows, o_proj and down at 256-511); else below MID_ROWS 64 x 64
      as at 64 rows.
    - else 128 x 128, two warp groups."""
    width = max(16, next_power_of_2(n))
    if m <= FEW_ROWS:
        bn = next((b for b in (64, 32) if cdiv(n, b) >= FEW_TILES), 16)
        bk = _deep_k(k, 256 if cdiv(n, bn) < 2 * SMS else 128, cfg.block_k)
        return cfg._replace(block_m=16, block_n=min(bn, width), block_k=bk, num_stages=4)
    narrow = cfg._replace(block_n=min(64, width), block_k=_deep_k(k, 128, cfg.block_k), num_stages=DEEP_STAGES)
    if m <= 64:
        return cfg if n >= WIDE_N else narrow
    tiles = cdiv(m, 256) * cdiv(n, 128)
    if m >= MID_ROWS and tiles / (cdiv(tiles, SMS) * SMS) >= FULL_WAVES:
        return cfg._replace(block_m=256, block_n=min(128, width), num_warps=8, num_stages=3)
    if m < MANY_ROWS and n < WIDE_N:
        if SMS // 2 < cdiv(m, 64) * cdiv(n, 128) <= SMS:
            return cfg._replace(block_n=min(128, width), block_k=_deep_k(k, 128, cfg.block_k))
        if m < MID_ROWS:
            return narrow
    return cfg._replace(block_m=128, block_n=min(128, width), num_warps=8, num_stages=4)


def _deep_k(k: int, deep: int, step: int) -> int:
    """BLOCK_K `deep` where it divides K (the same bits as `step`), else `step`."""
    return deep if k % deep == 0 else step


def chunking(k: int, cfg: Config) -> tuple[int, int]:
    """(chunk_k, chunks): K cut into chunks of whole BLOCK_K steps, none empty."""
    chunk_k = cdiv(cdiv(k, max(1, cfg.split_k)), cfg.block_k) * cfg.block_k
    return chunk_k, cdiv(k, chunk_k)
