"""Scheduler + BlockManager driven by a pure-Python model over a paged "KV cache"
(tests/paged_model.py): outputs equal each sequence's reference under chunked prefill,
preemption, prefix caching and overlap; refusals name the limit they break.
"""

from __future__ import annotations

import random

import pytest
from paged_model import VOCAB, FakeModel, admit, apply, make, new_sched, prompts, reference, run

from engine.limits import RequestLimits, prompt_error
from engine.memory import kv_cache
from engine.request import (
    FINISH_ABORT,
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_STOP,
    Batch,
    Request,
    SamplingParams,
)


def test_outputs_match_the_reference() -> None:
    sched = new_sched()
    reqs = [make(f"r{i}", p) for i, p in enumerate(prompts(5, 9))]
    run(sched, reqs)
    for r in reqs:
        assert r.finish_reason == FINISH_LENGTH
        assert r.output_token_ids == reference(r.prompt_token_ids, 6)
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def test_chunked_prefill_respects_budget_and_matches_unchunked() -> None:
    ps = prompts(4, 23)
    big = [make(f"r{i}", p) for i, p in enumerate(ps)]
    run(new_sched(budget=512), big)
    small = [make(f"r{i}", p) for i, p in enumerate(ps)]
    batches, _ = run(new_sched(budget=7), small)
    assert all(b.num_tokens <= 7 for b in batches)
    first = batches[0]
    assert first.requests == [small[0]] and first.num_new_tokens == [7]  # a chunk of the prompt
    assert not first.samples(0)
    for a, b in zip(big, small, strict=True):
        assert b.output_token_ids == a.output_token_ids == reference(a.prompt_token_ids, 6)


@pytest.mark.parametrize("prefix", [True, False])
def test_preemption_under_a_tiny_cache_is_invisible(prefix: bool) -> None:
    ps = prompts(6, 8, seed=3)
    big = [make(f"r{i}", p, max_new=12) for i, p in enumerate(ps)]
    run(new_sched(num_blocks=256, prefix=prefix), big)
    # The longest request needs 8 + 5 + 12 = 25 tokens: 7 blocks of 4; the cache holds 8.
    sched = new_sched(num_blocks=8, prefix=prefix)
    tiny = [make(f"r{i}", p, max_new=12) for i, p in enumerate(ps)]
    run(sched, tiny)
    assert sum(r.num_preemptions for r in tiny) > 0
    for a, b in zip(big, tiny, strict=True):
        assert b.finish_reason == FINISH_LENGTH and b.num_output_tokens == 12
        assert b.output_token_ids == a.output_token_ids == reference(a.prompt_token_ids, 12)
    bm = sched.block_manager
    assert bm.num_free_blocks == bm.num_blocks and bm.num_used_blocks == 0


def test_every_running_request_decodes_each_step_when_blocks_allow() -> None:
    sched = new_sched(num_blocks=64)
    reqs = [make(f"r{i}", p, max_new=5) for i, p in enumerate(prompts(3, 4))]
    batches, _ = run(sched, reqs)
    assert [len(b) for b in batches] == [3] * 5  # one prefill step samples token 1, four decodes
    assert all(b.is_decode for b in batches[1:])


def test_request_that_can_never_fit_is_refused_with_the_limit_it_breaks() -> None:
    """engine.limits.prompt_error, as the engine core applies it before the scheduler sees a request."""
    sched = new_sched(num_blocks=8)  # 32 tokens of KV
    ok1 = make("ok1", list(range(10)), max_new=4)
    too_big = make("big", list(range(30)), max_new=5)  # 35 tokens: 9 blocks
    too_long = make("long", list(range(40)), max_new=1)  # 41 > max_model_len
    ok2 = make("ok2", list(range(5, 15)), max_new=4)
    assert [admit(sched, r, max_model_len=40) for r in (ok1, too_big, too_long, ok2)] == [True, False, False, True]
    _, failed = run(sched, [])
    assert failed == [] and too_big.finish_reason == FINISH_ERROR and too_long.finish_reason == FINISH_ERROR
    assert too_big.error == ("prompt (30 tokens) + max_new_tokens (5) needs 9 KV blocks of 4 tokens, "
                             "but the KV cache holds only 8 (32 tokens)")
    assert too_long.error == "prompt (40 tokens) + max_new_tokens (1) exceeds the context length of 40 tokens"
    assert too_big.block_table == [] and too_big.num_output_tokens == 0
    for r in (ok1, ok2):
        assert r.finish_reason == FINISH_LENGTH
        assert r.output_token_ids == reference(r.prompt_token_ids, 4)
    assert sched.block_manager.num_free_blocks == 8


def test_prompt_rules_name_the_first_bad_field() -> None:
    limits = RequestLimits(vocab_size=50, max_model_len=64, kv_blocks=100, block_size=4)
    ok = SamplingParams(max_new_tokens=4)
    assert prompt_error([1, 2, 3], ok, limits) is None
    assert prompt_error([], ok, limits) == "the prompt is empty"
    assert prompt_error([1, 50, -1], ok, limits) == "token id 50 is outside the vocabulary [0, 50)"
    biased = SamplingParams(max_new_tokens=4, logit_bias={3: 1.0, 77: -1.0})
    assert prompt_error([1], biased, limits) == "logit_bias token id 77 is outside the vocabulary [0, 50)"
    stops = SamplingParams(max_new_tokens=4, stop_token_ids=[3, 50])
    assert prompt_error([1], stops, limits) == "stop_token_ids token id 50 is outside the vocabulary [0, 50)"
    assert prompt_error([1], SamplingParams(max_new_tokens=4, top_logprobs_num=20), limits) is None
    tiny = RequestLimits(vocab_size=8, max_model_len=64, kv_blocks=100, block_size=4, eos_token_ids=(7,))
    assert prompt_error([1], SamplingParams(max_new_tokens=4, top_logprobs_num=9), tiny) == (
        "top_logprobs_num 9 exceeds the vocabulary's 8 tokens")
    # min_new_tokens bans what would end the request: with EOS, 7 stop ids leave no token; ignore_eos leaves 7.
    ends = SamplingParams(max_new_tokens=4, min_new_tokens=1, stop_token_ids=list(range(7)))
    assert prompt_error([1], ends, tiny) == "min_new_tokens 1 can never be met: every token of the vocabulary ends the request"
    assert prompt_error([1], SamplingParams(max_new_tokens=4, min_new_tokens=1, stop_token_ids=list(range(7)), ignore_eos=True), tiny) is None
    assert prompt_error([1], SamplingParams(max_new_tokens=4, stop_token_ids=list(range(7))), tiny) is None  # no ban
    assert prompt_error([1] * 60, ok, limits) is None  # 64 tokens: exactly the context
    assert "exceeds the context length of 64" in prompt_error([1] * 61, ok, limits)


def test_abort_frees_blocks() -> None:
    sched = new_sched(num_blocks=16, max_seqs=2)
    model = FakeModel(sched.block_manager)
    a, b, c = (make(x, p, max_new=20) for x, p in zip("abc", prompts(3, 6), strict=True))
    for r in (a, b, c):
        sched.add(r)
    for _ in range(3):
        batch = sched.schedule()
        apply(sched, batch, model)
    assert (sched.running, list(sched.waiting)) == ([a, b], [c])
    assert sched.request_ids() == ["a", "b", "c"]
    assert sched.abort("nope") is None
    assert sched.abort("c") is c and c.finish_reason == FINISH_ABORT and sched.num_waiting == 0
    used = sched.block_manager.num_used_blocks
    a_blocks = len(a.block_table)
    assert sched.abort("a") is a and a.finish_reason == FINISH_ABORT
    assert a.block_table == [] and sched.block_manager.num_used_blocks == used - a_blocks
    # Aborted between the launch and the read of a step: its token is dropped.
    batch = sched.schedule()
    assert batch.requests == [b]
    model.step(batch)
    assert sched.advance(batch) == [b] and b.num_pending == 1
    sched.abort("b")
    assert sched.resolve(batch, []) == []
    assert not sched.has_unfinished() and sched.block_manager.num_used_blocks == 0
    with pytest.raises(ValueError):
        sched.add(b)  # a finished request is not new


def test_max_num_seqs_and_batch_order() -> None:
    sched = new_sched(max_seqs=2)
    model = FakeModel(sched.block_manager)
    reqs = [make(f"r{i}", p, max_new=3) for i, p in enumerate(prompts(4, 5))]
    sched.add(reqs[0])
    batch = sched.schedule()
    apply(sched, batch, model)
    for r in reqs[1:]:
        sched.add(r)
    batch = sched.schedule()
    assert batch.requests == [reqs[0], reqs[1]] and batch.num_new_tokens == [1, 6]
    assert sched.num_running == 2 and sched.num_waiting == 2
    apply(sched, batch, model)
    batches, _ = run(sched, [], model)
    assert all(len(b) <= 2 for b in batches)
    assert all(r.output_token_ids == reference(r.prompt_token_ids, 3) for r in reqs)


def test_prefix_cache_hits_through_the_scheduler() -> None:
    system = [(5 * j + 1) % VOCAB for j in range(16)]
    first = make("first", system + [1, 2, 3])
    sched = new_sched()
    model = FakeModel(sched.block_manager)
    run(sched, [first], model)
    later = [make(f"l{i}", system + [i, i + 1]) for i in range(3)]
    run(sched, later, model)
    assert first.num_cached_tokens == 0
    assert [r.num_cached_tokens for r in later] == [16, 16, 16]
    for r in [first, *later]:
        assert r.output_token_ids == reference(r.prompt_token_ids, 6)
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def test_eos_finishes_early() -> None:
    p = prompts(1, 7)[0]
    expected = reference(p, 6)
    r = make("r", p, eos=(expected[2],))
    sched = new_sched()
    run(sched, [r])
    assert r.finish_reason == FINISH_STOP
    assert r.output_token_ids == expected[: expected.index(expected[2]) + 1]
    assert sched.block_manager.num_used_blocks == 0


def test_empty_batch_when_idle() -> None:
    sched = new_sched()
    batch = sched.schedule()
    assert len(batch) == 0 and batch.num_tokens == 0
    assert sched.advance(batch) == [] and sched.resolve(batch, []) == []


def test_resolve_rejects_a_token_nobody_sampled() -> None:
    sched = new_sched(budget=2)
    r = make("r", [1, 2, 3])
    sched.add(r)
    batch = sched.schedule()  # a chunk of 2 of 3 prompt tokens: samples nothing
    assert sched.advance(batch) == [] and r.num_pending == 0
    with pytest.raises(RuntimeError, match="no pending token"):
        sched.resolve(batch, [(r, 7)])


def test_finish_all() -> None:
    sched = new_sched(max_seqs=1)
    reqs = [make(f"r{i}", p) for i, p in enumerate(prompts(3, 5))]
    for r in reqs:
        sched.add(r)
    sched.schedule()
    assert sched.finish_all() == reqs
    assert all(r.finish_reason == FINISH_ABORT for r in reqs)
    assert not sched.has_unfinished() and sched.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
@pytest.mark.parametrize("seed", range(8))
def test_random_workloads_match_the_reference(seed: int, overlap: bool) -> None:
    """Shared prefixes, tiny caches, small budgets, late arrivals, EOS and aborts, all at once.
    With overlap, step k+1 is scheduled and run before step k's tokens are resolved (its pending
    inputs come from step k's samples, as on the device); aborts land between the two."""
    rng = random.Random(seed)
    block_size = rng.randint(1, 5)
    num_blocks = rng.randint(12, 24) // block_size + 6
    sched = new_sched(
        num_blocks=num_blocks,
        block_size=block_size,
        budget=rng.randint(4, 24),
        max_seqs=rng.randint(1, 6),
        prefix=seed % 4 != 3,
    )
    model = FakeModel(sched.block_manager)
    stems = [[rng.randrange(VOCAB) for _ in range(rng.randint(0, 12))] for _ in range(3)]
    reqs: list[Request] = []
    for i in range(20):
        prompt = rng.choice(stems) + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 8))]
        eos = (rng.randrange(VOCAB),) if rng.random() < 0.3 else ()
        reqs.append(make(f"r{i}", prompt, max_new=rng.randint(1, 10), eos=eos))
    pending, aborted, failed = list(reqs), set(), []
    in_flight: tuple[Batch, list[Request], dict[str, int]] | None = None
    for _ in range(10_000):
        if not (pending or sched.has_unfinished() or in_flight):
            break
        if pending and rng.random() < 0.5:
            req = pending.pop(0)
            if not admit(sched, req):
                failed.append(req)
        if rng.random() < 0.03 and sched.has_unfinished():
            victim = rng.choice([*sched.running, *sched.waiting])
            assert sched.abort(victim.request_id) is victim
            aborted.add(victim.request_id)
        batch = sched.schedule()
        assert batch.num_tokens <= sched.max_num_batched_tokens
        assert sched.num_running <= sched.max_num_seqs
        if not overlap:
            apply(sched, batch, model)
            continue
        launched = None
        if len(batch) > 0:
            sampled = model.step(batch, in_flight[2] if in_flight else None)
            launched = (batch, sched.advance(batch), sampled)
        if in_flight is not None:
            done, sampling, sampled = in_flight
            sched.resolve(done, [(r, sampled[r.request_id]) for r in sampling if not r.finished])
        in_flight = launched
    else:
        raise AssertionError("no progress")
    bm = sched.block_manager
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == bm.num_blocks
    for r in reqs:
        fits = bm.blocks_needed(r.max_total_tokens) <= bm.num_blocks
        if r.request_id in aborted:
            assert r.finish_reason == FINISH_ABORT
            continue
        assert (r in failed) == (not fits)
        if not fits:
            assert r.finish_reason == FINISH_ERROR
            continue
        expected = reference(r.prompt_token_ids, r.sampling_params.max_new_tokens)
        stops = [k for k, t in enumerate(expected) if t in r.eos_token_ids]
        if stops:
            assert r.finish_reason == FINISH_STOP
            expected = expected[: stops[0] + 1]
        else:
            assert r.finish_reason == FINISH_LENGTH
        assert r.output_token_ids == expected


@pytest.mark.parametrize("seed", range(4))
def test_random_workloads_with_colliding_hashes(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Four hash values in all: collisions everywhere must cost hits, never outputs."""
    monkeypatch.setattr(kv_cache, "hash_block", lambda parent, tokens: bytes([sum(tokens) % 4]))
    test_random_workloads_match_the_reference(seed, overlap=seed % 2 == 1)


def test_samples_wait_for_their_prompts_prefill_without_holding_back_other_prompts() -> None:
    """n > 1 requests queue as A0..A3, B0..B3, C0..C3. Step 1 admits the first sample of each
    prompt (the others are passed over, keeping their places); step 2 admits every other sample
    with the prompt's full blocks from the prefix cache. Outputs equal the reference."""
    sched = new_sched(num_blocks=128, block_size=4, budget=256, max_seqs=16)
    groups = prompts(3, 10)  # 10-12 tokens: 2-3 full blocks each
    reqs = [make(f"{g}#{i}", p) for g, p in zip("ABC", groups, strict=True) for i in range(4)]
    model = FakeModel(sched.block_manager)
    for r in reqs:
        sched.add(r)
    first = sched.schedule()
    assert [r.request_id for r in first.requests] == ["A#0", "B#0", "C#0"]
    assert [r.request_id for r in sched.waiting] == [f"{g}#{i}" for g in "ABC" for i in range(1, 4)]
    apply(sched, first, model)
    second = sched.schedule()
    assert [r.request_id for r in second.requests] == [r.request_id for r in first.requests] + [
        f"{g}#{i}" for g in "ABC" for i in range(1, 4)]
    for r in second.requests[3:]:
        full = (r.num_prompt_tokens // 4) * 4
        assert r.num_cached_tokens == (full if full < r.num_prompt_tokens else full - 4), r.request_id
    apply(sched, second, model)
    run(sched, [], model)
    for r in reqs:
        assert r.output_token_ids == reference(r.prompt_token_ids, 6)


def test_a_sample_does_not_overtake_a_request_that_does_not_fit() -> None:
    """Passing over waiting samples never lets a later request overtake one that does not fit."""
    sched = new_sched(num_blocks=128, block_size=4, budget=24, max_seqs=16)
    a, big, small = prompts(1, 10, seed=1)[0], prompts(1, 30, seed=2)[0], prompts(1, 5, seed=3)[0]
    for r in (make("A#0", a), make("A#1", a), make("big", big), make("small", small)):
        sched.add(r)
    batch = sched.schedule()
    # A#0 (10 tokens) runs; A#1 is passed over; "big" (30 tokens) gets a 14-token chunk; the budget
    # is then spent, so "small" waits behind it.
    assert [r.request_id for r in batch.requests] == ["A#0", "big"]
    assert [r.request_id for r in sched.waiting] == ["A#1", "small"]
