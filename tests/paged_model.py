"""A pure-Python model over a paged "KV cache" and the driver that runs the scheduler with it
(tests/test_scheduler.py).

`FakeModel` keeps one value per KV slot: a rolling hash of the sequence's tokens up to that
position, so a slot's value depends on its whole prefix, like real KV. It reads every computed
slot of a request back from the blocks of its `block_table` and checks it, writes only private
blocks, and samples a token from the state it read. Any bookkeeping error (a wrong shared block,
a lost or overwritten slot) either fails an assertion or changes the outputs; `reference` is what
one sequence generates alone, without any cache.
"""

from __future__ import annotations

from engine.core.scheduler import Scheduler
from engine.limits import RequestLimits, prompt_error
from engine.memory.kv_cache import BlockManager
from engine.request import FINISH_ERROR, PENDING_TOKEN, Batch, Request, SamplingParams

VOCAB = 50
MOD = (1 << 61) - 1


def mix(state: int, token: int) -> int:
    return (state * 1_000_003 + token + 1) % MOD


def next_token(state: int) -> int:
    return state % VOCAB


class FakeModel:
    def __init__(self, bm: BlockManager) -> None:
        self.bm = bm
        self.kv: list[list[int | None]] = [[None] * bm.block_size for _ in range(bm.num_blocks)]

    def step(self, batch: Batch, in_flight: dict[str, int] | None = None) -> dict[str, int]:
        """Run `batch`; a pending input token (overlap) is read from `in_flight`, the tokens of
        the step launched before, as the device would."""
        bs = self.bm.block_size
        sampled: dict[str, int] = {}
        for i, r in enumerate(batch.requests):
            start, n = r.num_computed_tokens, batch.num_new_tokens[i]
            assert n >= 1 and start + n <= r.num_tokens
            assert start + n <= len(r.block_table) * bs
            state = 0
            for pos in range(start):  # attention reads the whole cached prefix
                state = mix(state, r.token_ids[pos])
                assert self.kv[r.block_table[pos // bs]][pos % bs] == state, (r.request_id, pos)
            for pos in range(start, start + n):
                block = r.block_table[pos // bs]
                assert self.bm.ref_count(block) == 1 and not self.bm.is_cached(block)
                token = r.token_ids[pos]
                if token == PENDING_TOKEN:
                    assert in_flight is not None and pos == r.num_tokens - 1, (r.request_id, pos)
                    token = in_flight[r.request_id]
                state = mix(state, token)
                self.kv[block][pos % bs] = state
            if batch.samples(i):
                sampled[r.request_id] = next_token(state)
        return sampled


def apply(sched: Scheduler, batch: Batch, model: FakeModel) -> list[Request]:
    """One step without overlap: run, advance, resolve; returns the requests that finished."""
    sampled = model.step(batch)
    sampling = sched.advance(batch)
    return sched.resolve(batch, [(r, sampled[r.request_id]) for r in sampling if not r.finished])


def reference(prompt: list[int], max_new_tokens: int) -> list[int]:
    """What one sequence generates alone, without any cache."""
    tokens = list(prompt)
    for _ in range(max_new_tokens):
        state = 0
        for t in tokens:
            state = mix(state, t)
        tokens.append(next_token(state))
    return tokens[len(prompt) :]


def make(rid: str, prompt: list[int], max_new: int = 6, eos: tuple[int, ...] = ()) -> Request:
    return Request(rid, prompt, SamplingParams(max_new_tokens=max_new), eos_token_ids=eos)


def run(
    sched: Scheduler, reqs: list[Request], model: FakeModel | None = None, max_steps: int = 10_000
) -> tuple[list[Batch], list[Request]]:
    """Drive the scheduler to completion; check per-step invariants. Returns batches and the
    requests refused before they were added. Pass the `model` of earlier steps on the same
    scheduler: it holds the KV they wrote."""
    model = model or FakeModel(sched.block_manager)
    failed = [r for r in reqs if not admit(sched, r)]
    batches: list[Batch] = []
    while sched.has_unfinished():
        assert len(batches) < max_steps, "no progress"
        batch = sched.schedule()
        ids = [r.request_id for r in batch.requests]
        assert len(ids) == len(set(ids))
        assert batch.num_tokens <= sched.max_num_batched_tokens
        assert sched.num_running <= sched.max_num_seqs
        assert batch.requests or not sched.has_unfinished(), "empty step with work left"
        apply(sched, batch, model)
        batches.append(batch)
    return batches, failed


def admit(sched: Scheduler, req: Request, max_model_len: int = 1024) -> bool:
    """Add `req` as the engine core does: refused (FINISH_ERROR) when it could never run."""
    bm = sched.block_manager
    limits = RequestLimits(VOCAB, max_model_len, bm.num_blocks, bm.block_size)
    error = prompt_error(req.prompt_token_ids, req.sampling_params, limits)
    if error is not None:
        req.finish(FINISH_ERROR, error=error)
        return False
    sched.add(req)
    return True


def prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    return [[(seed + 7 * i + 3 * j * j) % VOCAB for j in range(length + i)] for i in range(n)]


def new_sched(
    num_blocks: int = 64,
    block_size: int = 4,
    budget: int = 64,
    max_seqs: int = 8,
    prefix: bool = True,
) -> Scheduler:
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix)
    return Scheduler(bm, budget, max_seqs)
