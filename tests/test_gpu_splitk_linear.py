"""The split-K row-parallel linears (engine/kernels/splitk_linear.py) and the fused RMSNorm that sums
their parts, on a GPU (`pytest -m gpu` on the device machine):
- the parts sum to the product (fp32 reference on the same bf16 inputs), for the rows and widths
  the rule takes (1-16 rows in 32-column tiles and 2 or 4 chunks, 17-64 in 64-column tiles and 2),
  and the rule refuses the rest (65 rows, narrow weights, fp32);
- the fused add-norm of the parts equals the fused add-norm of their sum rounded to bf16, output
  and residual bit for bit: the parts change no rounding;
- a Qwen3 layer stack of the 8B's widths (hidden 4096, 2 layers) decoding 1..64 rows with the
  parts equals the same forward on cuBLAS within bf16 rounding, new K/V rows included, and so
  does a Qwen2 one (q/k/v bias);
- the qkv projection as parts (`qkv_chunks`, 1-16 rows, at a fixed stride of 16 rows): the layers'
  decode attention on them (engine/decode/decode_attention.py, the bias added in the kernel)
  equals the layers on cuBLAS and the separate attention kernels within bf16 rounding, layer 0's
  new V rows within an ULP.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY, _randomized, _save
from test_gpu_batch_decode import attached
from test_gpu_fused_decode import _decode_step, matches_the_layers
from test_piecewise_graph import MAX_MODEL_LEN, load_model, random_cache
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from engine.attention import ForwardContext
from engine.kernels import SWITCHES

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _bf16(*shape: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, device="cuda", generator=g).to(torch.bfloat16)


@pytest.mark.parametrize("m,n,k,ks", [(1, 2048, 4096, 4), (1, 4096, 4096, 2), (5, 4096, 12288, 2), (16, 2048, 4096, 4),
                                      (17, 4096, 4096, 2), (40, 4096, 12288, 2), (64, 4096, 4096, 2), (64, 8192, 4096, 2)])
def test_parts_sum_to_the_product(m: int, n: int, k: int, ks: int) -> None:
    from engine.kernels import splitk_linear

    x, w = _bf16(m, k, seed=m), _bf16(n, k, seed=n) * 0.02
    assert splitk_linear.applies(x, w)
    parts = splitk_linear.splitk_parts(x, w)
    assert parts.shape == (ks, m, n) and parts.dtype == torch.float32
    ref = F.linear(x.float(), w.float())
    assert ((parts.sum(0) - ref).abs().max() / ref.abs().max()).item() < 1e-5


def test_the_rule_takes_only_wide_weights_of_1_to_64_half_rows() -> None:
    from engine.kernels import splitk_linear

    w = _bf16(4096, 4096, seed=1)
    for m, ok in ((1, True), (16, True), (17, True), (64, True), (65, False)):
        assert splitk_linear.applies(_bf16(m, 4096, seed=m), w) == ok
    assert not splitk_linear.applies(_bf16(32, 1024, seed=2), _bf16(1024, 1024, seed=3))  # 32 programs
    assert not splitk_linear.applies(_bf16(1, 2048, seed=2), _bf16(1024, 2048, seed=3))  # 4 x 32 programs
    assert not splitk_linear.applies(_bf16(32, 4096, seed=2).float(), w.float())


def test_qkv_parts_at_1_to_16_rows_at_a_fixed_stride() -> None:
    from engine.kernels import splitk_linear

    w = _bf16(6144, 4096, seed=8) * 0.02  # the 8B's qkv
    for m, ks in ((1, 2), (16, 2), (17, None)):
        assert splitk_linear.qkv_chunks(_bf16(m, 4096, seed=m), w) == ks
    assert splitk_linear.qkv_chunks(_bf16(1, 1024, seed=1), _bf16(1024, 1024, seed=2)) is None  # 64 programs
    x = _bf16(5, 4096, seed=9)
    parts = splitk_linear.splitk_parts(x, w, rows=16)
    assert parts.shape == (2, 16, 6144)
    ref = F.linear(x.float(), w.float())
    assert ((parts[:, :5].sum(0) - ref).abs().max() / ref.abs().max()).item() < 1e-5
    with pytest.raises(ValueError, match="rows"):
        splitk_linear.splitk_parts(x, w, rows=4)


@pytest.mark.parametrize("m", [1, 17, 64])
def test_norm_of_the_parts_equals_the_norm_of_their_rounded_sum(m: int) -> None:
    from engine.kernels import fused_ops, splitk_linear

    x, w = _bf16(m, 4096, seed=m), _bf16(4096, 4096, seed=5) * 0.02
    parts = splitk_linear.splitk_parts(x, w)
    norm_w = (1 + 0.1 * _bf16(4096, seed=6).float()).to(torch.bfloat16)
    residual = _bf16(m, 4096, seed=7)
    out_parts, res_parts = fused_ops.fused_add_rms_norm(parts, residual.clone(), norm_w, 1e-6)
    out_sum, res_sum = fused_ops.fused_add_rms_norm(parts.sum(0).to(torch.bfloat16), residual.clone(), norm_w, 1e-6)
    assert torch.equal(res_parts, res_sum) and torch.equal(out_parts, out_sum)
    with pytest.raises(ValueError, match="parts"):
        fused_ops.fused_add_rms_norm(parts[:, :-1], residual.clone(), norm_w, 1e-6)


FAMILIES = {"qwen3": (Qwen3Config, Qwen3ForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}


@pytest.fixture(scope="module", params=list(FAMILIES))
def wide(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(bf16 Qwen3 / Qwen2 of hidden 4096 on CUDA, a Triton backend over a random cache), parts off."""
    from engine.attention.triton import TritonBackend

    config_cls, model_cls = FAMILIES[request.param]
    config = config_cls(**(TINY | dict(hidden_size=4096, intermediate_size=4096, head_dim=128, max_position_embeddings=1024)),
                        num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True)  # fmt: skip
    path = _save(_randomized(model_cls, config, seed=15), str(tmp_path_factory.mktemp("wide")))
    model = load_model(path, torch.bfloat16, "cuda")
    c = model.config
    backend = TritonBackend(random_cache(model, torch.bfloat16, "cuda"), scale=c.head_dim**-0.5, num_heads=c.num_heads,
                            max_num_seqs=64, max_model_len=MAX_MODEL_LEN)  # fmt: skip
    enabled = SWITCHES.splitk_linear
    SWITCHES.splitk_linear = False
    yield model, backend
    SWITCHES.splitk_linear = enabled


@contextmanager
def parts_on() -> Iterator[None]:
    SWITCHES.splitk_linear = True
    try:
        yield
    finally:
        SWITCHES.splitk_linear = False


@pytest.mark.parametrize("rows", [1, 16, 17, 40, 64])
def test_layers_with_the_parts_equal_the_layers_on_cublas(wide, rows: int) -> None:
    from engine.models import linear

    model, backend = wide
    o = model.model.layers[0].self_attn.o_proj
    x = torch.zeros(rows, o.weight.shape[1], dtype=torch.bfloat16, device="cuda")
    assert linear.splitk_for(x, o.weight) is None
    with parts_on():
        assert linear.splitk_for(x, o.weight) is not None  # the step below takes the parts
    step = _decode_step(rows, seed=rows, vocab=model.config.vocab_size)
    new_parts, new_plain = matches_the_layers(model, backend, step, parts_on)
    torch.testing.assert_close(new_parts.float(), new_plain.float(), rtol=1 / 128, atol=1e-2)


@pytest.mark.parametrize("rows", [1, 5, 16])
def test_decode_attention_on_the_qkv_parts_equals_the_layers(wide, rows: int) -> None:
    from engine.decode.decode_attention import DecodeAttention
    from engine.kernels import splitk_linear

    model, backend = wide
    attention = DecodeAttention(model, backend)
    qkv = model.model.layers[0].self_attn.qkv_proj
    x = torch.zeros(rows, qkv.weight.shape[1], dtype=torch.bfloat16, device="cuda")
    with parts_on():
        assert splitk_linear.qkv_chunks(x, qkv.weight) == 2  # the step below takes the qkv parts

    @contextmanager
    def on() -> Iterator[None]:
        with parts_on(), attached(model, attention):
            yield

    step = _decode_step(rows, seed=rows + 1, vocab=model.config.vocab_size)
    assert attention.applies(x, ForwardContext(backend, step.meta))  # ... through the decode attention
    new_parts, new_plain = matches_the_layers(model, backend, step, on)
    # Layer 0's V rows: the same fp32 products summed in another order, one rounding: an ULP
    # apart at most (its K rows go on through the norm and rope, which may widen that).
    torch.testing.assert_close(new_parts[1].float(), new_plain[1].float(), rtol=2**-7, atol=1e-3)
