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

import pytest
import torch
from test_gpu_fused_decode import (
    TOLERANCE,
    _checkpoint,
    _decode_step,
    engine_same_with_and_without,
    graph_replays_equal_eager,
    padding_rows_write_nothing,
)
from test_piecewise_graph import load_model, make_backend, random_cache, written

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
    padding_rows_write_nothing(model, backend, batch, 6)


def test_graph_replays_equal_the_eager_call(setup) -> None:
    model, backend, batch = setup
    graph_replays_equal_eager(model, backend, batch, 24, 100)


def test_engine_decodes_the_same_with_and_without_it(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(1)  # 20 requests: decode steps of 5..20 rows
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(5, 300))] for _ in range(20)]
    engine_same_with_and_without(_checkpoint("qwen3", str(tmp_path / "qwen3")), monkeypatch, "SIESTA_BATCH_DECODE", "batch_decode", prompts)
