"""The two-launches-per-layer decode (engine/models/batch_decode.py, batch_kernel.py) on a GPU
(`pytest -m gpu` on the device machine), on the tiny checkpoints of test_gpu_fused_decode.py
(Qwen3: q/k norm, tied embeddings; Llama: llama3 rope scaling; Qwen2: q/k/v bias), bf16, Triton
attention, a random KV cache:

- decode steps of 5, 16, 33 and 64 rows: the hidden states and the new K/V rows equal the
  layer-by-layer forward's within bf16 rounding, and no other cache row changes;
- graph padding (rows of seq_len 0, slot -1) writes nothing and leaves the real rows' results;
- captured in a CUDA graph, replays equal the eager call for new inputs;
- through the engine: greedy decoding of a batch with it gives the tokens and logprobs of the
  engine without it (SIESTA_BATCH_DECODE=0).
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
from test_gpu_fused_decode import TOLERANCE, _checkpoint, _decode_step
from test_piecewise_graph import load_model, make_backend, make_step, random_cache, written

from engine.attention import ForwardContext

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(scope="module", params=["qwen3", "llama", "qwen2"])
def setup(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    from engine.attention.triton import TritonBackend
    from engine.models.batch_decode import BatchDecode, unsupported

    path = _checkpoint(request.param, str(tmp_path_factory.mktemp(request.param)))
    model = load_model(path, torch.bfloat16, "cuda")
    cache = random_cache(model, torch.bfloat16, "cuda")
    backend = make_backend(TritonBackend, model, cache)
    assert unsupported(model, backend) is None
    return model, backend, BatchDecode(model, backend, 1, 64)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item() / b.float().abs().max().item()


@pytest.mark.parametrize("rows", [5, 16, 33, 64])
def test_batch_decode_equals_the_layers(setup, rows: int) -> None:
    model, backend, batch = setup
    step = _decode_step(rows, seed=rows, vocab=model.config.vocab_size)
    ctx = ForwardContext(backend, step.meta)
    cache0 = backend.kv_cache.clone()
    with torch.inference_mode():
        plain = model(step.input_ids, step.positions, ctx)
        plain_cache = backend.kv_cache.clone()
        backend.kv_cache.copy_(cache0)
        model.model.batch_decode = batch
        assert batch.applies(step.input_ids, ctx)
        try:
            out = model(step.input_ids, step.positions, ctx)
        finally:
            model.model.batch_decode = None
        torch.cuda.synchronize()
    assert out.shape == plain.shape and torch.isfinite(out).all()
    assert _rel(out, plain) < TOLERANCE
    new_plain, rest_plain = written(plain_cache, step.slots)
    new_batch, rest_batch = written(backend.kv_cache, step.slots)
    # Layer 0's K/V come before any attention: its qkv split-K order moves an element an ULP at most.
    torch.testing.assert_close(new_batch[0].float(), new_plain[0].float(), rtol=1 / 128, atol=1e-2)
    assert _rel(new_batch, new_plain) < TOLERANCE
    assert torch.equal(rest_batch, written(cache0, step.slots)[1])
    assert torch.equal(rest_plain, rest_batch)


def test_padding_rows_write_nothing_and_leave_the_real_rows(setup) -> None:
    model, backend, batch = setup
    step = _decode_step(6, seed=5, vocab=model.config.vocab_size)
    meta = step.meta

    def pad(t: torch.Tensor, fill: int) -> torch.Tensor:  # 6 real rows + 6 graph-padding rows
        return torch.cat([t, torch.full((6, *t.shape[1:]), fill, dtype=t.dtype, device=t.device)])

    padded = replace(meta, seq_lens=pad(meta.seq_lens, 0), block_tables=pad(meta.block_tables, 0),
                     slot_mapping=pad(meta.slot_mapping, -1), query_start_loc=torch.arange(13, dtype=torch.int32, device="cuda"),
                     query_start_loc_cpu=list(range(13)), seq_lens_cpu=meta.seq_lens_cpu + [0] * 6)  # fmt: skip
    cache0 = backend.kv_cache.clone()
    with torch.inference_mode():
        real = batch.forward(step.input_ids, step.positions, ForwardContext(backend, meta)).clone()
        backend.kv_cache.copy_(cache0)
        out = batch.forward(pad(step.input_ids, 0), pad(step.positions, 0), ForwardContext(backend, padded))
    assert torch.isfinite(out).all()
    # the 12-row step splits the KV into fewer parts: the same within rounding
    assert _rel(out[:6], real) <= TOLERANCE
    assert torch.equal(written(backend.kv_cache, step.slots)[1], written(cache0, step.slots)[1])


def test_graph_replays_equal_the_eager_call(setup) -> None:
    model, backend, batch = setup
    vocab = model.config.vocab_size
    static = _decode_step(24, seed=20, vocab=vocab)
    width = static.meta.block_tables.shape[1]
    ctx = ForwardContext(backend, static.meta)
    with torch.inference_mode():
        batch.forward(static.input_ids, static.positions, ctx)  # compiles outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = batch.forward(static.input_ids, static.positions, ctx)
        for seed in (21, 22):
            rng = random.Random(seed)
            step = make_step([(rng.randint(1, 100), 1) for _ in range(24)], "cuda", vocab, seed)
            cache0 = backend.kv_cache.clone()
            want = batch.forward(step.input_ids, step.positions, ForwardContext(backend, step.meta)).clone()
            want_cache = backend.kv_cache.clone()
            backend.kv_cache.copy_(cache0)
            static.input_ids.copy_(step.input_ids)
            static.positions.copy_(step.positions)
            static.meta.seq_lens.copy_(step.meta.seq_lens)
            static.meta.slot_mapping.copy_(step.meta.slot_mapping)
            static.meta.block_tables.zero_()
            cols = min(width, step.meta.block_tables.shape[1])
            static.meta.block_tables[:, :cols] = step.meta.block_tables[:, :cols]
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, want)
            assert torch.equal(backend.kv_cache, want_cache)


def test_engine_decodes_the_same_with_and_without_it(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    from test_gpu_engine import _core, _greedy

    path = _checkpoint("qwen3", str(tmp_path / "qwen3"))
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(5, 300))] for _ in range(20)]
    results = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("SIESTA_BATCH_DECODE", flag)
        core = _core(path, max_model_len=1024)
        assert (core.runner.model.model.batch_decode is not None) == (flag == "1")
        results[flag] = _greedy(core, prompts, 24)
        del core
        torch.cuda.empty_cache()
    (ids_on, lps_on), (ids_off, lps_off) = results["1"], results["0"]
    assert ids_on == ids_off
    for a, b in zip(lps_on, lps_off, strict=True):
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 0.05
