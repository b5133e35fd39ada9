"""The Triton attention backend against the SDPA backend run in float64, on fresh random inputs
(random caches, queries and keys; block tables drawn from a shuffled block pool): ragged prefill
with and without a cached prefix, decode with and without KV splits, lengths 1..8192, head dims
16..256, GQA ratios 1/4/8, block sizes 16/32, three dtypes; graph metadata with padding rows; a
CUDA-graph capture and replay of decode. GPU only: every test skips without CUDA.

Error measure: ||out - ref|| / ||ref|| over the real rows, with `ref` from float64 inputs equal
to the test dtype's values.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from engine.attention import AttentionMetadata
from engine.attention.sdpa import SdpaBackend

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 1e-2}
NUM_LAYERS = 2
LAYER = 1  # the second layer, so that indexing the wrong layer shows


@dataclass(frozen=True)
class Shape:
    head_dim: int
    num_heads: int
    num_kv_heads: int
    block_size: int
    dtype: torch.dtype

    def __str__(self) -> str:
        group = self.num_heads // self.num_kv_heads
        return f"d{self.head_dim}-g{group}-bs{self.block_size}-{str(self.dtype)[6:]}"


SHAPES = [
    Shape(128, 32, 8, 16, torch.bfloat16),  # GQA 4
    Shape(128, 8, 8, 32, torch.bfloat16),  # MHA
    Shape(64, 16, 2, 16, torch.bfloat16),  # GQA 8
    Shape(64, 8, 2, 32, torch.float16),
    Shape(128, 16, 2, 32, torch.float32),
    Shape(64, 4, 4, 16, torch.float32),
    Shape(256, 8, 2, 16, torch.bfloat16),
    Shape(16, 4, 1, 32, torch.float32),
]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class Batch:
    meta: AttentionMetadata
    q: torch.Tensor  # [T, H, D]
    k: torch.Tensor  # [T, Hkv, D]
    v: torch.Tensor  # [T, Hkv, D]


def new_cache(shape: Shape, num_blocks: int, device: str = "cuda") -> torch.Tensor:
    # Random everywhere: cached prefixes are whatever the cache holds, never zeros.
    return torch.randn(
        NUM_LAYERS, 2, num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim, device=device
    ).to(shape.dtype)


def new_batch(
    shape: Shape, specs: list[tuple[int, int]], num_blocks: int, pad: int = 0, device: str = "cuda"
) -> Batch:
    """specs: (seq_len, q_len) per sequence; its first seq_len - q_len tokens are cached. Blocks
    come from a random permutation of the pool; `pad` token rows with slot -1 follow."""
    bs = shape.block_size
    perm = torch.randperm(num_blocks).tolist()
    assert sum(cdiv(n, bs) for n, _ in specs) <= num_blocks
    tables, slots, qsl = [], [], [0]
    for seq_len, q_len in specs:
        table = [perm.pop() for _ in range(cdiv(seq_len, bs))]
        tables.append(table)
        slots += [table[p // bs] * bs + p % bs for p in range(seq_len - q_len, seq_len)]
        qsl.append(qsl[-1] + q_len)
    width = max(len(t) for t in tables)
    tables = [t + [0] * (width - len(t)) for t in tables]
    slots += [-1] * pad
    seq_lens = [n for n, _ in specs]
    t = qsl[-1] + pad
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
        max_query_len=max(q for _, q in specs),
        max_seq_len=max(seq_lens),
    )
    h, hkv, d = shape.num_heads, shape.num_kv_heads, shape.head_dim
    rand = lambda *s: torch.randn(*s, device=device).to(shape.dtype)  # noqa: E731
    return Batch(meta, rand(t, h, d), rand(t, hkv, d), rand(t, hkv, d))


def make_backend(shape: Shape, cache: torch.Tensor, max_model_len: int, max_num_seqs: int = 512):
    from engine.attention.triton import TritonBackend

    return TritonBackend(
        cache, scale=shape.head_dim**-0.5, num_heads=shape.num_heads,
        max_num_seqs=max_num_seqs, max_model_len=max_model_len,
    )  # fmt: skip


def load_graph_rows(backend, meta: AttentionMetadata, bs: int) -> AttentionMetadata:
    """A real decode step of n <= bs rows into the backend's static graph buffers, as the runner's
    gather does (engine/runner/graph_io.py): table rows padded with block 0 to the step's widest,
    rows n..bs-1 padding (seq_len 0, slot -1). Returns the graph's metadata views."""
    graph = backend.graph_metadata(bs)
    n, width = meta.block_tables.shape
    graph.block_tables[:, :width].zero_()
    graph.block_tables[:n, :width] = meta.block_tables
    graph.seq_lens.zero_()
    graph.seq_lens[:n] = meta.seq_lens
    graph.slot_mapping.fill_(-1)
    graph.slot_mapping[:n] = meta.slot_mapping[:n]
    return graph


def reference(shape: Shape, cache: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(float64 output [T, H, D], the cache as the step must leave it, in the cache's dtype)."""
    ref_cache = cache.double()
    sdpa = SdpaBackend(ref_cache, scale=shape.head_dim**-0.5, num_heads=shape.num_heads, max_num_seqs=1, max_model_len=1)
    out = sdpa.forward(LAYER, batch.q.double(), batch.k.double(), batch.v.double(), batch.meta)
    expected = cache.clone()
    valid = batch.meta.slot_mapping >= 0
    slots = batch.meta.slot_mapping[valid]
    for i, new in ((0, batch.k), (1, batch.v)):
        expected[LAYER, i].view(-1, shape.num_kv_heads, shape.head_dim)[slots] = new[valid]
    return out, expected


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not out.isnan().any(), "NaN in the output"
    return ((out.double() - ref).norm() / ref.norm()).item()


def check(shape: Shape, cache: torch.Tensor, batch: Batch, max_model_len: int) -> float:
    ref, expected_cache = reference(shape, cache, batch)
    backend = make_backend(shape, cache, max_model_len)
    out = backend.forward(LAYER, batch.q, batch.k, batch.v, batch.meta)
    assert out.shape == batch.q.shape and out.dtype == batch.q.dtype
    assert torch.equal(cache, expected_cache), "KV cache not written as expected"
    end = batch.meta.query_start_loc_cpu[-1]
    assert torch.equal(out[end:], torch.zeros_like(out[end:])), "padding rows not zero"
    err = rel_err(out[:end], ref[:end])
    assert err < TOL[shape.dtype], f"{shape}: relative error {err:.2e}"
    print(f"{shape} seqs={len(batch.meta.seq_lens_cpu)} max_q={batch.meta.max_query_len}: rel err {err:.2e}")
    return err


# (seq_len, q_len): fresh prompts, prompts after a cached prefix, a decode row among prefills,
# block-boundary and odd lengths.
PREFILL_SPECS = [(1, 1), (7, 7), (16, 16), (33, 33), (100, 37), (129, 1), (600, 600), (1000, 250), (4097, 64)]
DECODE_LENS = [1, 2, 15, 16, 17, 31, 32, 33, 255, 1000, 1023, 4097, 8192]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_prefill_matches_sdpa(shape: Shape) -> None:
    torch.manual_seed(0)
    num_blocks = sum(cdiv(n, shape.block_size) for n, _ in PREFILL_SPECS) + 7
    cache = new_cache(shape, num_blocks)
    check(shape, cache, new_batch(shape, PREFILL_SPECS, num_blocks, pad=3), max_model_len=8192)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_decode_matches_sdpa(shape: Shape) -> None:
    torch.manual_seed(1)
    # A small batch (split KV + reduce) and one wide enough for a single split (direct output).
    backend = make_backend(shape, new_cache(shape, 1), max_model_len=8192)
    wide = cdiv(backend.wave_programs, shape.num_kv_heads)
    assert backend.num_splits(len(DECODE_LENS)) > 1 and backend.num_splits(wide) == 1
    for lens in (DECODE_LENS, torch.randint(1, 300, (wide,)).tolist()):
        num_blocks = sum(cdiv(n, shape.block_size) for n in lens) + 5
        cache = new_cache(shape, num_blocks)
        check(shape, cache, new_batch(shape, [(n, 1) for n in lens], num_blocks, pad=2), max_model_len=8192)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_mixed_step_matches_sdpa(shape: Shape) -> None:
    """Decode rows (one new token) among prefill chunks, interleaved, few and many of them: the
    decode kernel attends the one-token sequences at their token rows and the prefill kernel
    the rest (with and without KV splits), each row as SDPA."""
    torch.manual_seed(2)
    backend = make_backend(shape, new_cache(shape, 1), max_model_len=8192)
    wide = cdiv(backend.wave_programs, shape.num_kv_heads)
    for decodes in ([2, 700, 33], torch.randint(2, 300, (wide,)).tolist()):
        specs = [(n, 1) for n in decodes]
        specs[1:1] = [(300, 300)]  # a fresh prompt after the first decode row
        specs.append((1000, 129))  # a chunk after a cached prefix, last
        num_blocks = sum(cdiv(n, shape.block_size) for n, _ in specs) + 5
        batch = new_batch(shape, specs, num_blocks, pad=2)
        assert 0 < batch.meta.single_query_rows < len(specs)
        assert (backend.num_splits(len(specs)) > 1) == (len(decodes) == 3)
        check(shape, new_cache(shape, num_blocks), batch, max_model_len=8192)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_decode_merged_in_the_kernel_matches_sdpa(shape: Shape) -> None:
    """A decode launched with PDL (the batch decode's) merges its KV splits inside the kernel:
    real rows as SDPA (rows shorter than a split among them), graph padding rows zero, every
    counter back at zero after the launch; counters left non-zero (a resumed `cuda_graph` region
    holds whatever its pages held) give wrong rows until `after_resume` zeroes them."""
    from engine.kernels import attention_decode as td
    from engine.kernels import pdl

    torch.manual_seed(5)
    lens = DECODE_LENS
    n, bs = len(lens), len(lens) + 3
    num_blocks = sum(cdiv(x, shape.block_size) for x in lens) + 5
    cache = new_cache(shape, num_blocks)
    backend = make_backend(shape, cache, max_model_len=8192, max_num_seqs=bs)
    splits, merged = backend.decode_splits(bs, pdl_launch=True)
    assert merged and 1 < splits <= backend.num_splits(bs)
    assert backend.decode_splits(bs) == (backend.num_splits(bs), False)
    real = new_batch(shape, [(x, 1) for x in lens], num_blocks)
    ref, _ = reference(shape, cache, real)
    backend.forward(LAYER, real.q, real.k, real.v, real.meta)  # stores the new K/V rows
    backend.init_graph_buffers(bs)
    meta = load_graph_rows(backend, real.meta, bs)
    q = torch.cat([real.q, torch.randn(bs - n, *real.q.shape[1:], device="cuda").to(real.q.dtype)])

    def decode() -> torch.Tensor:
        out = torch.full_like(q, float("nan"))
        # The PDL launch's L2 prefetch takes whole 128-byte K rows (every shape the batch decode serves).
        if pdl.enabled(cache.device) and shape.head_dim * cache.element_size() >= 128:
            backend.decode(LAYER, q, meta, out, pdl_launch=True)
        else:  # the same kernel, launched plainly
            td.decode_attention(
                q, cache[LAYER, 0], cache[LAYER, 1], meta.block_tables, meta.seq_lens, out, backend.scale, splits,
                backend._part_out, backend._part_lse, counts=backend._counts,
            )  # fmt: skip
        torch.cuda.synchronize()
        return out

    for _ in range(2):  # the second launch finds the counters the first one left
        out = decode()
        assert torch.equal(out[n:], torch.zeros_like(out[n:])), "padding rows not zero"
        assert rel_err(out[:n], ref[:n]) < TOL[shape.dtype]
        assert not backend._counts.any(), "a merge counter was left non-zero"
    backend._counts.fill_(splits + 1)  # past every row's count: no split ever merges
    assert decode()[:n].isnan().any()
    backend._counts.fill_(splits + 1)
    backend.after_resume()  # the graph buffers as init_graph_buffers left them: the next replay stages its rows
    meta = load_graph_rows(backend, real.meta, bs)
    assert rel_err(decode()[:n], ref[:n]) < TOL[shape.dtype]


def test_one_reduce_variant_for_every_batch() -> None:
    """The split-KV reduce compiles once per backend: decode batches of every size, and mixed
    steps of few sequences (which the decode graphs of a persistent-kernel model never run), use
    the variant the first call compiled. Sized by the batch's split count, batches of 2-3
    sequences met a new one while serving (bench/history/2026-11-24.md)."""
    from engine.kernels import attention as tk
    from engine.kernels import attention_decode as td

    variants = td._decode_reduce_kernel.variants
    torch.manual_seed(3)
    shape = Shape(128, 16, 8, 16, torch.bfloat16)  # the Qwen3-0.6B attention shape
    batches = list(range(1, 21))
    num_blocks = batches[-1] * cdiv(700, shape.block_size) + 5
    backend = make_backend(shape, new_cache(shape, num_blocks), max_model_len=8192)
    blocks = {tk.next_pow2(backend.num_splits(b)) for b in batches if backend.num_splits(b) > 1}
    assert len(blocks) > 1, "every batch would share one split block: the test could not fail"
    first = None
    for b in batches:
        batch = new_batch(shape, [(700, 1)] * b, num_blocks)
        backend.decode(LAYER, batch.q, batch.meta, torch.empty_like(batch.q))
        first = variants() if first is None else first
    for decodes in (1, 2, 3):  # a prompt beside 1-3 decodes
        batch = new_batch(shape, [(300, 1)] * decodes + [(40, 40)], num_blocks)
        backend.forward(LAYER, batch.q, batch.k, batch.v, batch.meta)
    torch.cuda.synchronize()
    assert variants() == first, f"{variants() - first} more reduce variants compiled after the first"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_long_prefill(dtype: torch.dtype) -> None:
    torch.manual_seed(2)
    shape = Shape(128, 8, 2, 16, dtype)
    specs = [(8192, 8192), (8192, 1000)]
    num_blocks = 2 * 8192 // 16 + 3
    check(shape, new_cache(shape, num_blocks), new_batch(shape, specs, num_blocks), max_model_len=8192)


def test_graph_metadata_round_trip() -> None:
    """Load real decode steps into the static buffers and run them through graph_metadata views:
    real rows match eager, padding rows are zero and write nothing, stale rows are overwritten."""
    torch.manual_seed(3)
    shape = SHAPES[0]
    num_blocks = 1200
    cache = new_cache(shape, num_blocks)
    backend = make_backend(shape, cache, max_model_len=2048, max_num_seqs=16)
    backend.init_graph_buffers(16)
    splits = backend.num_splits
    for n, bs, one_split in ((5, 8, False), (3, 8, False), (8, 8, True), (1, 16, False), (2, 16, True)):
        # one_split: force the single-split path (direct output, no reduce) for padding rows too.
        backend.num_splits = (lambda b: 1) if one_split else splits
        lens = torch.randint(1, 2048, (n,)).tolist()
        real = new_batch(shape, [(x, 1) for x in lens], num_blocks)
        ref, expected_cache = reference(shape, cache, real)
        eager = backend.forward(LAYER, real.q, real.k, real.v, real.meta)
        assert torch.equal(cache, expected_cache)
        meta = load_graph_rows(backend, real.meta, bs)
        assert meta.num_seqs == bs and meta.is_decode
        # Padding rows carry random q/k/v: they must neither write nor read.
        q, k, v = (torch.cat([x, torch.randn(bs - n, *x.shape[1:], device="cuda").to(x.dtype)]) for x in (real.q, real.k, real.v))
        out = backend.forward(LAYER, q, k, v, meta)
        # The real rows rewrite what eager wrote; padding rows must write nothing.
        assert torch.equal(cache, expected_cache), "padding rows wrote the cache"
        assert torch.equal(out[n:], torch.zeros_like(out[n:])), "padding rows not zero"
        assert rel_err(out[:n], ref) < TOL[shape.dtype]
        assert rel_err(eager, ref) < TOL[shape.dtype]


def test_cuda_graph_replay_equals_eager() -> None:
    """Capture decode attention once with graph_metadata(bs), then replay it on new batches
    (loaded by load_graph_rows): output and cache equal an eager run of the same step."""
    torch.manual_seed(4)
    shape = SHAPES[0]
    bs, num_blocks, max_len = 8, 1200, 2048
    cache = new_cache(shape, num_blocks)
    backend = make_backend(shape, cache, max_model_len=max_len, max_num_seqs=bs)
    backend.init_graph_buffers(bs)
    meta = backend.graph_metadata(bs)
    q = torch.randn(bs, shape.num_heads, shape.head_dim, device="cuda").to(shape.dtype)
    k = torch.randn(bs, shape.num_kv_heads, shape.head_dim, device="cuda").to(shape.dtype)
    v = torch.randn_like(k)
    first = new_batch(shape, [(x, 1) for x in torch.randint(1, max_len, (bs,)).tolist()], num_blocks)
    load_graph_rows(backend, first.meta, bs)
    backend.forward(LAYER, q, k, v, meta)  # warm-up: compiles the kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = backend.forward(LAYER, q, k, v, meta)
    for n in (bs, 5, 1):
        real = new_batch(shape, [(x, 1) for x in torch.randint(1, max_len, (n,)).tolist()], num_blocks)
        ref, _ = reference(shape, cache, real)
        load_graph_rows(backend, real.meta, bs)
        for static, new in ((q, real.q), (k, real.k), (v, real.v)):
            static.copy_(torch.randn_like(static.float()).to(static.dtype))
            static[:n] = new
        before = cache.clone()
        eager = backend.forward(LAYER, q, k, v, meta).clone()
        eager_cache = cache.clone()
        cache.copy_(before)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, eager), "graph replay differs from eager"
        assert torch.equal(cache, eager_cache), "graph replay wrote the cache differently"
        assert torch.equal(static_out[n:], torch.zeros_like(static_out[n:]))
        assert rel_err(static_out[:n], ref[:n]) < TOL[shape.dtype]
