"""Speculative decoding with model-free drafts (`--speculative-algorithm ngram`, engine/core/drafts.py)
on a CPU: the tokens are plain decoding's, whatever is drafted.

- Greedy requests give plain decoding's tokens (logprobs within 1e-4: a verify forward runs the
  drafted positions as decode rows of their own), with overlap scheduling on and off; a second rollout of a
  prompt takes the first one's text as drafts and accepts them.
- With `--deterministic`, seeded sampled requests (temperature 1, top_p) give plain decoding's
  tokens and logprobs bit for bit: each drafted position samples with its own output index's
  noise, so a draft stands exactly when plain decoding would have sampled it.
- A stop token or a stop string among the accepted drafts ends the request there; max_new_tokens
  holds; rollouts made on older weights draft the ones after a release/resume and an update.
- The drafter: the latest occurrence of the longest window, word-aligned; a request backs off
  after MISSES rejected proposals; no drafts above disable_by_batch_size running requests, nor
  for requests whose sampling changes between positions (penalties); vLLM's --speculative-config.
"""

from __future__ import annotations

import pytest
from test_models import random_tokens

from engine import Engine, SamplingParams
from engine.config import ConfigError, EngineConfig
from engine.core.drafts import MISSES, NgramDrafter, _continuation, _encode
from engine.request import Batch, Request

KNOBS = dict(max_model_len=256, block_size=8, max_num_seqs=8)
LOOP = [5, 9, 13, 200, 7, 11] * 3  # a prompt that repeats itself: its own text drafts


def greedy(n: int = 40, **kw: object) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True, logprobs=True, **kw)


def sampled(seed: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=32, temperature=1.0, top_p=0.95, seed=seed, logprobs=True, ignore_eos=True)


def run(llm: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> list[tuple[list[int], list[float]]]:
    outs = llm.generate(input_ids=prompts, sampling_params=params)
    assert all(o.error is None for o in outs), [o.error for o in outs]
    return [(o.output_ids, [lp for lp, _ in o.output_token_logprobs]) for o in outs]


def accepted(llm: Engine) -> tuple[int, int]:
    info = llm.get_server_info()
    return info["spec_draft_tokens"], info["spec_accepted_tokens"]


@pytest.mark.parametrize("overlap", [True, False])
def test_greedy_tokens_are_plain_decodings_and_a_second_rollout_accepts_the_first(qwen3_dir: str, overlap: bool) -> None:
    prompts = [LOOP, random_tokens(23, seed=1), random_tokens(9, seed=2)]
    params = [greedy(), greedy(30), greedy(45, stop_token_ids=())]
    knobs = dict(KNOBS, disable_overlap_schedule=not overlap)
    with Engine(model=qwen3_dir, dtype="float32", **knobs) as llm:
        plain = run(llm, prompts, params)
    with Engine(model=qwen3_dir, dtype="float32", speculative_algorithm="ngram", **knobs) as llm:
        together = run(llm, prompts, params)
        alone = [run(llm, [p], [sp])[0] for p, sp in zip(prompts, params, strict=True)]
        before = accepted(llm)
        second = run(llm, [prompts[1]], [params[1]])[0]  # a second rollout: the first one drafts it
        drafted, kept = (a - b for a, b in zip(accepted(llm), before, strict=True))
    for spec in (together, alone, [second, second, second]):
        for (ids, lps), (want_ids, want_lps), p in zip(spec, plain, prompts, strict=True):
            if spec[0] is second and p is not prompts[1]:
                continue
            assert ids == want_ids
            assert max(abs(a - b) for a, b in zip(lps, want_lps, strict=True)) < 1e-4
    assert drafted >= 20 and kept >= 0.9 * drafted, (drafted, kept)


def test_deterministic_sampled_tokens_and_logprobs_are_bitwise_plain_decodings(qwen3_dir: str) -> None:
    prompts = [LOOP, random_tokens(17, seed=3), LOOP]
    params = [sampled(1), sampled(2), sampled(1)]  # the third: the first's second rollout
    knobs = dict(KNOBS, deterministic=True)
    with Engine(model=qwen3_dir, dtype="float32", **knobs) as llm:
        plain = [run(llm, [p], [sp])[0] for p, sp in zip(prompts, params, strict=True)]
    with Engine(model=qwen3_dir, dtype="float32", speculative_algorithm="ngram", **knobs) as llm:
        spec = [run(llm, [p], [sp])[0] for p, sp in zip(prompts, params, strict=True)]
        drafted, kept = accepted(llm)
    assert spec == plain
    assert plain[0] == plain[2]
    assert kept >= 20, (drafted, kept)


def test_a_stop_token_or_string_among_accepted_drafts_ends_the_request_there(qwen3_dir: str) -> None:
    with Engine(model=qwen3_dir, dtype="float32", **KNOBS) as llm:
        full = llm.generate(input_ids=[LOOP], sampling_params=greedy(40))[0]
        ids = full.output_ids
        stop_text = full.text[len(full.text) // 2 :][:3]
        by_text = llm.generate(input_ids=[LOOP], sampling_params=greedy(40, stop=(stop_text,)))[0]
    assert by_text.finish_reason == "stop" and len(by_text.output_ids) < len(ids)
    stop = ids[25]
    want = ids[: ids.index(stop) + 1]
    with Engine(model=qwen3_dir, dtype="float32", speculative_algorithm="ngram", **KNOBS) as llm:
        run(llm, [LOOP], [greedy(40)])  # its text drafts the next ones
        out = llm.generate(input_ids=[LOOP], sampling_params=greedy(40, stop_token_ids=(stop,)))[0]
        assert out.output_ids == want and out.finish_reason == "stop"
        text = llm.generate(input_ids=[LOOP], sampling_params=greedy(40, stop=(stop_text,)))[0]
        assert (text.output_ids, text.text, text.output_token_logprobs is not None) == (
            by_text.output_ids, by_text.text, True)
        assert len(text.output_token_logprobs) == len(text.output_ids)
        short = llm.generate(input_ids=[LOOP], sampling_params=greedy(7))[0]
        assert short.output_ids == ids[:7]
        assert accepted(llm)[1] > 0


def test_rollouts_of_older_weights_only_propose(qwen3_dir: str, qwen3_next_dir: str) -> None:
    """Rollouts on the old weights draft the ones after a release/resume and a weight update:
    the tokens are the new weights' plain decoding."""
    prompts, params = [LOOP, random_tokens(21, seed=5)], [greedy(32), greedy(32)]
    with Engine(model=qwen3_next_dir, dtype="float32", **KNOBS) as llm:
        want = run(llm, prompts, params)
    with Engine(model=qwen3_dir, dtype="float32", speculative_algorithm="ngram", **KNOBS) as llm:
        old = run(llm, prompts, params)
        llm.release_memory_occupation()
        llm.resume_memory_occupation()
        llm.update_weights_from_disk(qwen3_next_dir)
        got = run(llm, prompts, params)
        drafted, _ = accepted(llm)
    assert [ids for ids, _ in old] != [ids for ids, _ in want]
    assert [ids for ids, _ in got] == [ids for ids, _ in want]
    assert max(abs(a - b) for (_, x), (_, y) in zip(got, want, strict=True) for a, b in zip(x, y, strict=True)) < 1e-4
    assert drafted > 0


def test_two_ranks_verify_drafts_as_one(qwen3_dir: str) -> None:
    """At tp_size 2 (gloo) every rank samples each drafted position alike: a first and a second
    rollout give transformers' greedy tokens."""
    import torch
    from oracle import greedy_of
    from transformers import AutoModelForCausalLM

    want = greedy_of(AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32).eval(), [LOOP], 32)[0]
    with Engine(model=qwen3_dir, dtype="float32", tp_size=2, speculative_algorithm="ngram", **KNOBS) as llm:
        rollouts = [run(llm, [LOOP], [greedy(32)])[0][0] for _ in range(2)]
        drafted, kept = accepted(llm)
    assert rollouts == [want, want]
    assert kept >= 20, (drafted, kept)


# ---- the drafter --------------------------------------------------------------------------------


def _request(tokens: list[int], prompt: int, rid: str = "r", **kw: object) -> Request:
    req = Request(rid, tokens[:prompt], SamplingParams(max_new_tokens=64, **kw))
    req.token_ids = list(tokens)
    req.num_computed_tokens = len(tokens) - 1
    return req


def test_the_latest_word_aligned_occurrence_of_the_longest_window_drafts() -> None:
    words = bytearray(_encode([1, 2, 3, 4, 1, 2, 3, 9, 8, 1, 2]))
    assert _continuation(words, _encode([1, 2]), 3, len(words) - 4) == [3, 9, 8]  # the latest
    assert _continuation(words, _encode([2, 3, 4]), 2, len(words) - 4) == [1, 2]
    # An occurrence that runs into the end drafts the repeat on: period 2, then period 1.
    assert _continuation(bytearray(_encode([5, 1, 2, 1, 2])), _encode([1, 2]), 5, 16) == [1, 2, 1, 2, 1]
    assert _continuation(bytearray(_encode([7, 7, 7])), _encode([7, 7]), 3, 8) == [7, 7, 7]
    # bytes that match across word boundaries only: 0x0100 then 0x0002 spans "01 00 00 00 | 02 ..."
    assert _continuation(bytearray(_encode([256, 2, 7])), _encode([1 << 24]), 1, 12) == []
    d = NgramDrafter(num_draft_tokens=3, min_window=1, max_window=3, max_running=4)
    req = _request([7, 1, 2, 3, 5, 1, 2, 3, 6, 2, 3], prompt=4)
    assert d.propose(d.candidates([req])) == 1 and req.draft_token_ids == [6, 2, 3]  # [6, 2, 3] never came before: [2, 3] did
    capped = _request([1, 2, 1, 2, 1], prompt=2, rid="capped")
    capped.sampling_params = SamplingParams(max_new_tokens=5)  # 3 outputs so far: room for 1 draft + 1
    d.propose(d.candidates([capped]))
    assert capped.draft_token_ids == [2]


def test_rejections_back_off_and_rollouts_of_the_prompt_draft() -> None:
    d = NgramDrafter(num_draft_tokens=2, min_window=1, max_window=2, max_running=2)
    req = _request([4, 4, 4, 4], prompt=2)
    for _ in range(MISSES):
        assert d.propose(d.candidates([req])) == 1
        d.verified(req, 2, 0)
    assert d.candidates([req]) == []  # backing off
    penalized = _request([4, 4, 4, 4], prompt=2, rid="p", repetition_penalty=1.2)
    assert d.candidates([penalized]) == []
    assert d.candidates([_request([4, 4, 4], 2, str(i)) for i in range(3)]) == []  # more than max_running
    done = _request([9, 8, 1, 2, 3, 4, 5], prompt=2, rid="done")
    done.finish("length")
    d.finished(done)
    again = _request([9, 8, 1, 2], prompt=2, rid="again")
    assert d.propose(d.candidates([again])) == 1 and again.draft_token_ids == [3, 4]


def test_accepted_rows_keep_each_draft_up_to_the_first_differing_token() -> None:
    class S:
        def __init__(self, t: int) -> None:
            self.token_id = t

    a, b = _request([1, 2], 1, "a"), _request([3, 4], 1, "b")
    batch = Batch(requests=[a, b], num_new_tokens=[4, 1], drafts={0: [5, 6, 7]})
    rows = [(a, S(5)), (a, S(6)), (a, S(0)), (a, S(7)), (b, S(9))]
    d = NgramDrafter(3, 1, 2, 4)
    kept = d.accepted_rows(batch, rows)
    assert [(r.request_id, s.token_id) for r, s in kept] == [("a", 5), ("a", 6), ("a", 0), ("b", 9)]
    assert (d.proposed, d.accepted) == (3, 2)


def test_config_names_of_both_dialects() -> None:
    vllm = EngineConfig(speculative_config='{"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_max": 5}')
    assert (vllm.speculative_algorithm, vllm.speculative_num_draft_tokens, vllm.speculative_ngram_max_match_window_size) == (
        "ngram", 6, 5)
    assert EngineConfig(speculative_algorithm="NGRAM").speculative_algorithm == "ngram"
    for bad in (dict(speculative_algorithm="eagle3"), dict(speculative_config='{"method": "ngram", "n": 1}'),
                dict(speculative_config="ngram"), dict(speculative_algorithm="ngram", speculative_num_draft_tokens=0)):
        with pytest.raises(ConfigError):
            EngineConfig(**bad)
