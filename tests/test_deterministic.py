"""`--deterministic` (EngineConfig.deterministic, SGLang's --enable-deterministic-inference) on a
CPU: a request's tokens and every logprob it reports are bit for bit the same alone and inside
batches of random companions arriving before and after it, with and without a shared prefix
(prefix-cache hits), across chunked-prefill boundaries, overlap scheduling on and off (a second
engine, bfloat16), preemption and recompute (a cache too small for the batch), and a
release/resume between runs; and re-scoring the generated completion teacher-forced
(`max_new_tokens` 0, `logprob_start_len` at the completion) reports the same logprobs.

At tp_size 4 (gloo) the ranks' partial sums meet in rank order (TensorParallel.ordered), so a
request among companions is the same too; TP=1 and TP=4 differ (each rank sums its slice of K).
Qwen3-MoE and Qwen2-MoE hold as well: a token's experts are added in expert order.

What holds: all of the above, in float32 and bfloat16, with engine/models/invariant.py's matmuls
and the row-wise attention (engine/attention/sdpa_rows.py), on a CPU here; on CUDA through
tests/test_gpu_deterministic.py (the same tests, `device` "cuda": invariant_matmul, the
fixed-split attention, CUDA graphs).
"""

from __future__ import annotations

import random

import pytest
from test_models import random_tokens

from engine import Engine, SamplingParams
from engine.config import ConfigError, EngineConfig
from engine.models import invariant

KNOBS = dict(max_model_len=512, block_size=8, max_num_seqs=16, deterministic=True)
NEW = 24


def target(seed: int = 11) -> SamplingParams:
    return SamplingParams(max_new_tokens=NEW, temperature=1.0, top_p=0.95, seed=seed, logprobs=True, ignore_eos=True)


def companions(rng: random.Random, prompt: list[int], n: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """n random requests: greedy or sampled, some sharing the target's first 16 tokens."""
    prompts, params = [], []
    for i in range(n):
        own = random_tokens(rng.randint(3, 60), seed=rng.randrange(1 << 30))
        prompts.append(prompt[:16] + own if i % 2 else own)
        params.append(SamplingParams(max_new_tokens=rng.randint(1, NEW + 8), temperature=rng.choice([0.0, 0.7, 1.0]),
                                     seed=rng.randrange(1000) if rng.random() < 0.5 else None, ignore_eos=True))
    return prompts, params


@pytest.fixture
def device() -> str:
    return "cpu"


def result(out) -> tuple[list[int], list[float]]:
    return out.output_ids, [lp for lp, _ in out.output_token_logprobs]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_request_is_bitwise_the_same_whatever_else_runs(qwen3_dir: str, dtype: str, device: str) -> None:
    prompt = random_tokens(37, seed=3)
    rng = random.Random(dtype)
    with Engine(model=qwen3_dir, dtype=dtype, max_num_batched_tokens=24, device=device, **KNOBS) as llm:
        alone = result(llm.generate(input_ids=[prompt], sampling_params=target())[0])
        assert len(alone[0]) == NEW
        for n in (1, 8):
            others, params = companions(rng, prompt, n)
            for at in (0, n // 2, n):  # the target first, among them, last
                outs = llm.generate(input_ids=others[:at] + [prompt] + others[at:],
                                    sampling_params=params[:at] + [target()] + params[at:])  # fmt: skip
                assert result(outs[at]) == alone, (n, at)
        llm.release_memory_occupation()
        llm.resume_memory_occupation()
        assert result(llm.generate(input_ids=[prompt], sampling_params=target())[0]) == alone
    if dtype == "float32":
        return
    # Another engine: other prefill chunks, overlap scheduling off.
    with Engine(model=qwen3_dir, dtype=dtype, max_num_batched_tokens=64, disable_overlap_schedule=True, device=device, **KNOBS) as llm:
        others, params = companions(rng, prompt, 5)
        outs = llm.generate(input_ids=[*others, prompt], sampling_params=[*params, target()])
        assert result(outs[-1]) == alone


def test_preemption_and_recompute_leave_a_request_bitwise_the_same(qwen3_dir: str, device: str) -> None:
    """A KV cache too small for the batch: running requests are preempted and recomputed (their
    prompt and outputs prefilled again, in other chunks), the target, arriving last, among them."""
    prompt = random_tokens(37, seed=3)
    rng = random.Random("preempt")
    with Engine(model=qwen3_dir, dtype="bfloat16", max_num_batched_tokens=24, device=device, **KNOBS) as llm:
        alone = result(llm.generate(input_ids=[prompt], sampling_params=target())[0])
    with Engine(model=qwen3_dir, dtype="bfloat16", max_num_batched_tokens=24, device=device, num_kv_blocks=20,
                **KNOBS) as llm:  # fmt: skip
        others, params = companions(rng, prompt, 8)
        outs = llm.generate(input_ids=[*others, prompt], sampling_params=[*params, target()])
        assert llm.get_server_info()["num_preemptions"] > 0
    assert result(outs[-1]) == alone


def test_scoring_equals_generation(qwen3_dir: str, device: str) -> None:
    prompt = random_tokens(29, seed=4)
    with Engine(model=qwen3_dir, dtype="bfloat16", max_num_batched_tokens=16, device=device, **KNOBS) as llm:
        ids, logprobs = result(llm.generate(input_ids=[prompt], sampling_params=target(seed=5))[0])
        score = SamplingParams(max_new_tokens=0, temperature=1.0, logprobs=True, logprob_start_len=len(prompt))
        scored = llm.generate(input_ids=[prompt + ids], sampling_params=score)[0]
        assert [t for _, t in scored.input_token_logprobs] == ids
        assert [lp for lp, _ in scored.input_token_logprobs] == logprobs


def test_unseeded_requests_get_their_own_generators(qwen3_dir: str, device: str) -> None:
    """Without a seed each sampled request is seeded at arrival: two runs of the same prompt in
    one batch differ (their own randomness), and each is what it would be alone with that seed."""
    prompt = random_tokens(20, seed=6)
    free = SamplingParams(max_new_tokens=12, temperature=1.0, ignore_eos=True)
    with Engine(model=qwen3_dir, dtype="float32", device=device, **KNOBS) as llm:
        a, b = llm.generate(input_ids=[prompt, prompt], sampling_params=[free, free])
        assert a.output_ids != b.output_ids


def test_the_invariant_linear_is_the_same_for_any_rows() -> None:
    import torch

    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, 64, generator=g), torch.randn(96, generator=g)
    x = torch.randn(70, 64, generator=g)
    full = invariant.linear(x, w, b)
    for rows in (1, 2, 3, 5, 16, 17, 33):
        assert torch.equal(invariant.linear(x[:rows], w, b), full[:rows]), rows
    assert torch.equal(invariant.linear(x[3:4], w, b), full[3:4])


def test_a_row_invariant_attention_on_every_device_and_no_other(qwen3_dir: str) -> None:
    from engine.attention import resolve_backend_name

    for device in ("cpu", "cuda"):
        with pytest.raises(ConfigError, match="triton"):
            resolve_backend_name("triton", device, deterministic=True)
        assert resolve_backend_name("sdpa", device, deterministic=True) == "sdpa_rows"
        assert resolve_backend_name("triton_fixed", device, deterministic=True) == "triton_fixed"  # by name
    assert resolve_backend_name("auto", "cpu", deterministic=True) == "sdpa_rows"
    assert resolve_backend_name("auto", "cuda", deterministic=True) == "triton_fixed"
    assert EngineConfig(model=qwen3_dir, deterministic=True).deterministic


def test_install_leaves_no_few_row_path_that_bypasses_the_hooks(qwen3_dir: str) -> None:
    """The fused CUDA model's few-row kernels (the skinny linears and MLP, split-K, the skinny
    lm_head, a decode graph's logits pieces) reduce in their own orders: after `install` for
    CUDA none is left on, and every matmul goes through the invariant hooks. The packed linears
    (qkv, gate_up: each right after a norm) prefetch their weights under PDL, as the default
    mode's skinny kernel; no other linear does."""
    import torch

    from engine.config import ModelConfig
    from engine.models import get_model_class
    from engine.models.layers import MLP
    from engine.models.linear import MergedLinear

    config = ModelConfig.from_hf(qwen3_dir)
    with torch.device("meta"):
        model = get_model_class(config.architecture)(config, fused=True)
    assert any(getattr(m, "fused", False) for m in model.modules() if isinstance(m, MLP))
    arrivals = object()  # the split matmuls' counters (reserve's, on a GPU): every hook carries them
    assert invariant.install(model, torch.device("cuda"), arrivals) > 0  # type: ignore[arg-type]
    assert sum(isinstance(m, MergedLinear) for m in model.modules()) == 2 * config.num_layers  # qkv, gate_up
    for name, module in model.named_modules():
        if isinstance(module, MLP) or (hasattr(type(module), "linear_fn") and hasattr(module, "weight")):
            assert module.fused is False, name
        if hasattr(type(module), "linear_fn"):
            assert module.linear_fn.func is invariant.cuda_linear, name
            prefetch = isinstance(module, MergedLinear)
            assert module.linear_fn.keywords == {"arrivals": arrivals, "prefetch": prefetch}, name
        if hasattr(type(module), "logits_fn"):
            assert module.logits_fn.func is invariant.cuda_logits and not module.skinny_logits, name
            assert module.logits_fn.keywords == {"arrivals": arrivals}, name
            assert module.use_logits_pieces is False


def _alone_and_among(llm: Engine, rng: random.Random, n: int) -> None:
    """The target request alone, then first and last among n random companions: bit for bit
    the same tokens and logprobs."""
    prompt = random_tokens(37, seed=3)
    alone = result(llm.generate(input_ids=[prompt], sampling_params=target())[0])
    others, params = companions(rng, prompt, n)
    for at in (0, n):
        outs = llm.generate(input_ids=others[:at] + [prompt] + others[at:],
                            sampling_params=params[:at] + [target()] + params[at:])  # fmt: skip
        assert result(outs[at]) == alone, at


def test_tensor_parallel_ranks_reduce_in_a_fixed_order(qwen3_dir: str) -> None:
    """At tp_size 4 (gloo) a row's partial sums meet in rank order whatever the message holds
    (TensorParallel.ordered: all-gather, then ((p0 + p1) + p2) + p3): the request alone and among
    companions, before and after it, gives the same tokens and logprobs bit for bit."""
    with Engine(model=qwen3_dir, dtype="bfloat16", max_num_batched_tokens=24, tp_size=4, **KNOBS) as llm:
        _alone_and_among(llm, random.Random("tp"), 6)


@pytest.mark.parametrize("checkpoint", ["qwen3_moe_dir", "qwen2_moe_dir"])
def test_mixture_of_experts_sums_each_tokens_experts_in_expert_order(
    checkpoint: str, request: pytest.FixtureRequest, device: str
) -> None:
    """Qwen3-MoE and Qwen2-MoE (a shared expert): the router and every expert's matmul are
    row-invariant, and a token's expert outputs are added in ascending expert id (models/moe.py
    `reference_moe`, on CUDA too in the mode, eagerly), so a request alone and among companions
    is bitwise the same."""
    path = request.getfixturevalue(checkpoint)
    with Engine(model=path, dtype="bfloat16", max_num_batched_tokens=24, device=device, **KNOBS) as llm:
        _alone_and_among(llm, random.Random("moe"), 8)
