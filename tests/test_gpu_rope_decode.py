"""The layers' decode attention with rope folded in (engine/models/batch_attention.py
`DecodeAttention`) on a GPU (`pytest -m gpu` on the device machine), on the tiny checkpoints of
test_gpu_fused_decode.py (Qwen3: q/k norm; Llama: llama3 rope scaling; Qwen2: q/k/v bias), bf16,
Triton attention, a random KV cache. Against the same layers with the separate kernels (fused
rotary, store_kv, split-KV decode and its reduce):

- decode steps of 1, 5, 64 and 100 rows (one row: the most splits, merged in the kernel; 100: past
  every persistent path): the hidden states and new K/V rows equal within bf16 rounding, layer 0's
  V rows bit for bit, and no other cache row changes;
- graph padding (rows of seq_len 0, slot -1) writes nothing and leaves the real rows' results;
- captured in a CUDA graph, replays equal the eager call for new inputs;
- through the engine, the persistent decode paths off: greedy decoding gives the tokens and
  logprobs of the engine with SIESTA_ROPE_DECODE=0.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

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
from test_piecewise_graph import load_model, random_cache, written

from engine.attention import ForwardContext

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(scope="module", params=["qwen3", "llama", "qwen2"])
def setup(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    from engine.attention.triton import TritonBackend
    from engine.models.batch_attention import DecodeAttention, unsupported

    path = _checkpoint(request.param, str(tmp_path_factory.mktemp(request.param)))
    model = load_model(path, torch.bfloat16, "cuda")
    cache = random_cache(model, torch.bfloat16, "cuda")
    c = model.config  # room for 100 rows (test_piecewise_graph's backends take 64)
    backend = TritonBackend(cache, scale=c.head_dim**-0.5, num_heads=c.num_heads, max_num_seqs=128, max_model_len=1024)
    assert unsupported(model, backend) is None
    return model, backend, DecodeAttention(model, backend)


@contextmanager
def attached(model, attention) -> Iterator[None]:
    attention.attach(model)
    try:
        yield
    finally:
        for layer in model.model.layers:
            layer.self_attn.rope_decode = None


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item() / b.float().abs().max().item()


@pytest.mark.parametrize("rows", [1, 5, 64, 100])
def test_rope_decode_equals_the_separate_kernels(setup, rows: int) -> None:
    model, backend, attention = setup
    step = _decode_step(rows, seed=rows, vocab=model.config.vocab_size)
    ctx = ForwardContext(backend, step.meta)
    cache0 = backend.kv_cache.clone()
    with torch.inference_mode():
        plain = model(step.input_ids, step.positions, ctx)
        plain_cache = backend.kv_cache.clone()
        backend.kv_cache.copy_(cache0)
        with attached(model, attention):
            assert attention.applies(torch.empty(rows, 1, device="cuda"), ctx)
            out = model(step.input_ids, step.positions, ctx)
        torch.cuda.synchronize()
    assert out.shape == plain.shape and torch.isfinite(out).all()
    assert _rel(out, plain) < TOLERANCE
    new_plain, rest_plain = written(plain_cache, step.slots)
    new_fold, rest_fold = written(backend.kv_cache, step.slots)
    # Layer 0: the same qkv output; v is stored as it is, k after the same norm and rope roundings
    # (the norm's sum of squares in another order may move an element an ULP).
    assert torch.equal(new_fold[0, 1], new_plain[0, 1])
    torch.testing.assert_close(new_fold[0, 0].float(), new_plain[0, 0].float(), rtol=1 / 128, atol=1e-2)
    assert _rel(new_fold, new_plain) < TOLERANCE
    assert torch.equal(rest_fold, written(cache0, step.slots)[1])
    assert torch.equal(rest_plain, rest_fold)


def test_only_steps_of_one_wave(setup) -> None:
    """Past one wave of programs (rows x Hkv > the backend's wave) the layers keep the separate
    kernels; a prefill step never takes it."""
    model, backend, attention = setup
    wave_rows = backend.wave_programs // model.config.num_kv_heads
    step = _decode_step(4, seed=3, vocab=model.config.vocab_size)
    for rows, fits in ((wave_rows, True), (wave_rows + 1, False)):
        meta = replace(step.meta, seq_lens=torch.zeros(rows, dtype=torch.int32, device="cuda"))
        assert attention.applies(torch.empty(rows, 8, device="cuda"), ForwardContext(backend, meta)) == fits
    prefill = replace(step.meta, max_query_len=2)
    assert not attention.applies(torch.empty(4, 8, device="cuda"), ForwardContext(backend, prefill))


def test_padding_rows_write_nothing_and_leave_the_real_rows(setup) -> None:
    model, backend, attention = setup
    with attached(model, attention):
        padding_rows_write_nothing(model, backend, model, 6)


def test_graph_replays_equal_the_eager_call(setup) -> None:
    model, backend, attention = setup
    with attached(model, attention):
        graph_replays_equal_eager(model, backend, model, 24, 100)


def test_engine_decodes_the_same_with_and_without_it(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SIESTA_FUSED_DECODE", "0")  # every decode step through the layers
    monkeypatch.setenv("SIESTA_BATCH_DECODE", "0")
    rng = random.Random(2)  # 20 requests: decode steps of 1..20 rows
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(5, 300))] for _ in range(20)]
    engine_same_with_and_without(
        _checkpoint("qwen3", str(tmp_path / "qwen3")), monkeypatch, "SIESTA_ROPE_DECODE", "layers.0.self_attn.rope_decode",
        prompts,
    )  # fmt: skip
