"""The fused Triton ops of engine/kernels/fused_ops.py and rope.py against the torch code of layers.py and rotary.py run on the
same CUDA tensors (the reference), on fresh random inputs; a CUDA-graph capture and replay of all of
them; whole models with the fused ops against the same models without them. GPU only, except the
two tests at the end (the switch, and that a CPU forward never imports the kernels).

Tolerances. Rope, SiLU-and-mul and the residual add round exactly where the torch ops round, so
they are bitwise equal. The RMSNorms sum squares in another order than torch's reduction, so the
fp32 scale can differ in its last bit; the normalised value then sometimes rounds to the
neighbouring bf16 value, and the weight multiply (a second rounding) can turn that into 2 ULP of
the output. So: at most 2 ULP, and at most 0.1% of elements (or 4) not bitwise equal. Rope after the
q/k norm inherits those rare differences (2 ULP of an input, mixed into both outputs of its pair),
which cancellation in `x1 cos - x2 sin` can make large relative to a small output: there, every
element within 2^-5 of its head's largest value (seen on an H200: 0.0089 at most), and at most
0.1% not bitwise equal. float32: max |out - ref| <= 1e-6 max |ref|.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from engine.config import ModelConfig
from engine.models import get_model_class
from engine.models.layers import RMSNorm, SiluAndMul
from engine.models.rotary import RotaryEmbedding, apply_rotary
from engine.weights.loader import load_checkpoint

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DTYPES = [torch.bfloat16, torch.float32]
TOKENS = [1, 7, 256, 4096]
EPS = 1e-6


def _ordered(x: torch.Tensor) -> torch.Tensor:
    """bf16/fp16 values as integers in value order, neighbours differing by 1 (+0 == -0)."""
    bits = x.contiguous().view(torch.int16).to(torch.int32)
    return torch.where(bits < 0, -(bits & 0x7FFF), bits)


def check(out: torch.Tensor, ref: torch.Tensor, max_ulps: int = 0, row_tol: float | None = None) -> None:
    """out against ref: see the module docstring. row_tol: instead of ULPs, |diff| <= row_tol *
    max |ref| of the row (last dim)."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.isfinite(out).all()
    if ref.dtype == torch.float32:
        err = (out - ref).abs().max().item()
        assert err <= 1e-6 * ref.abs().max().item(), f"fp32 max abs error {err:.3g}"
        return
    unequal = (out != ref).sum().item()
    if max_ulps == 0 and row_tol is None:
        assert unequal == 0, f"{unequal} of {ref.numel()} elements differ"
        return
    # 0.1%, and a few elements in tiny tensors (one flip in 64 elements is already 1.6%).
    assert unequal <= max(4, 1e-3 * ref.numel()), f"{unequal} of {ref.numel()} elements differ"
    if row_tol is not None:
        diff = (out.float() - ref.float()).abs()
        scale = ref.float().abs().amax(-1, keepdim=True)
        assert (diff <= row_tol * scale).all(), f"max diff / row scale {(diff / scale).max().item():.3g}"
    else:
        ulps = (_ordered(out) - _ordered(ref)).abs().max().item()
        assert ulps <= max_ulps, f"{ulps} ULP apart"


def _norm(n: int, dtype: torch.dtype, fused: bool) -> RMSNorm:
    norm = RMSNorm(n, EPS, fused=fused).cuda()
    norm.weight.data = (1 + 0.5 * torch.randn(n, device="cuda")).to(dtype)
    return norm


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [1024, 64])
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("add", [False, True], ids=["norm", "add_norm"])
def test_rms_norm(dtype: torch.dtype, hidden: int, tokens: int, add: bool) -> None:
    norm = _norm(hidden, dtype, fused=True)
    ref_norm = RMSNorm(hidden, EPS, fused=False).cuda()
    ref_norm.weight.data = norm.weight.data
    x = torch.randn(tokens, hidden, device="cuda").to(dtype)
    if not add:
        check(norm(x), ref_norm(x), max_ulps=2)
        return
    residual = (2 * torch.randn(tokens, hidden, device="cuda")).to(dtype)
    ref_out, ref_res = ref_norm(x, residual.clone())
    res_in = residual.clone()
    out, res = norm(x, res_in)
    assert res.data_ptr() == res_in.data_ptr(), "the residual is updated in place"
    check(res, ref_res)  # one rounded add: bitwise
    check(out, ref_out, max_ulps=2)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", [(16, 8, 128), (4, 2, 16)], ids=lambda h: "h{}-kv{}-d{}".format(*h))
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("qk_norm", [False, True], ids=["rope", "norm_rope"])
def test_rotary(dtype: torch.dtype, heads: tuple[int, int, int], tokens: int, qk_norm: bool) -> None:
    from engine.kernels import rope as rope_kernel

    H, Hkv, D = heads
    max_pos = 8192
    rope = RotaryEmbedding(D, max_pos, 1e6, None).cuda()
    positions = torch.randint(0, max_pos, (tokens,), device="cuda")
    qkv = torch.randn(tokens, (H + 2 * Hkv) * D, device="cuda").to(dtype)
    v_before = qkv[:, (H + Hkv) * D :].clone()
    q, k, _ = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)  # views, as in the model
    q, k = q.view(tokens, H, D), k.view(tokens, Hkv, D)
    r = rope(positions)
    assert r.cos is not None and r.sin is not None
    q_norm, k_norm = _norm(D, dtype, fused=False), _norm(D, dtype, fused=False)
    ref_q, ref_k = (q_norm(q), k_norm(k)) if qk_norm else (q, k)
    ref_q, ref_k = apply_rotary(ref_q, r.cos, r.sin), apply_rotary(ref_k, r.cos, r.sin)
    weights = (q_norm.weight, k_norm.weight) if qk_norm else (None, None)
    out_q, out_k = rope_kernel.rotary(q, k, positions, rope.cos_sin_cache, *weights, EPS)
    assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr(), "in place"
    for out, ref in ((out_q, ref_q), (out_k, ref_k)):
        check(out, ref, row_tol=2**-5 if qk_norm else None)
    assert torch.equal(qkv[:, (H + Hkv) * D :], v_before), "v was written"


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("intermediate", [3072, 64])
@pytest.mark.parametrize("tokens", TOKENS)
def test_silu_and_mul(dtype: torch.dtype, intermediate: int, tokens: int) -> None:
    x = (3 * torch.randn(tokens, 2 * intermediate, device="cuda")).to(dtype)
    check(SiluAndMul(fused=True)(x), SiluAndMul(fused=False)(x))


@pytest.mark.gpu
@needs_cuda
def test_ops_capture_and_replay_in_a_cuda_graph() -> None:
    """All four ops captured into one graph; replays on new inputs equal eager runs."""
    from engine.kernels import fused_ops
    from engine.kernels import rope as rope_kernel

    T, N, H, Hkv, D, dtype = 64, 1024, 16, 8, 128, torch.bfloat16
    norm = _norm(N, dtype, fused=True)
    qw, kw = _norm(D, dtype, fused=False).weight, _norm(D, dtype, fused=False).weight
    rope = RotaryEmbedding(D, 4096, 1e6, None).cuda()
    x, res = torch.empty(T, N, device="cuda", dtype=dtype), torch.empty(T, N, device="cuda", dtype=dtype)
    qkv = torch.empty(T, (H + 2 * Hkv) * D, device="cuda", dtype=dtype)
    pos = torch.empty(T, dtype=torch.int64, device="cuda")
    gate_up = torch.empty(T, 2 * N, device="cuda", dtype=dtype)

    def fill() -> None:
        for t in (x, res, qkv, gate_up):
            t.copy_(torch.randn(t.shape, device="cuda"))
        pos.copy_(torch.randint(0, 4096, (T,), device="cuda"))

    def step() -> list[torch.Tensor]:
        a = norm(x)
        b, r = norm(a, res)
        q, k = qkv[:, : H * D].view(T, H, D), qkv[:, H * D : (H + Hkv) * D].view(T, Hkv, D)
        rope_kernel.rotary(q, k, pos, rope.cos_sin_cache, qw, kw, EPS)
        return [a, b, r, qkv, fused_ops.silu_and_mul(gate_up)]

    fill()
    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for _ in range(3):
        fill()
        saved = [t.clone() for t in (x, res, qkv, gate_up)]
        graph.replay()
        got = [t.clone() for t in outs]
        for t, s in zip((x, res, qkv, gate_up), saved, strict=True):
            t.copy_(s)
        want = step()
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w)


# ---- whole models --------------------------------------------------------------------------------


def _build(path: str, dtype: torch.dtype, fused: bool) -> torch.nn.Module:
    config = ModelConfig.from_hf(path)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("cuda"):
            model = get_model_class(config.architecture)(config, fused=fused)
    finally:
        torch.set_default_dtype(default)
    load_checkpoint(model, path)
    assert model.fused == fused
    return model.eval()


def _run(model: torch.nn.Module) -> list[torch.Tensor]:
    """Prefill of mixed lengths, then three decode steps with padding rows (test_models' runner)."""
    from test_models import PagedRunner, random_tokens

    runner = PagedRunner(model, block_size=16)
    prompts = {i: random_tokens(n, seed=i) for i, n in enumerate([45, 7, 16, 1])}
    out = list(runner.step(prompts).values())
    for step in range(3):
        out += runner.step({i: random_tokens(1, seed=100 * step + i) for i in prompts}, pad=2).values()
    return out


def _rel(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    x, y = torch.cat(a), torch.cat(b)
    return ((x - y).abs().max() / y.abs().max()).item()


@pytest.mark.gpu
@needs_cuda
def test_model_logits_with_fused_ops(arch_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 logits with the fused ops are as close to float32 as without them, and within bf16
    noise of them; in float32 both agree to 1e-5. The fused path is really taken."""
    from engine.kernels import fused_ops, rope

    calls: set[str] = set()

    def spy(module, name: str):
        fn = getattr(module, name)

        def wrapped(*args, **kwargs):
            calls.add(name)
            return fn(*args, **kwargs)

        return wrapped

    for module, name in ((fused_ops, "rms_norm"), (fused_ops, "fused_add_rms_norm"), (rope, "rotary"), (fused_ops, "silu_and_mul")):
        monkeypatch.setattr(module, name, spy(module, name))
    with torch.inference_mode():
        exact = _run(_build(arch_dir, torch.float32, fused=False))
        fused32 = _run(_build(arch_dir, torch.float32, fused=True))
        assert set(calls) == {"rms_norm", "fused_add_rms_norm", "rotary", "silu_and_mul"}
        plain = _run(_build(arch_dir, torch.bfloat16, fused=False))
        fused = _run(_build(arch_dir, torch.bfloat16, fused=True))
    assert _rel(fused32, exact) < 1e-5
    err_plain, err_fused = _rel(plain, exact), _rel(fused, exact)
    print(f"bf16 logits vs fp32: unfused {err_plain:.3g}, fused {err_fused:.3g}, fused vs unfused {_rel(fused, plain):.3g}")
    # Within bf16 noise: no further from float32 than the unfused run, nor from the unfused run
    # than that run is from float32.
    assert err_fused <= 1.5 * err_plain + 1e-3
    assert _rel(fused, plain) <= 1.5 * err_plain + 1e-3


# ---- CPU -----------------------------------------------------------------------------------------


def test_the_switch_is_read_at_construction(qwen3_dir: str) -> None:
    config = ModelConfig.from_hf(qwen3_dir)
    cls = get_model_class(config.architecture)
    with torch.device("meta"):
        off = cls(config, fused=False)
        on = cls(config, fused=True)
    assert not off.fused and not off.model.layers[0].mlp.act.fused
    assert on.fused and on.model.layers[0].input_layernorm.fused and on.model.layers[0].self_attn.fused


def test_no_fused_ops_reaches_the_model_the_engine_builds(qwen3_dir: str) -> None:
    from engine.config import EngineConfig
    from engine.core.engine_core import EngineCore

    for fused_ops in (False, True):
        core = EngineCore(EngineConfig(model=qwen3_dir, device="cpu", num_kv_blocks=16, fused_ops=fused_ops))
        want = fused_ops and importlib.util.find_spec("triton") is not None
        assert core.runner.model.fused == want and core.runner.model.model.layers[0].mlp.act.fused == want
        del core


@pytest.mark.parametrize("which", ["qwen3", "qwen3_moe"])
def test_cpu_forward_never_imports_triton(which: str, request: pytest.FixtureRequest) -> None:
    model_dir = request.getfixturevalue(f"{which}_dir")
    code = f"""
import sys, torch
from test_models import PagedRunner, build
model = build({model_dir!r})
model.fused = True
for m in model.modules():
    if hasattr(m, "fused"):
        m.fused = True
PagedRunner(model, 16).step({{0: [5, 6, 7]}})
assert "engine.kernels.fused_ops" not in sys.modules, "fused_ops imported on a CPU forward"
assert "engine.kernels.rope" not in sys.modules, "rope imported on a CPU forward"
assert "engine.kernels.skinny_linear" not in sys.modules, "skinny_linear imported on a CPU forward"
assert "engine.kernels.fused_moe" not in sys.modules, "fused_moe imported on a CPU forward"
assert "engine.kernels.moe_routing" not in sys.modules, "moe_routing imported on a CPU forward"
assert "triton" not in sys.modules, "Triton imported on a CPU forward"
"""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.path.join(root, "tests")]), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
