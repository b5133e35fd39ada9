"""The engine on a GPU (`pytest -m gpu` on the device machine): bf16 greedy output equals
transformers on the GPU, CUDA-graph decode equals eager decode for every batch size of the ladder,
and capture leaves every input as it found it while allocating nothing per batch size."""

from __future__ import annotations

import hashlib
import random

import pytest
import torch
from oracle import greedy_of

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.core.protocol import AddRequest
from engine.request import SamplingParams
from engine.runner.cuda_graph import CudaGraphRunner

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

GRAPH_MAX_BS = 16


def _core(model_dir: str, **knobs: object) -> EngineCore:
    knobs = {"device": "cuda", "dtype": "bfloat16", "num_kv_blocks": 512, "max_num_seqs": 64,
             "cuda_graph_max_bs": GRAPH_MAX_BS, "max_model_len": 512} | knobs
    return EngineCore(EngineConfig(model=model_dir, **knobs))


def _prompts(seed: int, n: int, lo: int = 3, hi: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _greedy(core: EngineCore, prompts: list[list[int]], n: int) -> tuple[list[list[int]], list[list[float]]]:
    params = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True, logprobs=True)
    for i, p in enumerate(prompts):
        assert core.add_request(AddRequest(request_id=str(i), prompt_token_ids=p, sampling_params=params)) is None
    ids: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    lps: dict[str, list[float]] = {str(i): [] for i in range(len(prompts))}
    while core.has_work():
        for d in core.step():
            ids[d.request_id] += d.new_token_ids
            lps[d.request_id] += d.new_logprobs or []
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks
    return [ids[str(i)] for i in range(len(prompts))], [lps[str(i)] for i in range(len(prompts))]


def _hf(model_dir: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).cuda().eval()


def _hf_greedy(model, prompts: list[list[int]], n: int) -> list[list[int]]:
    return greedy_of(model, prompts, n)


@torch.no_grad()
def _hf_logprobs(model, prompt: list[int], output: list[int]) -> torch.Tensor:  # [len(output), V] fp32
    logits = model(torch.tensor([prompt + output], device="cuda")).logits[0].float()
    return torch.log_softmax(logits, -1)[len(prompt) - 1 : len(prompt) - 1 + len(output)]


def test_fp32_greedy_matches_transformers_on_gpu(arch_dir: str) -> None:
    """In float32 there are no near-ties to flip: 32 tokens equal, token for token."""
    prompts = _prompts(0, 4)
    expected = _hf_greedy(_hf(arch_dir, torch.float32), prompts, 32)
    core = _core(arch_dir, dtype="float32")
    assert core.runner.backend_name == "triton" and core.runner.graphs is not None
    assert _greedy(core, prompts, 32)[0] == expected


def test_one_sequence_at_a_time_starts_and_decodes_as_transformers(qwen3_dir: str) -> None:
    """max_num_seqs 1 (`--max-num-seqs 1`): the engine starts (its startup mixed step, two
    sequences, is skipped: nothing can mix) and serves requests one after another, every decode
    step from the batch-1 graph, each request's tokens those of transformers in float32."""
    prompts = _prompts(3, 3)
    expected = _hf_greedy(_hf(qwen3_dir, torch.float32), prompts, 12)
    core = _core(qwen3_dir, dtype="float32", max_num_seqs=1)
    assert core.runner.graphs is not None and core.runner.graphs.batch_sizes == [1]
    assert _greedy(core, prompts, 12)[0] == expected


def test_bf16_greedy_tracks_transformers_on_gpu(arch_dir: str) -> None:
    """In bfloat16 both engines round differently, so on these random-weight checkpoints (flat
    distributions) greedy paths may part at a near-tie. Checked: our logprobs are no further from
    float32 transformers than transformers' own bf16 run is, and the paths agree up to a point
    where the two candidates are within bf16 noise of each other in float32."""
    prompts = _prompts(0, 4)
    hf_bf16, hf_fp32 = _hf(arch_dir, torch.bfloat16), _hf(arch_dir, torch.float32)
    expected = _hf_greedy(hf_bf16, prompts, 32)
    ours, our_lps = _greedy(_core(arch_dir), prompts, 32)
    for p, got, want, lps in zip(prompts, ours, expected, our_lps, strict=True):
        exact = _hf_logprobs(hf_fp32, p, got)
        theirs = _hf_logprobs(hf_bf16, p, got)
        rows = torch.arange(len(got), device="cuda")
        toks = torch.tensor(got, device="cuda")
        our_err = (torch.tensor(lps, device="cuda") - exact[rows, toks]).abs().max().item()
        their_err = (theirs[rows, toks] - exact[rows, toks]).abs().max().item()
        assert our_err <= 2 * their_err + 0.02, (our_err, their_err)
        split = next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None)
        if split is not None:
            gap = (exact[split, got[split]] - exact[split, want[split]]).abs().item()
            assert gap < 4 * their_err + 0.02, f"paths part at token {split} with a float32 gap of {gap}"


def test_graph_decode_equals_eager_for_every_batch_size(qwen3_dir: str) -> None:
    graphs, eager = _core(qwen3_dir), _core(qwen3_dir, disable_cuda_graph=True)
    assert graphs.runner.graphs.batch_sizes == [1, 2, 4, 8, 16] and eager.runner.graphs is None
    assert all(graphs.runner.graphs.pieces.values())  # bf16: the logits write the sampler's pieces
    for bs in [1, 2, 3, 4, 5, 7, 8, 11, 16]:  # every ladder size, and padded sizes between
        prompts = _prompts(bs, bs)
        g_ids, g_lps = _greedy(graphs, prompts, 12)
        e_ids, e_lps = _greedy(eager, prompts, 12)
        assert g_ids == e_ids, f"batch {bs}"
        diff = max(abs(a - b) for gl, el in zip(g_lps, e_lps, strict=True) for a, b in zip(gl, el, strict=True))
        assert diff < 2e-2, f"batch {bs}: logprobs differ by {diff}"


def _digest(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    return {k: hashlib.sha256(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
            for k, t in tensors.items()}


def test_capture_changes_no_input_and_allocates_nothing_per_batch_size(qwen3_dir: str) -> None:
    core = _core(qwen3_dir, disable_cuda_graph=True)
    runner = core.runner
    _greedy(core, _prompts(1, 3), 4)  # leave real data in the KV cache
    graphs = CudaGraphRunner(runner.model, runner.attn_backend, GRAPH_MAX_BS, core.model_config.vocab_size, runner.device)
    watched = graphs.static_tensors(GRAPH_MAX_BS) | {"kv_cache": runner.kv_cache}
    before = _digest(watched)
    graphs.capture()
    assert _digest(watched) == before
    largest = graphs.static_tensors(GRAPH_MAX_BS)
    for bs in graphs.batch_sizes:
        for name, t in graphs.static_tensors(bs).items():
            assert t.data_ptr() == largest[name].data_ptr(), f"{name} of bs {bs} is not a view of the largest"
    assert graphs.pool_bytes > 0


def test_server_info_reports_graph_memory(qwen3_dir: str) -> None:
    info = _core(qwen3_dir).get_info()
    assert info["cuda_graph_bytes"] > 0 and info["cuda_graph_batch_sizes"] == [1, 2, 4, 8, 16]
    assert info["attention_backend"] == "triton"


def _compiled_variants() -> dict[str, int]:
    """How many compiled variants of each of the engine's Triton kernels this process holds."""
    from engine.kernels import attention as triton_kernels
    from engine.kernels import attention_decode as triton_decode
    from engine.kernels import attention_prefill as triton_prefill
    from engine.kernels import fused_ops, lse_argmax, skinny_linear
    from engine.kernels.launcher import Launcher

    counts = {}
    for module in (triton_kernels, triton_prefill, triton_decode, fused_ops, skinny_linear, lse_argmax):
        for name, fn in vars(module).items():
            if isinstance(fn, Launcher):
                counts[name] = fn.variants()
    return counts


def test_no_kernel_compiles_after_the_first_request(qwen3_dir: str) -> None:
    """Triton compiles a kernel variant per specialization of its arguments (an int == 1 or
    divisible by 16, a pointer 16-byte aligned or not); a variant first met while serving costs
    its request a compile (~1 s). After startup and one request, prompts of every length class,
    batches above and below the graph ladder, chunked prefills, prefix hits and sampled batches of
    every size compile nothing."""
    core = _core(qwen3_dir, max_num_batched_tokens=96, max_num_seqs=64)
    _greedy(core, _prompts(0, 1, 20, 20), 3)
    before = _compiled_variants()
    assert before["_prefill_kernel"] >= 1 and before["_skinny_kernel"] >= 1
    rng = random.Random(5)
    lengths = [1, 2, 15, 16, 17, 31, 32, 33, 100, 255, 257, 300]
    for bs in (1, 3, 7, 17, 24):
        prompts = [[rng.randrange(3, 512) for _ in range(rng.choice(lengths))] for _ in range(bs)]
        _greedy(core, prompts + prompts[:2], rng.choice([1, 5, 40]))  # repeats hit the prefix cache
    # Requests joining running decodes one at a time, as online traffic arrives: mixed steps of one
    # prompt beside 1, 2, 3... decodes (few sequences: the split-KV reduce with many splits).
    params = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(_prompts(6, 8, 20, 60)):
        assert core.add_request(AddRequest(request_id=f"join-{i}", prompt_token_ids=p, sampling_params=params)) is None
        core.step()
        core.step()
    while core.has_work():
        core.step()
    # Sampled rows (RL rollouts sample at temperature 1) at every row count from 1 to 9: the
    # sampler's kernel must not specialize on the rows (its scratch's alignment did, once).
    for bs in range(1, 10):
        sampled = SamplingParams(max_new_tokens=3, temperature=1.0 if bs % 2 else 0.7, top_p=0.9, ignore_eos=True, logprobs=True)
        for i, p in enumerate(_prompts(20 + bs, bs)):
            assert core.add_request(AddRequest(request_id=f"s{bs}-{i}", prompt_token_ids=p, sampling_params=sampled)) is None
        while core.has_work():
            core.step()
    grown = {k: (before.get(k, 0), v) for k, v in _compiled_variants().items() if v != before.get(k, 0)}
    assert not grown, f"kernels compiled while serving (before, after): {grown}"


def test_prompt_logprobs_and_top_alternatives_match_transformers(qwen3_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Prompt logprobs (`logprob_start_len`) and their top alternatives, scored after piecewise
    graph forwards of prefill chunks, in slices of rows (made small here), equal float32
    transformers on the GPU."""
    from engine.runner import prompt_logprobs

    monkeypatch.setattr(prompt_logprobs, "ROWS_PER_SLICE", 64)
    core = _core(qwen3_dir, dtype="float32", max_num_batched_tokens=256)
    assert core.runner.piecewise is not None
    prompts = _prompts(3, 2, lo=300, hi=480)
    starts = [0, 37]
    for i, (p, start) in enumerate(zip(prompts, starts, strict=True)):
        params = SamplingParams(max_new_tokens=2, temperature=0.0, logprob_start_len=start, top_logprobs_num=3)
        assert core.add_request(AddRequest(request_id=str(i), prompt_token_ids=p, sampling_params=params)) is None
    got: dict[str, tuple[list, list]] = {}
    while core.has_work():
        for d in core.step():
            if d.input_logprobs is not None:
                got[d.request_id] = (d.input_logprobs, d.input_top_logprobs)
    hf = _hf(qwen3_dir, torch.float32)
    for i, (p, start) in enumerate(zip(prompts, starts, strict=True)):
        with torch.no_grad():
            lp = torch.log_softmax(hf(torch.tensor([p], device="cuda")).logits[0].float(), -1)
        lps, tops = got[str(i)]
        assert len(lps) == len(tops) == len(p) - start
        for q in range(max(start, 1), len(p)):
            assert lps[q - start] == pytest.approx(lp[q - 1, p[q]].item(), abs=2e-3)
            values, ids = lp[q - 1].topk(3)
            assert [v for _, v in tops[q - start]] == pytest.approx(values.tolist(), abs=2e-3)
            assert tops[q - start][0][0] == ids[0].item() or values[0] - values[1] < 2e-3
        if start == 0:
            assert lps[0] is None and tops[0] is None
