"""`NgramDrafter`: model-free drafts for speculative decoding (`--speculative-algorithm ngram`);
`ModelDrafter`: the same rules with a draft model's tokens (`--speculative-algorithm draft`).

A running request's next tokens are guessed from text that already exists: the continuation of
the latest earlier occurrence of its last n tokens (n from the longest window down), first in
its own prompt and output, then in earlier rollouts of the same prompt (RL samples each prompt
many times: a second rollout tends to repeat the first). The next step runs the request's last
token and its drafts in one forward and samples at each of those positions with the request's
own sampler and noise (engine/runner/sampling_plan.py `step_seed`: noise keyed by output index);
a draft is accepted while it equals the token sampled before it, and the first token that
differs ends the step's tokens. For a one-point draft that is rejection sampling: a draft d is
kept with probability p(d), and otherwise the token comes from p without d, renormalised. So
the tokens are exactly what plain decoding would give: the same for greedy and seeded requests,
and the model's distribution for the rest.

Rules:
- Drafts are made only while at most `max_running` requests run (few rows: the step is
  memory-bound, so verifying k tokens costs about what one does), for requests whose sampling
  depends on nothing the step changes between its positions: no penalties, grammar, routed
  experts, or min_new_tokens still to reach.
- A request whose drafts were rejected, or that found none, MISSES times in a row drafts nothing
  for a while, twice as long each time (up to MAX_BACKOFF steps): on text that never repeats,
  most steps neither search nor give up overlap scheduling (a step that may draft reads the step
  before it first).
- A draft never takes a request past max_new_tokens: at most max_new_tokens - outputs - 1 tokens.
- Rollouts: the last ROLLOUTS finished requests of each of the last PROMPTS prompts.
Tokens are kept as 4-byte words (array "I") in a bytearray per sequence; a search is
`bytearray.rfind` of the window's bytes, accepted at word boundaries only.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from engine.request import FINISH_LENGTH, FINISH_STOP, Batch, Request

MISSES = 3  # rejected proposals in a row before a request backs off
FIRST_BACKOFF = 8  # steps without drafts after the first run of misses; doubles each time
MAX_BACKOFF = 256
ROLLOUTS = 4
PROMPTS = 256
_WORD = 4  # bytes of a token id: array typecode "I"
assert array("I").itemsize == _WORD


def _encode(tokens: list[int]) -> bytes:
    return array("I", tokens).tobytes()


def _decode(data: bytes | bytearray) -> list[int]:
    return array("I", bytes(data)).tolist()


@dataclass
class _Sequence:
    """One request's tokens as words, appended as they become known, and its backoff state."""

    words: bytearray = field(default_factory=bytearray)
    count: int = 0  # tokens encoded
    misses: int = 0
    backoff: int = 0  # steps still to skip
    next_backoff: int = FIRST_BACKOFF


def _continuation(words: bytes | bytearray, window: bytes, k: int, end: int, near: int | None = None) -> list[int]:
    """Up to k tokens after an occurrence of `window` that ends at or before byte `end`: the
    first at or after byte `near` when given (a rollout, searched around the request's own
    position), else the latest. The latest occurrence in a live sequence (`near` None) drafts k
    tokens even where it runs into the sequence's end: text that repeats with period p continues
    to repeat, so draft m is the token p before it (the drafts before it included)."""
    if near is not None:
        at = max(0, near)
        while (i := words.find(window, at, end)) >= 0 and i % _WORD:
            at = i + 1
        if i >= 0:
            start = i + len(window)
            return _decode(words[start : start + k * _WORD])
    stop = end
    while (i := words.rfind(window, 0, stop)) >= 0:
        if i % _WORD == 0:
            start = i + len(window)
            out = _decode(words[start : start + k * _WORD])
            period = (len(words) - start) // _WORD
            while len(out) < k:
                out.append(out[len(out) - period])
            return out
        stop = i + len(window) - 1
    return []


class NgramDrafter:
    def __init__(self, num_draft_tokens: int, min_window: int, max_window: int, max_running: int) -> None:
        if not 1 <= min_window <= max_window or num_draft_tokens < 1 or max_running < 1:
            raise ValueError("ngram drafts need 1 <= min window <= max window, >= 1 draft token and max_running >= 1")
        self.k, self.min_window, self.max_window, self.max_running = num_draft_tokens, min_window, max_window, max_running
        self._seqs: dict[str, _Sequence] = {}
        self._rollouts: OrderedDict[int, list[bytes]] = OrderedDict()  # prompt key -> finished sequences, newest last
        self.proposed = 0  # draft tokens proposed, and accepted, since start
        self.accepted = 0

    def candidates(self, running: list[Request]) -> list[Request]:
        """The running requests that may get drafts this step (once per step: a request backing
        off counts the step): none while more than max_running run. The engine reads the step in
        flight before `propose` when any is returned (drafts follow the last token)."""
        if not 0 < len(running) <= self.max_running:
            return []
        out = []
        for req in running:
            if not _can_draft(req):
                continue
            seq = self._seqs.setdefault(req.request_id, _Sequence())
            if seq.backoff > 0:
                seq.backoff -= 1
            else:
                out.append(req)
        if len(self._seqs) > 4 * self.max_running:  # requests aborted or preempted away
            live = {r.request_id for r in running}
            self._seqs = {rid: s for rid, s in self._seqs.items() if rid in live}
        return out

    def propose(self, requests: list[Request]) -> int:
        """Set `draft_token_ids` of each of `requests` (`candidates`) that runs its last token next
        and finds a draft; returns how many got one. Their tokens must all be known."""
        n = 0
        for req in requests:
            ready = _ready(req)
            req.draft_token_ids = self._draft(req) if ready else []
            if ready and not req.draft_token_ids:
                self._missed(self._seqs[req.request_id])  # nothing to propose counts as a miss
            n += bool(req.draft_token_ids)
        return n

    def accepted_rows(self, batch: Batch, rows: list[tuple[Request, Any]]) -> list[tuple[Request, Any]]:
        """The (request, sample) rows of a step with drafts that stand: a drafted request's rows
        (consecutive: at its last known token, then at each draft) up to and including the first
        whose token differs from the draft it follows; the counts go to `verified`."""
        drafted = {id(batch.requests[i]): d for i, d in batch.drafts.items()}
        out: list[tuple[Request, Any]] = []
        j = 0
        while j < len(rows):
            req = rows[j][0]
            draft = drafted.get(id(req))
            if draft is None:
                out.append(rows[j])
                j += 1
                continue
            group = rows[j : j + 1 + len(draft)]
            a = 0
            while a < len(draft) and group[a][1].token_id == draft[a]:
                a += 1
            out += group[: a + 1]
            self.verified(req, len(draft), a)
            j += 1 + len(draft)
        return out

    def verified(self, req: Request, proposed: int, accepted: int) -> None:
        """A step verified `proposed` drafts of `req` and accepted the first `accepted`."""
        self.proposed += proposed
        self.accepted += accepted
        seq = self._seqs.get(req.request_id)
        if seq is None:
            return
        if accepted:
            seq.misses, seq.next_backoff = 0, FIRST_BACKOFF
        else:
            self._missed(seq)

    @staticmethod
    def _missed(seq: _Sequence) -> None:
        seq.misses += 1
        if seq.misses >= MISSES:
            seq.misses, seq.backoff = 0, seq.next_backoff
            seq.next_backoff = min(2 * seq.next_backoff, MAX_BACKOFF)

    def finished(self, req: Request) -> None:
        """`req` is done: its tokens join its prompt's rollouts (unless it ended in an error or abort)."""
        seq = self._seqs.pop(req.request_id, None)
        if req.finish_reason not in (FINISH_STOP, FINISH_LENGTH) or req.num_output_tokens == 0:
            return
        words = bytes(self._sync(seq or _Sequence(), req).words)
        runs = self._rollouts.setdefault(req.prompt_key, [])
        self._rollouts.move_to_end(req.prompt_key)
        runs.append(words)
        del runs[:-ROLLOUTS]
        while len(self._rollouts) > PROMPTS:
            self._rollouts.popitem(last=False)

    def _sync(self, seq: _Sequence, req: Request) -> _Sequence:
        tokens = req.token_ids
        if seq.count < len(tokens):
            seq.words += _encode(tokens[seq.count :])
            seq.count = len(tokens)
        return seq

    def _draft(self, req: Request) -> list[int]:
        seq = self._seqs.setdefault(req.request_id, _Sequence())
        k = min(self.k, _room(req))
        if k < 1:
            return []
        words = self._sync(seq, req).words
        runs = self._rollouts.get(req.prompt_key, [])
        here = len(words)
        for n in range(min(self.max_window, seq.count - 1), self.min_window - 1, -1):
            window = bytes(words[here - n * _WORD :])
            found = _continuation(words, window, k, here - _WORD)
            for run in reversed(runs):
                if found:
                    break
                found = _continuation(run, window, k, len(run), near=here - (n + 64) * _WORD)
            if found:
                return found
        return []


def _ready(req: Request) -> bool:
    """It runs its last token next and every token of it is known."""
    return not req.finished and req.num_pending == 0 and req.num_computed_tokens == req.num_tokens - 1


def _room(req: Request) -> int:
    """Drafts that keep it within max_new_tokens (the step samples one more token after them)."""
    return req.sampling_params.max_new_tokens - req.num_output_tokens - 1


def _can_draft(req: Request) -> bool:
    """Its sampling at each drafted position depends on nothing the step changes in between."""
    sp = req.sampling_params
    return (req.grammar is None and not sp.penalized and not sp.return_routed_experts
            and req.num_output_tokens >= sp.min_new_tokens)  # fmt: skip


class ModelDrafter(NgramDrafter):
    """Drafts from the draft model (engine/runner/draft_model.py, run by the model runner's
    `propose_drafts`) in place of n-grams: the same candidates, verification and backoff. A
    request's blocks are extended to hold its drafts' KV before they are made; one that cannot
    be extended drafts nothing this step. Drafts stop at the draft's own context length (its
    positions: its rotary table)."""

    def __init__(self, num_draft_tokens: int, max_running: int, runner: Any, blocks: Any) -> None:
        super().__init__(num_draft_tokens, 1, 1, max_running)
        self.runner, self.blocks = runner, blocks

    def propose(self, requests: list[Request]) -> int:
        ready, ks = [], []
        for req in requests:
            req.draft_token_ids = []
            k = min(self.k, _room(req), self.runner.draft.config.max_position_embeddings - req.num_tokens + 1)  # last position n + k - 1
            if _ready(req) and k >= 1 and self.blocks.allocate(req, req.num_tokens + k - 1):
                ready.append(req)
                ks.append(k)
        made = 0
        for req, drafts in zip(ready, self.runner.propose_drafts(ready, ks) if ready else [], strict=True):
            req.draft_token_ids = drafts
            made += bool(drafts)
        return made

    def finished(self, req: Request) -> None:
        self._seqs.pop(req.request_id, None)
        if self.runner.draft is not None:
            self.runner.draft.forget(req.request_id)
