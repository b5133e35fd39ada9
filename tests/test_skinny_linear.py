"""The few-rows matmul of engine/kernels/skinny_linear.py on a GPU (`pytest -m gpu`), against fp32
math on the same half-precision inputs and against cuBLAS (F.linear) on them:

- its error from the fp32 result is within bf16/fp16 rounding of cuBLAS's own (both accumulate in
  fp32, in different orders, and round once);
- with `silu_mul` it equals the unfused ops applied to its own plain output (gate | up rounded,
  then layers.SiluAndMul's torch code) bit for bit: the epilogue rounds where they round;
- a row's result does not depend on how many rows run with it (a graph padded to 64 rows gives
  the rows of an eager forward of 5 the same bits), and a CUDA-graph replay equals the eager call;
- bias, K and N that are not multiples of the blocks, fp16; bad inputs are refused;
- `prefetch` (a PDL launch that runs ahead of the kernel before it, engine/kernels/pdl.py) reads its x
  only after that kernel has written it: a graph of norm -> GEMV -> norm -> ... chained calls
  gives the bits of the same chain without it, replay after replay;
- the logits (a vocabulary-sized N, `LOGITS_CONFIG`, into a caller's `out`): as close to fp32 as
  cuBLAS, and the model's `compute_logits` of a few rows is that call, in a graph's static
  buffer too.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.models.layers import SiluAndMul

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# (N, K): a 0.6B layer shape, and one whose N and K are multiples of no block.
SHAPES = [(4096, 1024), (1000, 200)]
ROWS = [1, 5, 16, 33, 64]  # up to KERNEL_MAX_ROWS (layers use it up to MAX_ROWS)


def _inputs(m: int, n: int, k: int, dtype: torch.dtype, bias: bool, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", dtype=dtype, generator=g)
    w = torch.randn(n, k, device="cuda", dtype=dtype, generator=g) * k**-0.5
    b = torch.randn(n, device="cuda", dtype=dtype, generator=g) if bias else None
    return x, w, b


def _fp32(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.float(), w.float(), None if b is None else b.float())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("bias", [False, True])
def test_matches_fp32_as_closely_as_cublas(dtype: torch.dtype, shape: tuple[int, int], m: int, bias: bool) -> None:
    from engine.kernels.skinny_linear import skinny_linear

    n, k = shape
    x, w, b = _inputs(m, n, k, dtype, bias)
    exact = _fp32(x, w, b)
    ours = skinny_linear(x, w, b)
    theirs = F.linear(x, w, b)
    assert ours.shape == (m, n) and ours.dtype == dtype
    err_ours = (ours.float() - exact).abs().max().item()
    err_cublas = (theirs.float() - exact).abs().max().item()
    ulp = exact.abs().max().item() * (2**-8 if dtype == torch.bfloat16 else 2**-11)
    assert err_ours <= max(1.5 * err_cublas, ulp), (err_ours, err_cublas)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("bias", [False, True])
def test_silu_mul_epilogue_rounds_as_the_unfused_ops(dtype: torch.dtype, m: int, bias: bool) -> None:
    from engine.kernels.skinny_linear import skinny_linear

    x, w, b = _inputs(m, 2 * 3072, 1024, dtype, bias, seed=1)
    # The same column blocks both ways, so each accumulator sums in the same order.
    fused = skinny_linear(x, w, b, silu_mul=True, block_n=32)
    plain = torch.cat([skinny_linear(x[i : i + 16], w, b, block_n=32) for i in range(0, m, 16)])
    unfused = SiluAndMul(fused=False)(plain)
    assert fused.shape == (m, 3072)
    assert torch.equal(fused, unfused)


def test_rows_are_independent_and_a_graph_replays_the_same_bits() -> None:
    from engine.kernels.skinny_linear import KERNEL_MAX_ROWS, skinny_linear

    for rows, silu_mul in ((KERNEL_MAX_ROWS, False), (KERNEL_MAX_ROWS, True)):
        x, w, b = _inputs(rows, 4096, 1024, torch.bfloat16, True, seed=2)
        full = skinny_linear(x, w, b, silu_mul=silu_mul)
        for m in (1, 5, 15, 17, 63):
            if m <= rows:
                assert torch.equal(skinny_linear(x[:m].clone(), w, b, silu_mul=silu_mul), full[:m]), (m, silu_mul)
        static_x = x.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = skinny_linear(static_x, w, b, silu_mul=silu_mul)
        static_x.copy_(torch.randn_like(x))
        graph.replay()
        assert torch.equal(out, skinny_linear(static_x, w, b, silu_mul=silu_mul))


def test_prefetching_gemvs_wait_for_the_kernel_before_them() -> None:
    from engine.kernels import fused_ops
    from engine.kernels.skinny_linear import skinny_linear

    n = k = 2048
    g = torch.Generator(device="cuda").manual_seed(3)
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * k**-0.5 for _ in range(8)]
    norm_w = torch.randn(k, device="cuda", dtype=torch.bfloat16, generator=g)
    x0 = torch.randn(1, k, device="cuda", dtype=torch.bfloat16, generator=g)
    res0 = torch.randn(1, k, device="cuda", dtype=torch.bfloat16, generator=g)

    def chain(x: torch.Tensor, res: torch.Tensor, prefetch: bool) -> torch.Tensor:
        for w in ws * 3:  # each GEMV reads the norm's output, the next norm the GEMV's
            h, res = fused_ops.fused_add_rms_norm(x, res, norm_w, 1e-6)
            x = skinny_linear(h, w, silu_mul=False, prefetch=prefetch)
        return x

    want = chain(x0, res0.clone(), prefetch=False)
    x_in, res_in = x0.clone(), res0.clone()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        chain(x_in, res0.clone(), prefetch=True)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(x_in, res_in, prefetch=True)
    for _ in range(20):
        res_in.copy_(res0)
        graph.replay()
        assert torch.equal(out, want)
    res_in.copy_(res0)
    assert torch.equal(chain(x_in, res_in, prefetch=True), want)  # eager too


@pytest.mark.parametrize("m", [1, 7, 16])
def test_logits_config_writes_out_as_close_to_fp32_as_cublas(m: int) -> None:
    from engine.kernels.skinny_linear import LOGITS_CONFIG, skinny_linear

    x, w, _ = _inputs(m, 151936, 1024, torch.bfloat16, False, seed=4)
    exact = _fp32(x, w, None)
    out = torch.full((m, 151936), float("nan"), device="cuda", dtype=torch.bfloat16)
    got = skinny_linear(x, w, out=out, prefetch=True, **LOGITS_CONFIG)
    assert got.data_ptr() == out.data_ptr() and not out.isnan().any()
    assert torch.equal(out, skinny_linear(x, w, **LOGITS_CONFIG))  # in place or not, the same bits
    err_ours = (out.float() - exact).abs().max().item()
    err_cublas = (F.linear(x, w).float() - exact).abs().max().item()
    assert err_ours <= max(1.5 * err_cublas, exact.abs().max().item() * 2**-8), (err_ours, err_cublas)
    with pytest.raises(ValueError, match="out"):
        skinny_linear(x, w, out=out[:, :-1])


def test_the_models_few_row_logits_are_the_skinny_call_in_a_graph_too(tmp_path_factory: pytest.TempPathFactory) -> None:
    from test_gpu_fused_decode import tiny_model

    from engine.kernels.skinny_linear import LOGITS_CONFIG, skinny_linear

    model, _ = tiny_model("qwen3", tmp_path_factory)
    weight = model.model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    hidden = torch.randn(5, weight.shape[1], device="cuda", dtype=weight.dtype)
    want = skinny_linear(hidden, weight, **LOGITS_CONFIG)
    assert torch.equal(model.compute_logits(hidden), want)
    static = torch.empty(8, weight.shape[0], device="cuda", dtype=weight.dtype)
    graph = torch.cuda.CUDAGraph()
    model.compute_logits(hidden, out=static[:5])  # compiled outside the capture
    with torch.cuda.graph(graph):
        model.compute_logits(hidden, out=static[:5])
    static.zero_()
    graph.replay()
    assert torch.equal(static[:5], want)
    many = torch.randn(17, weight.shape[1], device="cuda", dtype=weight.dtype)  # past MAX_ROWS: cuBLAS
    assert torch.equal(model.compute_logits(many), torch.matmul(many, weight.T))


def test_no_pdl_turns_programmatic_launch_off() -> None:
    from engine.kernels import SWITCHES, configure, pdl

    hopper = torch.cuda.get_device_capability()[0] >= 9
    assert pdl.enabled(torch.device("cuda")) == hopper
    configure(pdl=False, fast_launch=SWITCHES.fast_launch, splitk_linear=SWITCHES.splitk_linear)
    try:
        assert not pdl.enabled(torch.device("cuda"))
    finally:
        configure(pdl=True, fast_launch=SWITCHES.fast_launch, splitk_linear=SWITCHES.splitk_linear)


def test_refuses_what_it_does_not_run() -> None:
    from engine.kernels.skinny_linear import KERNEL_MAX_ROWS, MAX_ROWS, applies, skinny_linear

    x, w, _ = _inputs(4, 256, 128, torch.bfloat16, False)
    assert applies(x)
    assert not applies(x.float()) and not applies(x.cpu()) and not applies(x[:0])
    assert not applies(torch.empty(MAX_ROWS + 1, 128, device="cuda", dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=f"M <= {KERNEL_MAX_ROWS}"):
        skinny_linear(torch.empty(KERNEL_MAX_ROWS + 1, 128, device="cuda", dtype=torch.bfloat16), w)
    with pytest.raises(ValueError, match="bf16/fp16"):
        skinny_linear(x.float(), w.float())
    with pytest.raises(ValueError, match="weight"):
        skinny_linear(x, w[:, :64].contiguous())
    with pytest.raises(ValueError, match="weight"):
        skinny_linear(x, w.half())
