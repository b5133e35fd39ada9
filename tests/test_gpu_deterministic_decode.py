"""`--deterministic`'s batch decode (engine/decode/batch_decode.py `invariant`, batch_kernel.py
INVARIANT) on a GPU (`pytest -m gpu` on the device machine): the persistent kernel in the invariant
GEMM's K order, its last phase the rotary and the K/V store, before the fixed-split attention,
against the mode's layers one op at a time (models/invariant.py installed,
engine/attention/triton_fixed.py), on test_gpu_fused_decode.py's checkpoints of Qwen3-0.6B's layer
(hidden 1024, intermediate 3072, 16 heads of 128, 8 KV heads: K in 2 to 6 chunks) as Qwen3 and as
Llama, bf16, a random KV cache:
- decode steps of 1 to 64 rows: the hidden states and the whole cache after, bit for bit (steps
  of at most batch_consts.ATTEND_ROWS rows with the attention inside the launch);
- graph padding writes nothing; graph replays equal the eager call; the barrier is kept across
  steps and zeroed after a resume;
- not served: a model with qkv bias (Qwen2: the kernel's qkv sum adds none); a shape whose norm and
  rotary kernels run other warps than the kernel (the tiny Qwen3: hidden 256, 4 heads of 64).
"""

from __future__ import annotations

import pytest
import torch
from test_gpu_fused_decode import (
    _decode_step,
    barrier_garbage_is_cleared_by_after_resume,
    graph_replays_equal_eager,
    model_path,
    padding_rows_write_nothing,
    tiny_model,
    with_and_without,
)

from engine.attention import ForwardContext
from engine.decode import batch_consts, batch_decode

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

LAYER_06B = dict(hidden_size=1024, intermediate_size=3072, head_dim=128, num_attention_heads=16, num_key_value_heads=8)


def mode_model(arch: str, tmp_path_factory: pytest.TempPathFactory, **shape: object):
    """(the bf16 model on CUDA with the mode's matmuls installed, the mode's fixed-split backend
    over a random KV cache)."""
    from engine.attention.triton_fixed import FixedSplitBackend
    from engine.models import invariant

    model, backend = tiny_model(arch, tmp_path_factory, max_num_seqs=128, backend_cls=FixedSplitBackend, **shape)
    invariant.install(model, torch.device("cuda"), invariant.reserve(torch.device("cuda")))
    return model, backend


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def setup(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    model, backend = mode_model(request.param, tmp_path_factory, **LAYER_06B)
    assert batch_decode.unsupported(model, backend, invariant=True) is None
    return model, backend, batch_decode.BatchDecode(model, backend, 1, 64, invariant=True)


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 16, 17, 33, 64])
def test_the_invariant_batch_decode_gives_the_layers_bits(setup, rows: int) -> None:
    model, backend, batch = setup
    assert batch.attend_rows == batch_consts.ATTEND_ROWS == 4
    step = _decode_step(rows, seed=rows, vocab=model.config.vocab_size)
    assert batch.applies(step.input_ids, ForwardContext(backend, step.meta))
    plain, plain_cache, out, cache, _ = with_and_without(model, backend, step, lambda: model_path(model, batch))
    assert torch.isfinite(out).all()
    assert torch.equal(out, plain), (out.float() - plain.float()).abs().max().item()
    assert torch.equal(cache, plain_cache)


# rows 2 (4 with its padding), 1 and 3: steps whose launches attend (batch_consts.ATTEND_ROWS); 6, 12 and 24: not;
# 20 (40 with its padding) and 40: past batch_consts.ROPE_LATER_ROWS, their attention summing and rotating the qkv partials
@pytest.mark.parametrize("rows", [2, 6, 20])
def test_padding_rows_write_nothing_and_leave_the_real_rows(setup, rows: int) -> None:
    model, backend, batch = setup
    padding_rows_write_nothing(model, backend, batch, rows)


@pytest.mark.parametrize("rows", [1, 12])
def test_barrier_is_kept_across_steps_and_zeroed_after_a_resume(setup, rows: int) -> None:
    model, backend, batch = setup
    barrier_garbage_is_cleared_by_after_resume(model, backend, batch, rows)


@pytest.mark.parametrize("rows", [3, 24, 40])
def test_graph_replays_equal_the_eager_call(setup, rows: int) -> None:
    model, backend, batch = setup
    graph_replays_equal_eager(model, backend, batch, rows, 100)


def test_a_model_with_qkv_bias_is_not_served(tmp_path_factory: pytest.TempPathFactory) -> None:
    model, backend = mode_model("qwen2", tmp_path_factory)
    assert "qkv bias" in batch_decode.unsupported(model, backend, invariant=True)


def test_a_shape_whose_norms_run_other_warps_is_not_served(tmp_path_factory: pytest.TempPathFactory) -> None:
    model, backend = mode_model("qwen3", tmp_path_factory)
    assert "warps" in batch_decode.unsupported(model, backend, invariant=True)
