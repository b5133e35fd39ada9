"""engine/attention/layer_replay.py on a GPU: a step's attention planned once (`TritonBackend.
layer_forward`) over several layers, each layer after the first relaunching the first's kernels
with its own q/k/v and cache, against `forward` per layer: the same outputs and KV cache bit for
bit, for a prefill step, a mixed step (decode rows with splits) and a decode step (whose
kernels get views of q and out); a layer whose tensors do not fit the recorded variant (a
misaligned q, other strides) runs through `forward` and is right too. GPU only: every test
skips without CUDA."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
import torch
from test_piecewise_graph import (
    BLOCK_SIZE,
    MAX_MODEL_LEN,
    MAX_NUM_SEQS,
    NUM_BLOCKS,
    make_step,
    mixed_specs,
)

if TYPE_CHECKING:  # Triton is imported on CUDA machines only
    from engine.attention import AttentionMetadata
    from engine.attention.layer_replay import LayerReplay
    from engine.attention.triton import TritonBackend

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

LAYERS, H, HKV, D = 5, 8, 2, 64


def _backend(cache: torch.Tensor) -> TritonBackend:
    from engine.attention.triton import TritonBackend

    return TritonBackend(cache, scale=D**-0.5, num_heads=H, max_num_seqs=MAX_NUM_SEQS, max_model_len=MAX_MODEL_LEN)


def _layer_inputs(rows: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per layer (q, k, v), [rows, heads, D] views of one fused qkv buffer, as a qkv projection leaves them."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = []
    for _ in range(LAYERS):
        qkv = torch.randn(rows, (H + 2 * HKV) * D, device="cuda", generator=g).to(torch.bfloat16)
        q, k, v = qkv.split([H * D, HKV * D, HKV * D], dim=1)
        out.append((q.view(rows, H, D), k.view(rows, HKV, D), v.view(rows, HKV, D)))
    return out


def _cache(seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    shape = (LAYERS, 2, NUM_BLOCKS, BLOCK_SIZE, HKV, D)
    return torch.randn(shape, device="cuda", generator=g).to(torch.bfloat16)


def _planned_runs(backend: TritonBackend, cache: torch.Tensor, cache0: torch.Tensor, meta: AttentionMetadata, n: int,
                  inputs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                  out: torch.Tensor) -> tuple[list[torch.Tensor], LayerReplay]:
    """Every layer through one `layer_forward` plan into the one `out`, twice from `cache0` (the
    first run may compile): the second run's per-layer outputs and its plan."""
    for _ in range(2):
        cache.copy_(cache0)
        attend = backend.layer_forward(meta, n)
        got = []
        for layer, (q, k, v) in enumerate(inputs):
            attend(layer, q, k, v, out)
            got.append(out.clone())
    return got, attend


@pytest.mark.parametrize("specs", [
    pytest.param([(0, 40), (23, 17)], id="prefill"),
    pytest.param(mixed_specs(90, seed=4, num_decode=12), id="mixed"),
    pytest.param([(30 + 7 * i, 1) for i in range(10)], id="decode"),
])
def test_replayed_layers_equal_forward_per_layer(specs: list[tuple[int, int]]) -> None:
    step = make_step(specs, "cuda", 1000, seed=7)
    n = step.num_tokens
    pad = 6  # padding rows past the step's: left as they are in out
    inputs = _layer_inputs(n + pad, seed=1)
    cache0 = _cache(seed=2)
    results = []
    for planned in (False, True):
        cache = cache0.clone()
        backend = _backend(cache)
        outs = []
        for _ in range(2):  # the first run may compile (its launches then take the JIT path)
            outs = []
            cache.copy_(cache0)
            attend = backend.layer_forward(step.meta, n)
            for layer, (q, k, v) in enumerate(inputs):
                out = torch.full((n + pad, H, D), 7.0, dtype=torch.bfloat16, device="cuda")
                if planned:
                    attend(layer, q, k, v, out)
                else:
                    backend.forward(layer, q[:n], k[:n], v[:n], step.meta, out=out[:n])
                outs.append(out)
        if planned:
            assert attend.replayed == 0, "each layer's out is another buffer: none may be relaunched"
        results.append((outs, cache))
    (want, want_kv), (got, got_kv) = results
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert torch.equal(got_kv, want_kv)

    # One out buffer for every layer (as the piecewise graphs have): layers 1.. relaunch.
    cache = cache0.clone()
    backend = _backend(cache)
    out = torch.full((n + pad, H, D), 7.0, dtype=torch.bfloat16, device="cuda")
    got, attend = _planned_runs(backend, cache, cache0, step.meta, n, inputs, out)
    assert attend.replayed == LAYERS - 1
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), "a relaunched layer differs from forward"
    assert torch.equal(cache, want_kv), "a relaunched layer's KV writes differ from forward's"
    assert torch.equal(out[n:], torch.full_like(out[n:], 7.0)), "a padding row of out was written"


def test_a_layer_that_does_not_fit_the_recorded_variant_runs_through_forward() -> None:
    step = make_step(mixed_specs(50, seed=5, num_decode=4), "cuda", 1000, seed=5)
    n = step.num_tokens
    inputs = _layer_inputs(n, seed=3)
    misfit = torch.randn(n * H * D + 1, device="cuda").to(torch.bfloat16)[1:].view(n, H, D)  # 2 bytes off 16
    strided = torch.randn(n, H, 2 * D, device="cuda").to(torch.bfloat16)[:, :, :D]  # another row stride
    inputs[2] = (misfit, *inputs[2][1:])
    inputs[3] = (strided, *inputs[3][1:])
    cache0 = _cache(seed=6)
    cache = cache0.clone()
    backend = _backend(cache)
    want = []
    for layer, (q, k, v) in enumerate(inputs):
        out = torch.empty(n, H, D, dtype=torch.bfloat16, device="cuda")
        backend.forward(layer, q, k, v, step.meta, out=out)
        want.append(out)
    want_kv = cache.clone()
    out = torch.empty(n, H, D, dtype=torch.bfloat16, device="cuda")
    got, attend = _planned_runs(backend, cache, cache0, step.meta, n, inputs, out)
    assert attend.replayed == LAYERS - 3, "the misaligned and the strided layer must not be relaunched"
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert torch.equal(cache, want_kv)
