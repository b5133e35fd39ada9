"""Tiny random Hugging Face checkpoints, saved once per session with `save_pretrained`.

Every one has vocab 512, hidden 64, head_dim 16, float32 weights, a fixed seed and a tokenizer
(engine.demo_model.save_tokenizer). Weights are drawn wider than Hugging Face's default init and
every parameter (norms and biases included) is perturbed, so that attention is far from uniform
and a wrong rope, mask, bias or norm shows in the logits.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

# Two CPU cores shared by this process, the servers, their engines and the tensor-parallel ranks:
# torch's OpenMP threads, spinning in each of them, thrash (one 400-token greedy request through a
# demo server: 4-12 s with the default two threads while another process runs, 1-3 s with one;
# bench/*.py --tiny set the same). Every server, engine and bench script started from here inherits
# it; a value set outside wins, and a CUDA machine keeps torch's default.
if not torch.cuda.is_available() and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

# Test files whose tools come with the dev extra only (the GPU machine lacks them): skipped there.
collect_ignore = [
    f for f, module in [("test_fuzz.py", "schemathesis"), ("test_deploy.py", "dockerfile_parse"),
                        ("test_deploy.py", "yaml")]
    if importlib.util.find_spec(module) is None
]

MAX_WORKERS = 4  # each worker starts servers, engines and ranks of its own


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto` (pyproject's addopts): one worker per core on a CPU, at most MAX_WORKERS; GPU
    tests (`-m gpu`) in this process alone, since every worker would share the one device. A test
    runs single-threaded (OMP_NUM_THREADS above) and waits on its servers much of the time, so a
    second core would otherwise sit idle. `-n 0` runs everything here."""
    if "gpu" in (config.getoption("markexpr") or "").replace("not gpu", ""):
        return 0
    return max(1, min(len(os.sched_getaffinity(0)), MAX_WORKERS))


TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    head_dim=16,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    initializer_range=0.2,
    bos_token_id=1,
    eos_token_id=2,
)


def _tiny_llama() -> PreTrainedModel:
    # llama3 rope scaling with an original context of 32, so test prompts cross it.
    config = LlamaConfig(
        **TINY,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        rope_scaling={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    )
    return _randomized(LlamaForCausalLM, config, seed=0)


def _tiny_qwen2() -> PreTrainedModel:
    config = Qwen2Config(
        **TINY, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False
    )
    return _randomized(Qwen2ForCausalLM, config, seed=1)


def _tiny_qwen3(seed: int = 2) -> PreTrainedModel:
    # 8 heads of 16: head_dim is not hidden / heads, so it must be read from the config.
    config = Qwen3Config(
        **TINY, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True
    )
    return _randomized(Qwen3ForCausalLM, config, seed=seed)


def _tiny_qwen3_moe(seed: int = 11) -> PreTrainedModel:
    # 8 experts of 32, top-2 renormalised (Qwen3-30B-A3B's norm_topk_prob); layer 1 keeps a dense
    # MLP (mlp_only_layers), so sparse and dense layers alternate.
    config = Qwen3MoeConfig(
        **TINY, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1],
    )
    return _randomized(Qwen3MoeForCausalLM, config, seed=seed)


def _tiny_qwen2_moe() -> PreTrainedModel:
    # Qwen2-MoE: q/k/v bias, a gated shared expert beside 8 experts of 32, top-2 not renormalised
    # (norm_topk_prob false, as Qwen1.5-MoE); layer 1 dense.
    config = Qwen2MoeConfig(
        **TINY, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        norm_topk_prob=False, mlp_only_layers=[1],
    )
    return _randomized(Qwen2MoeForCausalLM, config, seed=13)


def _tiny_mixtral(seed: int = 15) -> PreTrainedModel:
    # Mixtral: Llama attention, every MLP 4 experts of intermediate_size, top-2 renormalised; saved
    # with Mixtral's names (block_sparse_moe.experts.{e}.w1/w2/w3).
    config = MixtralConfig(
        **(TINY | {"intermediate_size": 32}), num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        tie_word_embeddings=False, num_local_experts=4, num_experts_per_tok=2,
    )
    return _randomized(MixtralForCausalLM, config, seed=seed)


def _tiny_mistral() -> PreTrainedModel:
    # Mistral-shaped: Llama layers under another name, GQA, no rope scaling, a sliding window
    # no shorter than the context (so full attention is exact).
    config = MistralConfig(
        **TINY, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, sliding_window=512
    )
    return _randomized(MistralForCausalLM, config, seed=3)


def _randomized(cls: type[PreTrainedModel], config: object, seed: int) -> PreTrainedModel:
    torch.manual_seed(seed)
    model = cls(config).to(torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


def _save(model: PreTrainedModel, path: str, **kwargs: object) -> str:
    from engine.demo_model import save_tokenizer

    model.save_pretrained(path, **kwargs)
    save_tokenizer(path)
    return path


def run_core(core: object, requests: list[tuple[str, list[int], object]]) -> dict[str, tuple[list[int], list, list | None]]:
    """Requests (id, prompt token ids, SamplingParams) run to the end on an in-process EngineCore:
    per id (output ids, their logprobs, the prompt's logprobs from logprob_start_len, or None)."""
    from engine.core.protocol import AddRequest

    for rid, prompt, sp in requests:
        assert core.add_request(AddRequest(request_id=rid, prompt_token_ids=prompt, sampling_params=sp)) is None
    out: dict[str, tuple[list[int], list, list | None]] = {rid: ([], [], None) for rid, _, _ in requests}
    for _ in range(10_000):
        if not core.has_work():
            return out
        for d in core.step():
            assert not d.error, d.error
            ids, lps, scored = out[d.request_id]
            out[d.request_id] = (ids + d.new_token_ids, lps + (d.new_logprobs or []),
                                 d.input_logprobs if d.input_logprobs is not None else scored)  # fmt: skip
    raise AssertionError("the engine did not finish")


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return _save(_tiny_llama(), str(tmp_path_factory.mktemp("llama")))


@pytest.fixture(scope="session")
def llama_sharded_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The same weights as `llama_dir`, in several files with a `model.safetensors.index.json`."""
    return _save(_tiny_llama(), str(tmp_path_factory.mktemp("llama_sharded")), max_shard_size="100KB")


@pytest.fixture(scope="session")
def qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return _save(_tiny_qwen2(), str(tmp_path_factory.mktemp("qwen2")))


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return _save(_tiny_qwen3(), str(tmp_path_factory.mktemp("qwen3")))


@pytest.fixture(scope="session")
def wide_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Two layers of Qwen3-0.6B's widths (hidden 1024, 16 heads of 128, 8 KV heads, MLP 3072): the
    sizes at which the CUDA decode paths attach and `--deterministic`'s few-row kernels (16-row
    matmul tiles, the split attention) differ from its many-row ones. GPU tests only."""
    config = Qwen3Config(**TINY | dict(hidden_size=1024, intermediate_size=3072, head_dim=128, num_hidden_layers=2,
                                       num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True))  # fmt: skip
    return _save(_randomized(Qwen3ForCausalLM, config, seed=3), str(tmp_path_factory.mktemp("wide_qwen3")))


@pytest.fixture(scope="session")
def qwen3_next_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """`qwen3_dir`'s architecture with other weights: what a trainer pushes as an update."""
    return _save(_tiny_qwen3(seed=7), str(tmp_path_factory.mktemp("qwen3_next")))


@pytest.fixture(scope="session")
def qwen3_aligned_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Qwen3 whose every tensor is a multiple of 256 bytes (head_dim 64 in float32), as every
    tensor of the real models is: its weights lie back to back in Hugging Face's order."""
    config = Qwen3Config(
        **(TINY | {"head_dim": 64}), num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        tie_word_embeddings=False,
    )
    return _save(_randomized(Qwen3ForCausalLM, config, seed=5), str(tmp_path_factory.mktemp("qwen3_aligned")))


@pytest.fixture(scope="session")
def qwen3_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Qwen3-MoE, saved with Hugging Face's per-expert names (`mlp.experts.{e}.gate_proj.weight`)."""
    return _save(_tiny_qwen3_moe(), str(tmp_path_factory.mktemp("qwen3_moe")))


@pytest.fixture(scope="session")
def qwen2_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Qwen2-MoE with its shared expert, per-expert names as saved by transformers."""
    return _save(_tiny_qwen2_moe(), str(tmp_path_factory.mktemp("qwen2_moe")))


@pytest.fixture(scope="session")
def mixtral_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return _save(_tiny_mixtral(), str(tmp_path_factory.mktemp("mixtral")))


@pytest.fixture(scope="session")
def mixtral_next_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return _save(_tiny_mixtral(seed=16), str(tmp_path_factory.mktemp("mixtral_next")))


@pytest.fixture(scope="session")
def qwen3_moe_next_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """`qwen3_moe_dir`'s architecture with other weights: what a trainer pushes as an update."""
    return _save(_tiny_qwen3_moe(seed=12), str(tmp_path_factory.mktemp("qwen3_moe_next")))


@pytest.fixture(scope="session")
def mistral_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return _save(_tiny_mistral(), str(tmp_path_factory.mktemp("mistral")))


@pytest.fixture(scope="session")
def qwen3_bf16_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """`qwen3_dir`'s weights saved in bfloat16, so `dtype="auto"` must pick bfloat16."""
    return _save(_tiny_qwen3().to(torch.bfloat16), str(tmp_path_factory.mktemp("qwen3_bf16")))


@pytest.fixture(scope="session", params=["llama", "qwen2", "qwen3"])
def arch_dir(request: pytest.FixtureRequest) -> str:
    """Each architecture's checkpoint in turn."""
    return request.getfixturevalue(f"{request.param}_dir")


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from engine.demo_model import create_demo_model

    return create_demo_model(str(tmp_path_factory.mktemp("demo")))


@pytest.fixture(scope="session")
def demo_server(demo_dir: str, tmp_path_factory: pytest.TempPathFactory):
    """One real server on the demo model, shared by the HTTP tests that leave it as they found it."""
    from server_util import ServerProcess

    log = str(tmp_path_factory.mktemp("logs") / "demo_server.log")
    server = ServerProcess(demo_dir, "--max-model-len", "512", log_path=log)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def qwen3_server(qwen3_dir: str, tmp_path_factory: pytest.TempPathFactory):
    """One real server on the tiny Qwen3 (`--max-model-len 512`), shared by the modules that only
    generate on it (constrained decoding, structural tags)."""
    from server_util import ServerProcess

    server = ServerProcess(qwen3_dir, "--max-model-len", "512", log_path=str(tmp_path_factory.mktemp("logs") / "qwen3_server.log"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def expected(request: pytest.FixtureRequest, qwen3_dir: str, qwen3_next_dir: str) -> dict[str, list[list[int]]]:
    """transformers' greedy continuations of the test module's PROMPTS (N new tokens each) on
    qwen3_dir ("old") and on qwen3_next_dir, which weight updates load ("new")."""
    from oracle import greedy_before_after

    return greedy_before_after(qwen3_dir, qwen3_next_dir, request.module.PROMPTS, request.module.N)
