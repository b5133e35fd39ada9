"""`plan_step` (engine/runner/step_plan.py): a decode step's plan, built column by column
(`_plan_decode`), is the plan the general loop builds (`_plan_any`) field for field, with and
without pending input tokens and with every sampling option set somewhere; any other step
(a prefill chunk, a one-token chunk that does not reach the end) takes the general loop; a
pending token that is not in flight is refused by both."""

from __future__ import annotations

import random

import msgspec
import pytest
import torch

from engine.request import PENDING_TOKEN, Batch, Request, SamplingParams
from engine.runner.step_plan import (
    PendingTokens,
    _plan_any,
    _plan_decode,
    plan_step,
    slot_mapping,
)

BLOCK = 16


def _request(rng: random.Random, i: int, prompt: int, outputs: int, pending: bool) -> Request:
    params = rng.choice([
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, top_p=0.9, top_k=20, min_p=0.05, seed=i),
        SamplingParams(temperature=1.0, repetition_penalty=1.2, frequency_penalty=0.5, logit_bias={7: 1.5}),
        SamplingParams(temperature=1.0, min_new_tokens=outputs + 3, stop_token_ids=[3], logprobs=True, top_logprobs_num=2),
        SamplingParams(temperature=1.0, logprob_start_len=0),
    ])  # fmt: skip
    r = Request(request_id=str(i), prompt_token_ids=[rng.randrange(4, 500) for _ in range(prompt)],
                sampling_params=params, eos_token_ids=(2,))
    r.token_ids += [rng.randrange(4, 500) for _ in range(outputs)]
    if pending:
        r.token_ids.append(PENDING_TOKEN)
        r.num_pending = 1
    r.num_computed_tokens = len(r.token_ids) - 1
    first = rng.randrange(1000)
    r.block_table = list(range(first, first + -(-len(r.token_ids) // BLOCK)))
    return r


def _same(a: object, b: object) -> None:
    assert msgspec.to_builtins(a) == msgspec.to_builtins(b)


@pytest.mark.parametrize("seed", range(6))
def test_a_decode_plan_is_the_general_plan(seed: int) -> None:
    rng = random.Random(seed)
    reqs = [_request(rng, i, rng.randint(1, 70), rng.randint(0, 40), rng.random() < 0.7) for i in range(rng.randint(1, 40))]
    batch = Batch(requests=reqs, num_new_tokens=[1] * len(reqs))
    flight = [r for r in reqs if r.num_pending]
    pending = PendingTokens(torch.zeros(len(flight) + 2, dtype=torch.int64), {r: j + 2 for j, r in enumerate(flight)})
    fast = _plan_decode(batch, BLOCK, pending)
    assert fast is not None
    _same(fast, _plan_any(batch, BLOCK, pending))
    _same(plan_step(batch, BLOCK, pending), fast)


@pytest.mark.parametrize("seed", range(4))
def test_a_verify_plan_is_the_general_plan_as_decode_rows(seed: int) -> None:
    """A drafted step of decoding requests: one decode row per token (each its own sequence over
    its request's blocks, length position + 1), with the general plan's tokens, positions, KV
    slots, pending fills, sampling rows and sampling plan."""
    rng = random.Random(seed)
    reqs = [_request(rng, i, rng.randint(1, 70), rng.randint(0, 40), rng.random() < 0.5) for i in range(rng.randint(1, 8))]
    drafts = {i: [rng.randrange(4, 500) for _ in range(rng.randint(1, 4))] for i in range(len(reqs)) if rng.random() < 0.7}
    drafts = drafts or {0: [9, 9]}
    for r in reqs:  # room for the drafts' KV
        r.block_table += list(range(5000 + 10 * int(r.request_id), 5000 + 10 * int(r.request_id) + 2))
    batch = Batch(requests=reqs, num_new_tokens=[1 + len(drafts.get(i, [])) for i in range(len(reqs))], drafts=drafts)
    flight = [r for r in reqs if r.num_pending]
    pending = PendingTokens(torch.zeros(len(flight) + 1, dtype=torch.int64), {r: j + 1 for j, r in enumerate(flight)})
    general, rows = _plan_any(batch, BLOCK, pending), plan_step(batch, BLOCK, pending)
    assert rows.verify and rows.drafted and not general.verify
    tokens = len(general.parts[0])
    assert rows.num_seqs == tokens and rows.max_query_len == 1 and rows.query_start_loc_cpu == list(range(tokens + 1))
    assert rows.seq_lens_cpu == [p + 1 for p in general.parts[1]]
    for part in (0, 1, 2, 3, 4, 5):  # ids, positions, sample indices, pending rows and sources, KV slots
        assert rows.parts[part] == general.parts[part], part
    assert rows.sample_rows == general.sample_rows
    _same(rows.sampling, general.sampling)
    width = max(len(r.block_table) for r in reqs)
    tables = [rows.parts[-1][j * width : (j + 1) * width] for j in range(tokens)]
    assert tables == [reqs[i].block_table + [0] * (width - len(reqs[i].block_table)) for i in rows.sample_rows]
    chunk = _request(rng, 9, 40, 0, False)
    chunk.num_computed_tokens = 16
    chunk.block_table = list(range(3))
    mixed = Batch(requests=[*reqs, chunk], num_new_tokens=[*batch.num_new_tokens, 8], drafts=drafts)
    assert not plan_step(mixed, BLOCK, pending).verify  # a chunk among them: the general loop
    assert plan_step(batch, BLOCK, pending, max_seqs=tokens).verify
    assert not plan_step(batch, BLOCK, pending, max_seqs=tokens - 1).verify  # more rows than a step's sequences


def test_other_steps_take_the_general_loop() -> None:
    rng = random.Random(7)
    decodes = [_request(rng, i, 20, 5, False) for i in range(3)]
    chunk = _request(rng, 3, 40, 0, False)
    chunk.num_computed_tokens = 16  # a one-token chunk in the middle of the prompt: it does not sample
    batch = Batch(requests=[*decodes, chunk], num_new_tokens=[1] * 4)
    assert _plan_decode(batch, BLOCK, None) is None
    assert plan_step(batch, BLOCK).sample_rows == [0, 1, 2]
    prefill = Batch(requests=decodes[:2] + [_request(rng, 4, 30, 0, False)], num_new_tokens=[1, 1, 5])
    prefill.requests[2].num_computed_tokens = 25
    assert _plan_decode(prefill, BLOCK, None) is None


def test_a_pending_token_not_in_flight_is_refused() -> None:
    rng = random.Random(8)
    reqs = [_request(rng, i, 10, 3, True) for i in range(2)]
    batch = Batch(requests=reqs, num_new_tokens=[1, 1])
    partial = PendingTokens(torch.zeros(1, dtype=torch.int64), {reqs[0]: 0})
    for plan in (_plan_decode, _plan_any):
        with pytest.raises(RuntimeError, match="pending but not in flight"):
            plan(batch, BLOCK, partial)
        with pytest.raises(RuntimeError, match="pending but not in flight"):
            plan(batch, BLOCK, None)


@pytest.mark.parametrize("seed", range(4))
def test_slot_mapping_is_each_tokens_block_slot(seed: int) -> None:
    """`slot_mapping`, built a block's run at a time, gives each new token p of sequence i the
    slot tables[i][p // block] * block + p % block: chunks that start and end mid-block, span
    many blocks, are one token or empty."""
    rng = random.Random(seed)
    starts, ends, tables = [], [], []
    for _ in range(rng.randrange(1, 12)):
        start = rng.randrange(0, 200)
        end = start + rng.choice([0, 1, 1, rng.randrange(2, 40), rng.randrange(40, 300)])
        first = rng.randrange(10_000)
        tables.append(rng.sample(range(first, first + 1000), -(-end // BLOCK) or 1))
        starts.append(start)
        ends.append(end)
    want = [t[p // BLOCK] * BLOCK + p % BLOCK for s, e, t in zip(starts, ends, tables, strict=True) for p in range(s, e)]
    assert slot_mapping(starts, ends, tables, BLOCK) == want


def test_prompt_logprob_rows_and_their_top_k() -> None:
    """A prefill chunk scores each prompt position it computes from the logprob start on (never
    token 0), and asks for the most top alternatives any of those requests wants."""
    plain = Request("a", list(range(3, 23)), SamplingParams(logprob_start_len=0, top_logprobs_num=2))
    wide = Request("b", list(range(5, 15)), SamplingParams(logprob_start_len=4, top_logprobs_num=5))
    skipped = Request("c", list(range(7, 17)), SamplingParams(logprob_start_len=9, top_logprobs_num=9))
    for k, r in enumerate((plain, wide, skipped)):
        r.block_table = [2 * k, 2 * k + 1]
    batch = Batch(requests=[plain, wide, skipped], num_new_tokens=[8, 10, 6])  # c's chunk ends before position 9
    plan = _plan_any(batch, BLOCK, None)
    # A chunk's last row scores the prompt token after it: a's rows 0..7 score positions 1..8.
    assert [(i, q) for i, q, _ in plan.prompt_logprob_rows] == [(0, q) for q in range(1, 9)] + [(1, q) for q in range(4, 10)]
    assert [r for _, _, r in plan.prompt_logprob_rows] == list(range(0, 8)) + list(range(8 + 3, 8 + 9))
    assert plan.prompt_logprob_top_k == 5
    assert plan.prompt_logprob_targets == plain.token_ids[1:9] + wide.token_ids[4:10]


def test_prompt_logprobs_in_slices_equal_one_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """Scoring in slices of rows (bounded logits memory) gives what one pass gives."""
    from engine.runner import prompt_logprobs
    from engine.runner.prompt_logprobs import PromptLogprobs

    gen = torch.Generator().manual_seed(0)
    hidden, head = torch.randn(40, 16, generator=gen), torch.randn(16, 100, generator=gen)
    rows = torch.randint(0, 40, (33,), generator=gen).tolist()
    targets = torch.randint(0, 100, (33,), generator=gen).tolist()
    log_probs = torch.log_softmax(hidden[rows] @ head, dim=-1)
    whole = PromptLogprobs.score(hidden, rows, targets, 4, lambda h: h @ head)
    monkeypatch.setattr(prompt_logprobs, "ROWS_PER_SLICE", 5)
    sliced = PromptLogprobs.score(hidden, rows, targets, 4, lambda h: h @ head)
    assert sliced.logprobs == pytest.approx(whole.logprobs, abs=1e-5)
    assert whole.logprobs == pytest.approx(log_probs[range(33), targets].tolist(), abs=1e-5)
    assert sliced.tops is not None and whole.tops is not None
    assert [[t for t, _ in row] for row in sliced.tops] == [[t for t, _ in row] for row in whole.tops]
    assert [[t for t, _ in row] for row in whole.tops] == log_probs.topk(4, dim=-1).indices.tolist()
    assert PromptLogprobs.score(hidden, rows, targets, 0, lambda h: h @ head).tops is None
