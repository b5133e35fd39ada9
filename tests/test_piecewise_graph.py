"""Piecewise CUDA graphs (engine/runner/piecewise_graph.py) on the CPU: the token ladder; the splitter's
warm-up forward (one attention call per decoder layer, the KV cache untouched); the eager
reference of a replay (`run_eager`: padded to a ladder size, attention on the real rows only
into the static buffer) against the plain forward; the attention backends' `out=`.

The helpers here (tiny models, random caches, mixed steps) serve tests/test_gpu_piecewise.py too.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

import pytest
import torch

from engine.attention import AttentionBackend, AttentionMetadata, ForwardContext
from engine.attention.sdpa import SdpaBackend
from engine.config import ModelConfig
from engine.models import get_model_class
from engine.runner.piecewise_graph import TOKEN_LADDER, PiecewiseGraphRunner, piecewise_token_sizes
from engine.weights.loader import load_checkpoint

BLOCK_SIZE = 16
NUM_BLOCKS = 256
MAX_MODEL_LEN = 1024
MAX_NUM_SEQS = 64


# ---- helpers ------------------------------------------------------------------------------------


def load_model(path: str, dtype: torch.dtype, device: str) -> torch.nn.Module:
    config = ModelConfig.from_hf(path)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = get_model_class(config.architecture)(config)
    finally:
        torch.set_default_dtype(default)
    load_checkpoint(model, path)
    return model.eval()


def random_cache(model: torch.nn.Module, dtype: torch.dtype, device: str, seed: int = 0) -> torch.Tensor:
    """[L, 2, NUM_BLOCKS, BLOCK_SIZE, Hkv, D], random everywhere: cached context is whatever it
    holds, and a stray write anywhere changes it."""
    c = model.config
    g = torch.Generator().manual_seed(seed)
    shape = (c.num_layers, 2, NUM_BLOCKS, BLOCK_SIZE, c.num_kv_heads, c.head_dim)
    return torch.randn(shape, generator=g).to(dtype).to(device)


def make_backend(cls: type[AttentionBackend], model: torch.nn.Module, cache: torch.Tensor) -> AttentionBackend:
    c = model.config
    return cls(cache, scale=c.head_dim**-0.5, num_heads=c.num_heads, max_num_seqs=MAX_NUM_SEQS, max_model_len=MAX_MODEL_LEN)


def make_runner(model: torch.nn.Module, backend: AttentionBackend, sizes: list[int]) -> PiecewiseGraphRunner:
    c = model.config
    return PiecewiseGraphRunner(
        model, backend, sizes, c.hidden_size, c.num_heads, c.head_dim, backend.kv_cache.dtype, backend.kv_cache.device
    )


@dataclass
class Step:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    slots: torch.Tensor  # [T] int64: the cache slots the step writes

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


def mixed_specs(num_tokens: int, seed: int, num_decode: int = 3) -> list[tuple[int, int]]:
    """(cached tokens, new tokens) per sequence, new tokens summing to num_tokens: decode rows
    with cached context, then a fresh prefill chunk and a chunk continuing a cached prefix."""
    rng = random.Random(seed)
    decode = min(num_decode, num_tokens - 1)
    specs = [(rng.randint(5, 120), 1) for _ in range(decode)]
    rest = num_tokens - decode
    if rest == 1:
        return specs + [(rng.randint(5, 120), 1)]
    return specs + [(0, rest // 2), (rng.randint(1, 60), rest - rest // 2)]


def make_step(specs: list[tuple[int, int]], device: str, vocab: int, seed: int) -> Step:
    """Blocks from a shuffled pool without block 0, so that a padding row's write to slot 0 shows."""
    rng = random.Random(seed)
    free = list(range(1, NUM_BLOCKS))
    rng.shuffle(free)
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    qsl = [0]
    seq_lens: list[int] = []
    tables: list[list[int]] = []
    for cached, new in specs:
        end = cached + new
        table = [free.pop() for _ in range(-(-end // BLOCK_SIZE))]
        tables.append(table)
        ids += [rng.randrange(3, vocab) for _ in range(new)]
        positions += range(cached, end)
        slots += [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(cached, end)]
        qsl.append(qsl[-1] + new)
        seq_lens.append(end)
    width = max(len(t) for t in tables)
    padded = [t + [0] * (width - len(t)) for t in tables]

    def dev(values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    meta = AttentionMetadata(
        query_start_loc=dev(qsl, torch.int32),
        seq_lens=dev(seq_lens, torch.int32),
        block_tables=dev(padded, torch.int32),
        slot_mapping=dev(slots, torch.int64),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
        max_query_len=max(n for _, n in specs),
        max_seq_len=max(seq_lens),
    )
    return Step(dev(ids, torch.int64), dev(positions, torch.int64), meta, dev(slots, torch.int64))


def written(cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the cache rows at `slots`, every other row): [L, 2, n, Hkv, D] and [L, 2, rest, Hkv, D]."""
    flat = cache.flatten(2, 3)
    mask = torch.zeros(flat.shape[2], dtype=torch.bool, device=cache.device)
    mask[slots] = True
    return flat[:, :, mask], flat[:, :, ~mask]


@torch.inference_mode()
def eager_forward(model: torch.nn.Module, backend: AttentionBackend, step: Step) -> torch.Tensor:
    return model(step.input_ids, step.positions, ForwardContext(backend, step.meta))


# ---- the ladder ---------------------------------------------------------------------------------


def test_ladder_is_capped_by_the_token_budget_and_the_kv_cache() -> None:
    assert piecewise_token_sizes(512, 10**6) == [16, 32, 64, 128, 256, 384, 512]
    assert piecewise_token_sizes(600, 10**6) == [16, 32, 64, 128, 256, 384, 512, 600]
    assert piecewise_token_sizes(8192, 1000) == [16, 32, 64, 128, 256, 384, 512, 768, 1000]
    assert piecewise_token_sizes(16384, 10**6) == [*TOKEN_LADDER, 16384]
    assert piecewise_token_sizes(10, 10**6) == [10]
    assert piecewise_token_sizes(2048, 0) == []


def test_a_step_runs_the_smallest_size_that_holds_it(qwen3_dir: str) -> None:
    model = load_model(qwen3_dir, torch.float32, "cpu")
    cache = random_cache(model, torch.float32, "cpu")
    runner = make_runner(model, make_backend(SdpaBackend, model, cache), [64, 16, 32])
    assert runner.token_sizes == [16, 32, 64]
    assert [runner.padded_size(n) for n in (1, 16, 17, 32, 33, 64)] == [16, 16, 32, 32, 64, 64]
    assert not runner.can_run(16)  # nothing captured
    with pytest.raises(RuntimeError, match="CUDA device"):
        runner.capture()


# ---- the splitter -------------------------------------------------------------------------------


def test_warmup_makes_one_attention_call_per_layer_and_leaves_the_cache(arch_dir: str) -> None:
    model = load_model(arch_dir, torch.float32, "cpu")
    cache = random_cache(model, torch.float32, "cpu")
    before = cache.clone()
    runner = make_runner(model, make_backend(SdpaBackend, model, cache), [16, 48])
    for size in (16, 48):
        assert runner.warmup(size) == model.config.num_layers
        assert runner.splitter.layer_ids == list(range(model.config.num_layers))
    assert torch.equal(cache, before)


# ---- the eager reference of a replay ------------------------------------------------------------


@pytest.mark.parametrize("num_tokens", [1, 5, 16, 23, 64, 100])
def test_padded_pieces_equal_the_plain_forward(arch_dir: str, num_tokens: int) -> None:
    """Padded to the ladder size, attention on the real rows into the shared static buffer: the
    real rows' hidden states and KV equal the plain forward's; padding writes no KV."""
    model = load_model(arch_dir, torch.float32, "cpu")
    cache = random_cache(model, torch.float32, "cpu")
    cache0 = cache.clone()
    backend = make_backend(SdpaBackend, model, cache)
    runner = make_runner(model, backend, [16, 32, 64, 128])
    step = make_step(mixed_specs(num_tokens, seed=num_tokens), "cpu", model.config.vocab_size, seed=num_tokens)

    want = eager_forward(model, backend, step)
    want_kv = cache.clone()
    cache.copy_(cache0)
    runner.attn_out.fill_(7.0)  # stale rows from an earlier step must not leak
    got = runner.run_eager(step.input_ids, step.positions, step.meta)

    assert got.shape == want.shape and got.data_ptr() == runner.hidden.data_ptr()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    size = runner.padded_size(num_tokens)
    assert torch.equal(runner.attn_out[num_tokens:size], torch.zeros_like(runner.attn_out[num_tokens:size]))
    got_rows, got_rest = written(cache, step.slots)
    want_rows, want_rest = written(want_kv, step.slots)
    torch.testing.assert_close(got_rows, want_rows, rtol=1e-5, atol=1e-5)
    assert torch.equal(got_rest, written(cache0, step.slots)[1]) and torch.equal(want_rest, got_rest)


def test_metadata_names_the_span_of_sequences_with_more_than_one_query() -> None:
    """The prefill kernel's grid in a mixed step: from the first to the last sequence of more than
    one new token, the one-token sequences before and after it left out."""
    for specs, span, single in (
        ([(9, 1), (4, 1), (0, 30), (7, 1)], (2, 3), 3),
        ([(9, 1), (0, 5), (7, 1), (3, 2), (2, 1)], (1, 4), 3),
        ([(0, 5), (0, 9)], (0, 2), 0),
        ([(9, 1), (4, 1)], (0, 0), 2),
    ):
        meta = make_step(specs, "cpu", 100, seed=0).meta
        assert meta.multi_query_seqs == span and meta.single_query_rows == single, specs


def test_metadata_must_cover_exactly_the_steps_tokens(qwen3_dir: str) -> None:
    model = load_model(qwen3_dir, torch.float32, "cpu")
    cache = random_cache(model, torch.float32, "cpu")
    runner = make_runner(model, make_backend(SdpaBackend, model, cache), [16, 32])
    step = make_step(mixed_specs(10, seed=0), "cpu", model.config.vocab_size, seed=0)
    with pytest.raises(ValueError, match="metadata covers"):
        runner.run_eager(step.input_ids[:9], step.positions[:9], step.meta)
    big = make_step(mixed_specs(33, seed=0), "cpu", model.config.vocab_size, seed=0)
    with pytest.raises(ValueError, match="outside"):
        runner.run_eager(big.input_ids, big.positions, big.meta)


# ---- out= ---------------------------------------------------------------------------------------


def test_layer_forward_attends_the_steps_rows_and_leaves_the_padding_rows(qwen3_dir: str) -> None:
    """The base rule (SDPA): per layer, `forward` on the first T rows into out's first T rows."""
    model = load_model(qwen3_dir, torch.float32, "cpu")
    c = model.config
    cache = random_cache(model, torch.float32, "cpu")
    cache0 = cache.clone()
    backend = make_backend(SdpaBackend, model, cache)
    step = make_step(mixed_specs(20, seed=3), "cpu", c.vocab_size, seed=3)
    g = torch.Generator().manual_seed(1)
    rows = [(torch.randn(24, c.num_heads, c.head_dim, generator=g), torch.randn(24, c.num_kv_heads, c.head_dim, generator=g),
             torch.randn(24, c.num_kv_heads, c.head_dim, generator=g)) for _ in range(c.num_layers)]
    want = [backend.forward(layer, q[:20], k[:20], v[:20], step.meta) for layer, (q, k, v) in enumerate(rows)]
    want_kv = cache.clone()
    cache.copy_(cache0)
    attend = backend.layer_forward(step.meta, 20)
    out = torch.full((24, c.num_heads, c.head_dim), 3.0)
    for layer, (q, k, v) in enumerate(rows):
        attend(layer, q, k, v, out)
        assert torch.equal(out[:20], want[layer]), f"layer {layer}"
    assert torch.equal(out[20:], torch.full_like(out[20:], 3.0)), "a padding row was written"
    assert torch.equal(cache, want_kv), "the KV writes differ from forward's"


def test_sdpa_writes_into_out_and_zeroes_its_padding_rows(qwen3_dir: str) -> None:
    model = load_model(qwen3_dir, torch.float32, "cpu")
    c = model.config
    cache = random_cache(model, torch.float32, "cpu")
    backend = make_backend(SdpaBackend, model, cache)
    step = make_step(mixed_specs(20, seed=3), "cpu", c.vocab_size, seed=3)
    g = torch.Generator().manual_seed(0)
    pad = 5
    q = torch.randn(20 + pad, c.num_heads, c.head_dim, generator=g)
    k = torch.randn(20, c.num_kv_heads, c.head_dim, generator=g)
    v = torch.randn(20, c.num_kv_heads, c.head_dim, generator=g)
    want = backend.forward(1, q[:20], k, v, step.meta)
    out = torch.full_like(q, 3.0)
    got = backend.forward(1, q[:20], k, v, step.meta, out=out[:20])
    assert got.data_ptr() == out.data_ptr() and torch.equal(got, want)
    assert torch.equal(out[20:], torch.full_like(out[20:], 3.0))  # past the view: untouched
    # A view longer than the step's tokens: its rows past the last sequence become zero.
    q_pad = torch.cat([q[:20], q[20:]])
    k_pad, v_pad = torch.cat([k, k[:pad]]), torch.cat([v, v[:pad]])
    meta = replace(step.meta, slot_mapping=torch.cat([step.slots, torch.full((pad,), -1)]))
    got = backend.forward(1, q_pad, k_pad, v_pad, meta, out=out)
    assert torch.equal(got[:20], want) and torch.equal(got[20:], torch.zeros_like(got[20:]))
    with pytest.raises(ValueError, match="does not match"):
        backend.forward(1, q[:20], k, v, step.meta, out=out[:20].double())
