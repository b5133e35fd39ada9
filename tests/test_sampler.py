"""Sampler: distributions (by counting many draws), truncation supports, greedy and seeds, each
against an expectation computed independently (penalties, bias, min_new_tokens and logprobs:
test_sampler_logits.py)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from engine.request import Request, SamplingParams
from engine.runner.sampler import Sampler
from engine.runner.sampling_batch import SamplingBatch
from engine.runner.step_inputs import Uploader

CPU = torch.device("cpu")
N_DRAWS = 20_000
# Standard error of a frequency is <= 0.0036 at N_DRAWS; 0.015 is over 4 of them.
TOLERANCE = 0.015


def make_request(
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    eos: tuple[int, ...] = (),
    **params: object,
) -> Request:
    r = Request("r", list(prompt or [1]), SamplingParams(**params), eos_token_ids=eos)  # type: ignore[arg-type]
    r.token_ids += list(output or [])  # as if sampled, without finishing the request
    return r


def sample(logits: torch.Tensor, requests: list[Request], sampler: Sampler | None = None):
    batch = SamplingBatch.from_requests(requests, CPU)
    return (sampler or Sampler(seed=0))(logits, batch)


def frequencies(probs: list[float], **params: object) -> list[float]:
    """Empirical token frequencies of N_DRAWS rows whose logits are log(probs)."""
    logits = torch.tensor(probs).log().repeat(N_DRAWS, 1)
    tokens = sample(logits, [make_request(**params) for _ in range(N_DRAWS)]).token_ids
    return [tokens.count(i) / N_DRAWS for i in range(len(probs))]


def softmax(xs: list[float]) -> list[float]:
    m = max(xs)
    e = [math.exp(x - m) for x in xs]
    return [v / sum(e) for v in e]


def assert_close(got: list[float], want: list[float], tol: float = TOLERANCE) -> None:
    assert max(abs(g - w) for g, w in zip(got, want, strict=True)) < tol, (got, want)


def test_temperature_sampling_matches_softmax() -> None:
    logits = [1.0, 0.5, 0.0, -0.5, 2.0, -1.0]
    for temperature in (1.0, 0.7, 2.0):
        want = softmax([x / temperature for x in logits])
        assert_close(frequencies(softmax(logits), temperature=temperature), want)


def test_top_k_support_and_renormalisation() -> None:
    probs = [0.05, 0.3, 0.1, 0.25, 0.2, 0.1]
    got = frequencies(probs, top_k=3)
    assert all(got[i] == 0 for i in (0, 2, 5))
    assert_close(got, [0, 0.3 / 0.75, 0, 0.25 / 0.75, 0.2 / 0.75, 0])


@pytest.mark.parametrize(
    "top_p, kept",
    [(0.3, [0]), (0.65, [0, 1]), (0.75, [0, 1, 2]), (0.95, [0, 1, 2, 3]), (1.0, [0, 1, 2, 3])],
)
def test_top_p_support(top_p: float, kept: list[int]) -> None:
    probs = [0.4, 0.3, 0.2, 0.1]
    got = frequencies(probs, top_p=top_p)
    mass = sum(probs[i] for i in kept)
    assert_close(got, [probs[i] / mass if i in kept else 0.0 for i in range(4)])
    assert all(got[i] == 0 for i in range(4) if i not in kept)


def test_top_k_then_top_p_uses_renormalised_probs() -> None:
    # After top_k=2 the probs are 4/7, 3/7: top_p 0.5 keeps only the best token.
    got = frequencies([0.4, 0.3, 0.2, 0.1], top_k=2, top_p=0.5)
    assert got == [1.0, 0.0, 0.0, 0.0]


def test_min_p_support() -> None:
    probs = [0.5, 0.3, 0.12, 0.08]
    got = frequencies(probs, min_p=0.2)  # threshold 0.1: token 3 goes
    assert got[3] == 0
    assert_close(got, [p / 0.92 for p in probs[:3]] + [0.0])


def test_greedy_is_argmax() -> None:
    logits = torch.randn(32, 100, generator=torch.Generator().manual_seed(1))
    want = [max(range(100), key=lambda j, row=row: row[j]) for row in logits.tolist()]
    half = [make_request(temperature=0.0) for _ in range(16)]
    top1 = [make_request(temperature=1.5, top_k=1) for _ in range(16)]
    assert sample(logits, half + top1).token_ids == want


def test_mixed_batch_greedy_rows_stay_greedy() -> None:
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(2))
    reqs = [make_request(temperature=0.0 if i % 2 else 1.0, top_p=0.9) for i in range(8)]
    tokens = sample(logits, reqs).token_ids
    assert [tokens[i] for i in range(1, 8, 2)] == logits[1::2].argmax(-1).tolist()


def test_unseeded_rows_follow_the_sampler_seed() -> None:
    logits = torch.zeros(64, 1000)
    reqs = [make_request() for _ in range(64)]
    a = sample(logits, reqs, Sampler(seed=5)).token_ids
    assert a == sample(logits, reqs, Sampler(seed=5)).token_ids
    assert a != sample(logits, reqs, Sampler(seed=6)).token_ids


def test_seeded_row_independent_of_batch_and_sampler() -> None:
    vocab = 1000
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(3))
    seeded = make_request(seed=1234, output=[7, 8, 9])
    alone = [sample(logits, [seeded], Sampler(seed=s)).token_ids[0] for s in range(3)]
    assert len(set(alone)) == 1
    others = [make_request(), make_request(temperature=0.0), make_request(seed=99, top_k=5)]
    big = torch.cat([torch.randn(3, vocab), logits, torch.randn(2, vocab)])
    batch = [others[0], others[1], others[2], seeded, make_request(top_p=0.5), make_request()]
    assert sample(big, batch, Sampler(seed=77)).token_ids[3] == alone[0]


def test_seed_and_step_change_the_draw() -> None:
    logits = torch.zeros(1, 1000)
    by_seed = {sample(logits, [make_request(seed=s)]).token_ids[0] for s in range(20)}
    by_step = {
        sample(logits, [make_request(seed=1, output=[5] * n)]).token_ids[0] for n in range(20)
    }
    assert len(by_seed) > 10 and len(by_step) > 10


def test_seeded_rows_have_the_right_distribution() -> None:
    # Same seed, different steps: the draws across steps follow softmax.
    probs = [0.5, 0.3, 0.2]
    logits = torch.tensor(probs).log()[None, :]
    n = 3000
    tokens = [
        sample(logits, [make_request(seed=11, output=[0] * i)]).token_ids[0] for i in range(n)
    ]
    assert_close([tokens.count(i) / n for i in range(3)], probs, tol=0.04)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_sampling_seeds_and_no_sync_before_the_read() -> None:
    """Building the sampling inputs and launching the sampling never synchronize (the engine
    packs step k+1 while step k runs); reading the results is the one wait."""
    cuda = torch.device("cuda")
    probs = [0.05, 0.3, 0.1, 0.25, 0.2, 0.1]
    reqs = [make_request(top_k=4, top_p=0.85, seed=i if i % 2 else None) for i in range(N_DRAWS)]
    logits = torch.tensor(probs, device=cuda).log().repeat(N_DRAWS, 1)
    sampler, upload = Sampler(seed=0, device=cuda), Uploader(cuda)
    SamplingBatch.from_requests(reqs, cuda, upload)  # the first call allocates the pinned buffers
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as syncs:
            warnings.simplefilter("always")
            launched = sampler.sample(logits, SamplingBatch.from_requests(reqs, cuda, upload))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert [str(w.message) for w in syncs if "synchroniz" in str(w.message)] == []
    tokens = launched.wait().token_ids
    # top_k 4 keeps 0.3, 0.25, 0.2 and a 0.1; renormalised, the mass before that 0.1 is
    # 0.75 / 0.85 > top_p, so top_p cuts it.
    got = [tokens.count(i) / N_DRAWS for i in range(6)]
    assert got[0] == got[2] == got[5] == 0
    assert_close([got[1], got[3], got[4]], [0.3 / 0.75, 0.25 / 0.75, 0.2 / 0.75])

    seeded = make_request(seed=1234, output=[7, 8, 9])
    vocab_logits = torch.randn(6, 1000, device=cuda)
    alone = sampler(vocab_logits[3:4], SamplingBatch.from_requests([seeded], cuda)).token_ids[0]
    mixed = [make_request(), make_request(temperature=0.0), make_request(seed=5)] + [seeded] * 3
    assert (
        sampler(
            vocab_logits[[0, 1, 2, 3, 3, 3]], SamplingBatch.from_requests(mixed, cuda)
        ).token_ids[3:]
        == [alone] * 3
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("vocab", [5, 1024, 1000, 151936])
@pytest.mark.parametrize("wide", [False, True])
def test_cuda_lse_argmax_equals_torch(vocab: int, wide: bool) -> None:
    """The sampler's CUDA log-sum-exp and argmax of logits / T (engine/kernels/lse_argmax.py)
    against torch's on the same quotient, for float32 and bf16 logits: banned (-inf) tokens, a
    row all -inf, ties broken toward the first index; its (token, logprob) pairs are the torch
    path's bit for bit (NaN where the row is all -inf). `wide`: the pieces a decode graph of more
    than GRAPH_WIDE_ROWS rows reads (graph_config)."""
    from engine.kernels import lse_argmax as la

    def lse_argmax(x: torch.Tensor, t: torch.Tensor, counts: torch.Tensor | None = None):
        return la.lse_argmax(x, t, counts, config=la.graph_config(la.GRAPH_WIDE_ROWS + 1) if wide else None)

    g = torch.Generator(device="cuda").manual_seed(vocab)
    x = torch.randn(9, vocab, device="cuda", generator=g) * 4
    x[1, ::3] = float("-inf")
    x[2] = float("-inf")
    top = x[3].max() + 1
    x[3, [vocab - 1, vocab // 2, 1 % vocab]] = top  # the same maximum in up to three chunks
    counts = torch.zeros(16, dtype=torch.int32, device="cuda")
    temps = torch.rand(9, device="cuda", generator=g) + 0.25
    temps[0] = 1.0
    for logits in (x, x.to(torch.bfloat16)):
        scaled = logits / temps[:, None]  # the sampler's division: float32, bf16 promoted
        lse, tokens, pairs = lse_argmax(logits, temps, counts)
        assert torch.equal(lse_argmax(logits, temps, counts)[1], tokens)  # the counters came back to zero
        assert not counts.any()
        want = torch.logsumexp(scaled.double(), dim=-1)
        assert torch.equal(tokens, scaled.argmax(dim=-1))
        assert lse[2].item() == float("-inf")
        finite = torch.isfinite(want)
        assert torch.allclose(lse[finite].double(), want[finite], rtol=1e-6, atol=1e-6)
        chosen = torch.div(logits.gather(1, tokens[:, None]), temps[:, None])  # the sampler's torch path
        torch.testing.assert_close(pairs, torch.cat([tokens[:, None].double(), (chosen - lse[:, None]).double()], 1),
                                   rtol=0, atol=0, equal_nan=True)  # fmt: skip
    empty_lse, empty_tokens, empty_pairs = lse_argmax(x[:0], temps[:0])
    assert empty_lse.shape == (0,) and empty_tokens.shape == (0,) and empty_pairs.shape == (0, 2)
