"""Sampler: what it does to a row's logits before the draw, each against an expectation computed
independently: repetition, frequency and presence penalties, min_new_tokens, logit_bias, extreme
values that must stay numbers, and the logprobs it reports (the draws themselves: test_sampler.py)."""

from __future__ import annotations

import math

import pytest
import torch
from test_sampler import CPU, make_request, sample

from engine.request import SamplingParams
from engine.runner.sampler import Sampler
from engine.runner.sampling_batch import SamplingBatch


def penalized_by_hand(
    logits: list[float], prompt: list[int], output: list[int], rep: float, freq: float, pres: float
) -> list[float]:
    out = []
    for token, x in enumerate(logits):
        if token in prompt or token in output:
            x = x / rep if x > 0 else x * rep
        x -= freq * output.count(token)
        x -= pres * (1.0 if token in output else 0.0)
        out.append(x)
    return out


def test_penalties_exact() -> None:
    logits = [2.0, -1.0, 0.5, -0.25, 3.0, 0.0, 1.5, -2.0]
    cases = [
        ([0, 1], [2, 2, 3], 1.3, 0.0, 0.0),
        ([4, 5], [1, 1, 1, 6], 1.0, 0.5, 0.0),
        ([7], [0, 3, 3], 1.0, 0.0, 0.7),
        ([1, 4, 6], [6, 6, 2, 7], 0.8, -0.3, 1.1),
        ([0], [], 1.0, 0.0, 0.0),  # neutral row next to penalised ones
    ]
    reqs = [
        make_request(prompt, output, repetition_penalty=r, frequency_penalty=f, presence_penalty=p)
        for prompt, output, r, f, p in cases
    ]
    batch = SamplingBatch.from_requests(reqs, CPU)
    got = Sampler().process_logits(torch.tensor([logits] * len(cases)), batch)
    want = [penalized_by_hand(logits, *case) for case in cases]
    assert torch.allclose(got, torch.tensor(want), atol=1e-6)


def test_neutral_batch_skips_penalty_work() -> None:
    batch = SamplingBatch.from_requests([make_request(output=[1, 2])], CPU)
    assert batch.seen_pairs is None and batch.output_pairs is None and batch.banned_pairs is None


def test_min_new_tokens_blocks_eos_and_stop_tokens() -> None:
    logits = torch.full((4, 10), -100.0)
    logits[:, 2] = 50.0  # eos
    logits[:, 3] = 40.0  # stop token
    logits[:, 5] = 1.0
    reqs = [
        make_request(eos=(2,), output=[5], min_new_tokens=3, stop_token_ids=[3], temperature=0.0),
        make_request(
            eos=(2,),
            output=[5],
            min_new_tokens=3,
            ignore_eos=True,
            stop_token_ids=[3],
            temperature=0.0,
        ),
        make_request(
            eos=(2,), output=[5, 5, 5], min_new_tokens=3, stop_token_ids=[3], temperature=0.0
        ),
        make_request(eos=(2,), output=[5], min_new_tokens=3, stop_token_ids=[3]),
    ]
    assert sample(logits, reqs).token_ids == [5, 2, 2, 5]


def test_logit_bias_is_added_after_penalties() -> None:
    logits = [2.0, -1.0, 0.5, -0.25]
    reqs = [
        make_request([0], [], repetition_penalty=2.0, logit_bias={0: 1.5, 3: -0.5}),
        make_request(logit_bias=((1, 10.0),)),
        make_request(),
    ]
    got = Sampler().process_logits(torch.tensor([logits] * 3), SamplingBatch.from_requests(reqs, CPU))
    want = [[2.0 / 2.0 + 1.5, -1.0, 0.5, -0.75], [2.0, 9.0, 0.5, -0.25], logits]
    assert torch.allclose(got, torch.tensor(want))
    assert sample(torch.tensor([logits] * 3), [make_request(temperature=0.0, logit_bias={2: 5.0})] * 3).token_ids == [2] * 3
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={1: float("nan")})


def test_extreme_penalties_biases_and_temperatures_give_numbers() -> None:
    """Float32-finite values that overflow once applied (a repetition penalty that rounds to 0 or
    multiplies past float32, biases at float32's edge, temperatures down to SAMPLING_EPS) give
    finite logprobs and the limit's tokens; a temperature below SAMPLING_EPS is greedy; values
    float32 cannot hold are refused."""
    logits = torch.tensor([[2.0, -1.0, 0.0, 0.5, -3.0]] * 5)
    reqs = [
        make_request([0, 1, 2], repetition_penalty=1e-300, top_logprobs_num=5),  # 2 / 0: +inf
        make_request([0, 1, 2], repetition_penalty=3.0e38, top_logprobs_num=5),  # -1 * 3e38: -inf
        make_request(logit_bias={3: 3.0e38, 4: -3.0e38}, top_logprobs_num=5, temperature=2e-6),
        make_request([0], repetition_penalty=1e-300, presence_penalty=-2.0, output=[0], temperature=2e-6),
        make_request(temperature=1e-30, top_logprobs_num=5),
    ]
    out = sample(logits, reqs)
    assert out.token_ids[0] == 0 and out.token_ids[2] == 3 and out.token_ids[3] == 0  # the limits' winners
    assert out.token_ids[4] == 0 and reqs[4].sampling_params.greedy  # T < SAMPLING_EPS: argmax, at T = 1
    assert out.logprobs[4] == pytest.approx(torch.log_softmax(logits[4], -1)[0].item(), abs=1e-6)
    assert out.top_logprobs is not None
    for lp, top in zip(out.logprobs, out.top_logprobs, strict=True):
        assert math.isfinite(lp) and all(math.isfinite(v) for _, v in top), out
    for bad in ({"repetition_penalty": 1e39}, {"temperature": 1e300}, {"presence_penalty": float("inf")},
                {"logit_bias": {1: -1e39}}):
        with pytest.raises(ValueError, match="finite"):
            SamplingParams(**bad)  # type: ignore[arg-type]


def test_logprobs_are_log_softmax_of_penalised_scaled_logits() -> None:
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(4))
    reqs = [
        make_request(temperature=0.0, top_logprobs_num=5, repetition_penalty=1.5, output=[0, 1]),
        make_request(temperature=0.5, top_k=3, top_logprobs_num=2),
        make_request(temperature=1.3, top_p=0.5),
    ]
    out = sample(logits, reqs)
    penalised = Sampler().process_logits(logits, SamplingBatch.from_requests(reqs, CPU))
    for i, temperature in enumerate((1.0, 0.5, 1.3)):
        row = torch.log_softmax(penalised[i].double() / temperature, dim=-1).tolist()
        assert out.logprobs[i] == pytest.approx(row[out.token_ids[i]], abs=1e-5)
        best = sorted(range(40), key=lambda j, row=row: -row[j])[
            : reqs[i].sampling_params.top_logprobs_num
        ]
        assert out.top_logprobs is not None
        assert [t for t, _ in out.top_logprobs[i]] == best
        assert [lp for _, lp in out.top_logprobs[i]] == pytest.approx(
            [row[j] for j in best], abs=1e-5
        )
    assert out.top_logprobs is not None and out.top_logprobs[2] == []


def test_no_top_logprobs_when_none_asked() -> None:
    out = sample(torch.randn(2, 10), [make_request(), make_request(temperature=0.0)])
    assert out.top_logprobs is None and len(out.logprobs) == 2
