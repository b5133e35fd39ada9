"""End to end through the real engine process: greedy output equals transformers token for token
for every architecture, also with prefix-cache hits, chunked prefill and preemption; bad input
gets a clear error while the rest of the batch completes; every KV block is free afterwards."""

from __future__ import annotations

import random

import pytest
import torch
from oracle import hf_greedy
from transformers import AutoModelForCausalLM

from engine import Engine, EngineDeadError, InvalidRequest, ModelNotFound, SamplingParams
from engine.core.protocol import AddRequests, StepOutputs

NUM_NEW = 48
GREEDY = SamplingParams(max_new_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)


def _prompts(seed: int, lengths: tuple[int, ...] = (5, 17, 33, 70)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in lengths]


def assert_all_blocks_free(llm: Engine) -> None:
    info = llm.get_server_info()
    assert info["num_running"] == 0 and info["num_waiting"] == 0
    assert info["kv_blocks_free"] == info["kv_blocks_total"]


@pytest.fixture(scope="module")
def reference(arch_dir: str) -> tuple[str, list[list[int]], list[list[int]]]:
    prompts = _prompts(1)
    return arch_dir, prompts, hf_greedy(arch_dir, prompts, NUM_NEW)


def test_greedy_matches_transformers(reference) -> None:
    model_dir, prompts, expected = reference
    with Engine(model=model_dir, device="cpu", dtype="float32") as llm:
        outs = llm.generate(input_ids=prompts, sampling_params=GREEDY)
        assert [o.output_ids for o in outs] == expected
        assert all(o.finish_reason == "length" for o in outs)
        # The same prompts again come from the prefix cache (full blocks) and change nothing.
        again = llm.generate(input_ids=prompts, sampling_params=GREEDY)
        assert [o.output_ids for o in again] == expected
        assert [o.cached_tokens for o in again] == [(len(p) - 1) // 16 * 16 for p in prompts]
        assert sum(o.cached_tokens for o in again) > 0
        assert_all_blocks_free(llm)


def test_chunked_prefill_and_preemption_change_nothing(reference) -> None:
    model_dir, prompts, expected = reference
    # A 16-token budget splits every prompt over several steps; 14 blocks of 8 tokens cannot
    # hold four requests of up to 118 tokens at once, so requests are preempted and recomputed.
    with Engine(
        model=model_dir, device="cpu", dtype="float32", block_size=8, num_kv_blocks=20,
        max_num_batched_tokens=16, enable_prefix_caching=False,
    ) as llm:
        outs = llm.generate(input_ids=prompts, sampling_params=GREEDY)
        assert [o.output_ids for o in outs] == expected
        assert llm.get_server_info()["num_preemptions"] > 0
        assert_all_blocks_free(llm)


def test_shared_prefixes_hit_the_cache(qwen3_dir: str) -> None:
    base = _prompts(7, (40,))[0]
    prompts = [base + tail for tail in _prompts(8, (3, 9, 20))]
    expected = hf_greedy(qwen3_dir, prompts, n=16)
    params = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    with Engine(model=qwen3_dir, device="cpu", dtype="float32", block_size=16) as llm:
        first = llm.generate(input_ids=[base], sampling_params=params)
        assert first[0].cached_tokens == 0
        outs = llm.generate(input_ids=prompts, sampling_params=params)
        assert [o.output_ids for o in outs] == expected
        assert [o.cached_tokens for o in outs] == [32, 32, 32]
        assert llm.flush_cache() is True
        again = llm.generate(input_ids=prompts[:1], sampling_params=params)
        assert again[0].cached_tokens == 0 and again[0].output_ids == expected[0]
        assert_all_blocks_free(llm)


@pytest.fixture(scope="module")
def demo_engine(tmp_path_factory):
    from engine.demo_model import create_demo_model

    path = create_demo_model(str(tmp_path_factory.mktemp("demo")))
    with Engine(model=path, device="cpu", dtype="float32", max_model_len=256) as llm:
        yield llm


def test_text_prompts_logprobs_and_stop(demo_engine: Engine) -> None:
    llm = demo_engine
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs_num=3)
    out = llm.generate(["Hello there", "Another prompt, a bit longer"], params)
    ref = AutoModelForCausalLM.from_pretrained(llm.config.model, dtype=torch.float32).eval()
    for o in out:
        assert o.text == llm.tokenizer.decode(o.output_ids, skip_special_tokens=True)
        assert [t for _, t in o.output_token_logprobs] == o.output_ids
        with torch.no_grad():
            full = torch.tensor([o.prompt_token_ids + o.output_ids])
            logp = torch.log_softmax(ref(full).logits[0].float(), -1)
        n = len(o.prompt_token_ids)
        for i, (lp, tok) in enumerate(o.output_token_logprobs):
            row = logp[n - 1 + i]
            assert lp == pytest.approx(row.max().item(), abs=1e-4)
            assert lp == pytest.approx(row[tok].item(), abs=1e-4)
            top = o.output_top_logprobs[i]
            assert [t for t, _ in top] == row.topk(3).indices.tolist()
    # A stop string cuts the text before it; the request ends with finish_reason stop.
    text = out[0].text
    stop = text[5:8]
    if stop.strip():
        cut = llm.generate(["Hello there"], SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop]))[0]
        assert cut.finish_reason == "stop" and cut.matched_stop == stop
        assert cut.text == text[: text.index(stop)]
    assert_all_blocks_free(llm)


def test_prefill_only_requests(demo_engine: Engine) -> None:
    """max_new_tokens 0 (a teacher scoring sequences): no output token, finish_reason length, the
    prompt's logprobs as a one-token request computes them; batched with generating requests."""
    llm = demo_engine
    prompt = _prompts(5, (40,))[0]
    score = SamplingParams(max_new_tokens=0, logprobs=True, logprob_start_len=0)
    one = SamplingParams(max_new_tokens=1, temperature=0.0, logprobs=True, logprob_start_len=0)
    gen = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    outs = llm.generate(input_ids=[prompt, prompt, prompt[:20]], sampling_params=[score, one, gen])
    assert outs[0].output_ids == [] and outs[0].finish_reason == "length" and outs[0].text == ""
    assert outs[0].input_token_logprobs == outs[1].input_token_logprobs and outs[0].input_token_logprobs[0][0] is None
    assert len(outs[2].output_ids) == 8
    again = llm.generate(input_ids=[prompt], sampling_params=SamplingParams(max_new_tokens=0))[0]  # prefix cached
    assert again.output_ids == [] and again.finish_reason == "length"
    assert_all_blocks_free(llm)


def test_one_call_starts_its_prompts_in_the_same_step(demo_engine: Engine) -> None:
    """A generate call's prompts go to the engine in one message (`AddRequests`), which the engine
    adds whole before its next step: the first step outputs every prompt's first token, so a
    batch is scheduled alike on every run (prompts sent one message each could be split over
    steps by when they arrive, and a different batch shape rounds differently)."""
    llm = demo_engine
    sent, received = [], []
    send, recv = llm._core.send, llm._recv
    llm._core.send = lambda msg: (sent.append(msg), send(msg))[1]
    llm._recv = lambda: (msg := recv(), received.append(msg))[0]
    try:
        outs = llm.generate(input_ids=_prompts(3, (5, 40, 90, 12)), sampling_params=GREEDY)
    finally:
        del llm._core.send, llm._recv
    assert [type(m) for m in sent] == [AddRequests]
    assert [r.request_id for r in sent[0].requests] == [o.request_id for o in outs]
    first = next(m for m in received if isinstance(m, StepOutputs))
    assert sorted(d.request_id for d in first.deltas) == sorted(o.request_id for o in outs)
    assert all(len(d.new_token_ids) == 1 for d in first.deltas)
    assert all(len(o.output_ids) == NUM_NEW for o in outs)
    assert_all_blocks_free(llm)


def test_seeded_sampling_is_reproducible(demo_engine: Engine) -> None:
    llm = demo_engine
    prompts = ["The same prompt"] * 2 + ["Something else entirely"]
    seeded = SamplingParams(max_new_tokens=16, temperature=1.0, seed=1234, ignore_eos=True)
    a = llm.generate(prompts, seeded)
    b = llm.generate(prompts[:1], seeded)
    assert a[0].output_ids == a[1].output_ids == b[0].output_ids
    other = llm.generate(prompts[:1], SamplingParams(max_new_tokens=16, temperature=1.0, seed=99, ignore_eos=True))
    assert other[0].output_ids != a[0].output_ids


def test_bad_requests_fail_alone(demo_engine: Engine) -> None:
    llm = demo_engine
    good = [1, 5, 9, 33, 70]
    expected = llm.generate(input_ids=[good], sampling_params=GREEDY)[0].output_ids
    outs = llm.generate(
        input_ids=[good, [], [7] * 250, [3, 600], good],
        sampling_params=GREEDY,
    )
    assert outs[0].output_ids == expected == outs[4].output_ids
    errors = [o.error for o in outs[1:4]]
    assert all(o.finish_reason == "abort" and o.output_ids == [] for o in outs[1:4])
    assert "empty" in errors[0]
    assert "context length of 256" in errors[1]
    assert "600" in errors[2] and "vocabulary" in errors[2]
    with pytest.raises(InvalidRequest, match="temperature"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(InvalidRequest, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(InvalidRequest, match="max_new_tokens"):
        SamplingParams(max_new_tokens=-1)
    assert_all_blocks_free(llm)


def test_startup_errors_are_clear(tmp_path, qwen3_dir: str) -> None:
    import json
    import shutil

    bad = tmp_path / "unknown_arch"
    shutil.copytree(qwen3_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(EngineDeadError, match="GPT2LMHeadModel.*Qwen3ForCausalLM"):
        Engine(model=str(bad), device="cpu")

    missing = tmp_path / "missing_weights"
    shutil.copytree(qwen3_dir, missing)
    (missing / "model.safetensors").unlink()
    with pytest.raises(ModelNotFound, match="safetensors"):  # before any process starts
        Engine(model=str(missing), device="cpu")


def test_mistral_shaped_checkpoint_matches_transformers(mistral_dir: str) -> None:
    prompts = _prompts(3, (9, 40))
    expected = hf_greedy(mistral_dir, prompts, n=16)
    params = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    with Engine(model=mistral_dir, device="cpu", dtype="float32") as llm:
        assert llm.info["architecture"] == "MistralForCausalLM"
        assert [o.output_ids for o in llm.generate(input_ids=prompts, sampling_params=params)] == expected


def test_dtype_auto_takes_the_checkpoints(qwen3_bf16_dir: str) -> None:
    """A bfloat16 checkpoint runs in bfloat16; its logprobs are no further from float32
    transformers than transformers' own bfloat16 run is (with a little slack)."""
    prompt = _prompts(4, (20,))[0]
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True, logprobs=True)
    with Engine(model=qwen3_bf16_dir, device="cpu", dtype="auto") as llm:
        assert llm.info["dtype"] == "bfloat16"
        out = llm.generate(input_ids=[prompt], sampling_params=params)[0]
    ids = torch.tensor([prompt + out.output_ids])
    rows = torch.arange(len(prompt) - 1, ids.shape[1] - 1)
    toks = torch.tensor(out.output_ids)

    def hf_logprobs(dtype: torch.dtype) -> torch.Tensor:
        ref = AutoModelForCausalLM.from_pretrained(qwen3_bf16_dir, dtype=dtype).eval()
        with torch.no_grad():
            return torch.log_softmax(ref(ids).logits[0].float(), -1)[rows, toks]

    exact, hf_bf16 = hf_logprobs(torch.float32), hf_logprobs(torch.bfloat16)
    ours = torch.tensor([lp for lp, _ in out.output_token_logprobs])
    assert (ours - exact).abs().max() <= 2 * (hf_bf16 - exact).abs().max() + 0.02


def test_wrong_tensor_shape_is_named(tmp_path, qwen3_dir: str) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    bad = tmp_path / "wrong_shape"
    shutil.copytree(qwen3_dir, bad)
    tensors = load_file(str(bad / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name] = tensors[name][:, :-1].contiguous()
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(EngineDeadError, match=name.replace(".", r"\.")):
        Engine(model=str(bad), device="cpu")
