"""The two decode paths built on engine/kernels/rope_decode.py's kernel, on a GPU (`pytest -m
gpu` on the device machine), on the tiny checkpoints of test_gpu_fused_decode.py (Qwen3: q/k
norm, tied embeddings; Llama: llama3 rope scaling; Qwen2: q/k/v bias), bf16, Triton attention, a
random KV cache.

The two-launches-per-layer decode (engine/decode/batch_decode.py, batch_kernel.py):
- decode steps of 1, 5, 16, 33 and 64 rows (up to 8 rows, wider GEMV items): the hidden states and the new K/V rows equal the
  layer-by-layer forward's within bf16 rounding, and no other cache row changes;
- graph padding (rows of seq_len 0, slot -1) writes nothing and leaves the real rows' results;
- captured in a CUDA graph, replays equal the eager call for new inputs;
- through the engine: greedy decoding of a batch with it gives the tokens and logprobs of the
  engine without it (`--no-batch-decode`).

The layers' decode attention (`DecodeAttention`: norm, rope, K/V store and split-KV attention in
one launch), against the same layers with the separate kernels (fused rotary, store_kv, split-KV
decode and its reduce):
- decode steps of 1, 5, 64 and 100 rows (one row: the most splits, merged in the kernel; 100: past
  every persistent path): hidden states and new K/V rows within bf16 rounding, layer 0's V rows
  bit for bit, no other cache row changed; only steps of one wave of programs take it;
- graph padding and graph replays as above;
- through the engine, the persistent decode paths off: greedy decoding gives the tokens and
  logprobs of the engine with `--no-rope-decode`.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

import pytest
import torch
from test_gpu_fused_decode import (
    _checkpoint,
    _decode_step,
    barrier_garbage_is_cleared_by_after_resume,
    engine_same_with_and_without,
    graph_replays_equal_eager,
    has_path,
    matches_the_layers,
    model_path,
    padding_rows_write_nothing,
    tiny_model,
)

from engine.attention import ForwardContext

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(scope="module", params=["qwen3", "llama", "qwen2"])
def setup(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(model, backend, BatchDecode, DecodeAttention): neither path set on the model."""
    from engine.decode import batch_decode, decode_attention

    model, backend = tiny_model(request.param, tmp_path_factory, max_num_seqs=128)  # room for 100 rows
    assert batch_decode.unsupported(model, backend) is None and decode_attention.unsupported(model, backend) is None
    return model, backend, batch_decode.BatchDecode(model, backend, 1, 64), decode_attention.DecodeAttention(model, backend)


@contextmanager
def attached(model, attention) -> Iterator[None]:
    """The layers' decode attention set on every layer inside."""
    model.model.use_decode_paths([], attention)
    try:
        yield
    finally:
        model.model.use_decode_paths([], None)


# ---- the batch decode ---------------------------------------------------------------------------


@pytest.mark.parametrize("rows", [1, 5, 16, 33, 64])
def test_batch_decode_equals_the_layers(setup, rows: int) -> None:
    model, backend, batch, _ = setup
    step = _decode_step(rows, seed=rows, vocab=model.config.vocab_size)
    assert batch.applies(step.input_ids, ForwardContext(backend, step.meta))
    new_batch, new_plain = matches_the_layers(model, backend, step, lambda: model_path(model, batch))
    # Layer 0's K/V come before any attention: its qkv split-K order moves an element an ULP at most.
    torch.testing.assert_close(new_batch.float(), new_plain.float(), rtol=1 / 128, atol=1e-2)


def test_padding_rows_write_nothing_and_leave_the_real_rows(setup) -> None:
    model, backend, batch, _ = setup
    padding_rows_write_nothing(model, backend, batch, 6)


def test_barrier_is_kept_across_steps_and_zeroed_after_a_resume(setup) -> None:
    model, backend, batch, _ = setup
    barrier_garbage_is_cleared_by_after_resume(model, backend, batch, 12)


def test_graph_replays_equal_the_eager_call(setup) -> None:
    model, backend, batch, _ = setup
    graph_replays_equal_eager(model, backend, batch, 24, 100)


def test_engine_decodes_the_same_with_and_without_it(tmp_path) -> None:
    rng = random.Random(1)  # 20 requests: decode steps of 5..20 rows
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(5, 300))] for _ in range(20)]
    from engine.decode.batch_decode import BatchDecode

    engine_same_with_and_without(_checkpoint("qwen3", str(tmp_path / "qwen3")), "batch_decode", has_path(BatchDecode), prompts)


# ---- the layers' decode attention ---------------------------------------------------------------


@pytest.mark.parametrize("rows", [1, 5, 64, 100])
def test_rope_decode_equals_the_separate_kernels(setup, rows: int) -> None:
    model, backend, _, attention = setup
    step = _decode_step(rows, seed=rows, vocab=model.config.vocab_size)
    assert attention.applies(torch.empty(rows, 8, device="cuda"), ForwardContext(backend, step.meta))
    new_fold, new_plain = matches_the_layers(model, backend, step, lambda: attached(model, attention))
    # Layer 0: the same qkv output; v is stored as it is, k after the same norm and rope roundings
    # (the norm's sum of squares in another order may move an element an ULP).
    assert torch.equal(new_fold[1], new_plain[1])
    torch.testing.assert_close(new_fold[0].float(), new_plain[0].float(), rtol=1 / 128, atol=1e-2)


def test_rope_decode_takes_only_steps_of_one_wave(setup) -> None:
    """Past one wave of programs (rows x Hkv > the backend's wave) the layers keep the separate
    kernels; a prefill step never takes it."""
    model, backend, _, attention = setup
    wave_rows = backend.wave_programs // model.config.num_kv_heads
    step = _decode_step(4, seed=3, vocab=model.config.vocab_size)
    for rows, fits in ((wave_rows, True), (wave_rows + 1, False)):
        meta = replace(step.meta, seq_lens=torch.zeros(rows, dtype=torch.int32, device="cuda"))
        assert attention.applies(torch.empty(rows, 8, device="cuda"), ForwardContext(backend, meta)) == fits
    prefill = replace(step.meta, max_query_len=2)
    assert not attention.applies(torch.empty(4, 8, device="cuda"), ForwardContext(backend, prefill))


def test_rope_decode_padding_rows_write_nothing(setup) -> None:
    model, backend, _, attention = setup
    with attached(model, attention):
        padding_rows_write_nothing(model, backend, model, 6)


def test_rope_decode_graph_replays_equal_the_eager_call(setup) -> None:
    model, backend, _, attention = setup
    with attached(model, attention):
        graph_replays_equal_eager(model, backend, model, 24, 100)


def test_engine_decodes_the_same_with_and_without_rope_decode(tmp_path) -> None:
    rng = random.Random(2)  # 20 requests: decode steps of 1..20 rows
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(5, 300))] for _ in range(20)]
    engine_same_with_and_without(
        _checkpoint("qwen3", str(tmp_path / "qwen3")), "rope_decode",
        lambda core: core.runner.model.model.layers[0].self_attn.decode_attention is not None, prompts,
        fused_decode=False, batch_decode=False,  # every decode step through the layers
    )  # fmt: skip
