"""Continuous batching: which requests run in the next step, and how many tokens each.

One unified step, as in vLLM v1: there are no prefill and decode phases, only a token budget of
`max_num_batched_tokens`. A request runs the tokens it has not computed yet,
`num_tokens - num_computed_tokens`, capped by what is left of the budget: a whole prompt, a chunk
of a long one (chunked prefill), one token when decoding, or everything again after preemption.

Order of a step:
  1. Running requests, oldest admission first. When one cannot get KV blocks, the most recently
     admitted running request is preempted (blocks freed, to recompute later) until it can.
  2. Waiting requests, first in first out, while budget, `max_num_seqs` and blocks allow. The
     first that does not fit stops admission: nothing overtakes it. No admission in a step that
     preempted. One exception: a request whose prompt another request is prefilling (the
     samples of an n > 1 request) is passed over for this step and keeps its place in the queue:
     once the prefill is done, the prefix cache hands it the prompt's full blocks. The requests
     behind it are admitted meanwhile (one prompt's samples must not hold back every prompt).
Every request added fits the whole cache alone (`engine.limits.prompt_error`, checked before
`add`). So the oldest running request can always preempt all the others: it always progresses,
and every request finishes eventually.

A step is accounted for twice (overlap scheduling): `advance` when it is launched (its chunks
count as computed; each row that samples gets a pending token, whose id the device has and the
host not yet) and `resolve` when its tokens are read back, after the next step was scheduled and
launched. A decode row's input may be the pending token: the model runner takes it from the
device. Between the two, a request whose last allowed token is pending is not scheduled, and one
preempted with a pending token is not readmitted until it resolves.
"""

from __future__ import annotations

from collections import deque

from engine.memory.kv_cache import BlockManager
from engine.request import FINISH_ABORT, Batch, Request, RequestStatus


class Scheduler:
    """Owns the waiting queue and the running list; asks `block_manager` for KV blocks."""

    def __init__(
        self,
        block_manager: BlockManager,
        max_num_batched_tokens: int,
        max_num_seqs: int,
    ) -> None:
        if min(max_num_batched_tokens, max_num_seqs) < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")
        self.block_manager = block_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Request] = deque()  # FIFO; preempted requests go back to the front
        self.running: list[Request] = []  # in admission order
        self._requests: dict[str, Request] = {}  # every unfinished request, by id
        self.num_preemptions = 0  # since start, for /get_server_info and tests

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def get(self, request_id: str) -> Request | None:
        """The unfinished request of that id, if any."""
        return self._requests.get(request_id)

    def has(self, request_id: str) -> bool:
        """Whether an unfinished request has this id."""
        return request_id in self._requests

    def request_ids(self) -> list[str]:
        """Ids of every unfinished request: running, then waiting."""
        return [r.request_id for r in (*self.running, *self.waiting)]

    def add(self, req: Request) -> None:
        if req.request_id in self._requests:
            raise ValueError(f"request id {req.request_id!r} is already in the engine")
        if req.status is not RequestStatus.WAITING or req.block_table:
            raise ValueError(f"request {req.request_id!r} is not a new request")
        self._requests[req.request_id] = req
        self.waiting.append(req)

    def abort(self, request_id: str, message: str | None = None) -> Request | None:
        """Finish one request with FINISH_ABORT (`message`: what aborted it) and free its blocks;
        None if it is not here."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return None
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self.block_manager.free(req)
        req.finish(FINISH_ABORT, error=message)
        return req

    def finish_all(self, reason: str = FINISH_ABORT, error: str | None = None) -> list[Request]:
        """Finish every request (running first, then waiting) and free their blocks."""
        reqs = [*self.running, *self.waiting]
        self.running.clear()
        self.waiting.clear()
        self._requests.clear()
        for req in reqs:
            self.block_manager.free(req)
            req.finish(reason, error=error)
        return reqs

    def retract_all(self) -> int:
        """Requeue every running request without its KV (it recomputes, from the prefix cache where
        that survives). Order is kept: they go back to the front of the queue. Returns how many."""
        retracted = list(self.running)
        self.running.clear()
        for req in reversed(retracted):
            self._preempt(req)
        return len(retracted)

    def drop_kv(self, keep_running: bool = False) -> int:
        """No KV written before now is read again: the `kv_cache` region was released, or the
        weights changed under it. Every prefix hash goes, blocks in use too, and every request
        holding blocks is set back to recompute from its tokens (prompt plus output so far: its
        seed position, penalty counts and stop state follow from those, so a greedy request ends
        as it would have). `keep_running`: running requests keep their KV on purpose (a weight
        update under an in_place pause, as SGLang) and register no more blocks. Returns how
        many requests were set back."""
        n = 0 if keep_running else self.retract_all()
        self.block_manager.forget_prefixes()
        return n

    # ---- one step -----------------------------------------------------------------------------

    def schedule(self, admit: bool = True) -> Batch:
        """The next step's batch. Waiting requests join it only when `admit` (the engine's
        `Availability.admitting`: no weight update waiting for the running ones)."""
        bm = self.block_manager
        budget = self.max_num_batched_tokens
        batch = Batch(requests=[], num_new_tokens=[])
        preempted = False

        i = 0  # running[:i] are scheduled; running[i:] may still be preempted
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            drafts, req.draft_token_ids = req.draft_token_ids, []
            if n < 1 or req.awaiting_last_token:
                i += 1
                continue
            # Its drafts ride along when budget and blocks allow them without preempting anyone.
            if drafts and n == 1 and len(drafts) < budget and bm.allocate(req, req.num_computed_tokens + 1 + len(drafts)):
                batch.drafts[len(batch.requests)] = drafts
                batch.requests.append(req)
                batch.num_new_tokens.append(1 + len(drafts))
                budget -= 1 + len(drafts)
                i += 1
                continue
            while not bm.allocate(req, req.num_computed_tokens + n):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            else:
                batch.requests.append(req)
                batch.num_new_tokens.append(n)
                budget -= n
                i += 1
                continue
            break  # `req` preempted itself: everything after it is gone too

        # Only admission reads it: a decode step with nobody waiting skips the pass over running.
        prefilling = self._prompts_in_prefill() if self.waiting and admit else None
        passed_over: list[Request] = []  # samples waiting for their prompt's prefill, in order
        while self.waiting and admit:
            req = self.waiting[0]
            if preempted or budget < 1 or len(self.running) >= self.max_num_seqs or req.num_pending:
                break  # (a request preempted with a token in flight waits until it is known)
            computed = bm.match_prefix(req)
            shares_more = computed < _shareable(req, bm)
            if shares_more and _in_prefill(req, prefilling):
                passed_over.append(self.waiting.popleft())
                continue
            n = min(req.num_tokens - computed, budget)
            if not bm.allocate(req, computed + n):
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            batch.requests.append(req)
            batch.num_new_tokens.append(n)
            budget -= n
            if prefilling is not None and shares_more:  # its prefill makes blocks others can share
                prefilling.setdefault(req.prompt_key, []).append(req)
        self.waiting.extendleft(reversed(passed_over))
        return batch

    def _prompts_in_prefill(self) -> dict[int, list[Request]] | None:
        """Running requests whose prompt is not computed yet, by prompt key; None when the prefix
        cache is off (nothing would be shared by waiting)."""
        if not self.block_manager.enable_prefix_caching:
            return None
        prefilling: dict[int, list[Request]] = {}
        for r in self.running:
            if r.num_computed_tokens < _shareable(r, self.block_manager):
                prefilling.setdefault(r.prompt_key, []).append(r)
        return prefilling

    def _preempt(self, req: Request) -> None:
        """Drop `req`'s KV; it recomputes (from the prefix cache, where it survives) when readmitted."""
        self.block_manager.free(req)
        req.num_computed_tokens = 0
        req.draft_token_ids = []
        req.num_preemptions += 1
        self.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)

    def advance(self, batch: Batch) -> list[Request]:
        """Account for a launched step, before its tokens are known: every row's chunk counts as
        computed (its full blocks of known tokens join the prefix cache), and each row that samples
        (`batch.samples(i)`) gets a pending token. A row's drafts do not count: `resolve` counts
        those the step accepted. Returns the sampling requests, in batch order: `resolve` takes
        their tokens in that order."""
        sampling = [req for i, req in enumerate(batch.requests) if batch.samples(i)]
        for i, (req, n) in enumerate(zip(batch.requests, batch.num_new_tokens, strict=True)):
            req.num_computed_tokens += n - len(batch.drafts.get(i, ()))
            # Registered now, not when the tokens come back: a request scheduled next (a sample
            # of the same prompt) shares them; its step runs after this one on the device.
            self.block_manager.cache_full_blocks(req)
        for req in sampling:
            req.add_pending_token()
        return sampling

    def resolve(self, batch: Batch, tokens: list[tuple[Request, int]]) -> list[Request]:
        """The tokens of an advanced step are known: (request, token) for each sampling request
        still unfinished (one aborted, or finished by an earlier token, has none). A request
        named again right after itself had drafts: each repeat is one more token the step
        verified (the draft before it was accepted, so its KV counts as computed). Registers the
        full blocks, frees the requests that finished. A request preempted since the launch may
        be waiting; it resolves there. Returns the requests that finished."""
        finished: list[Request] = []
        finished_waiting: list[Request] = []  # preempted after the launch, finished now
        last: Request | None = None
        for req, token in tokens:
            waiting = req.status is RequestStatus.WAITING
            if req is last:  # an accepted draft: its KV stays, and the next token follows it
                if req.finished:
                    continue
                if not waiting:  # (preempted since the launch: it recomputes every token anyway)
                    req.num_computed_tokens += 1
                req.add_pending_token()
            last = req
            req.resolve_token(token)
            if req.finished:
                (finished_waiting if waiting else finished).append(req)
        for req in batch.requests:
            self.block_manager.cache_full_blocks(req)
        if finished:
            self.running[:] = [r for r in self.running if not r.finished]
        for req in finished_waiting:
            self.waiting.remove(req)
        finished += finished_waiting
        for req in finished:
            self.block_manager.free(req)
            del self._requests[req.request_id]
        return finished


def _shareable(req: Request, bm: BlockManager) -> int:
    """The prompt tokens of `req` the prefix cache can ever hold for others: its whole prompt
    blocks, within what the cache may serve for `req` itself."""
    return min(bm.max_cached_tokens(req), req.num_prompt_tokens // bm.block_size * bm.block_size)


def _in_prefill(req: Request, prefilling: dict[int, list[Request]] | None) -> bool:
    """Another request is prefilling `req`'s prompt."""
    others = prefilling.get(req.prompt_key) if prefilling else None
    return bool(others) and any(r.prompt_token_ids == req.prompt_token_ids for r in others)
