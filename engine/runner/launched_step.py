"""`LaunchedStep`: a step whose work is queued on the device, and `SampleResult`, what one of its
sampling rows produced once read back (overlap scheduling: engine/core/engine_core.py reads step k after it
launched step k+1).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from engine.request import Batch, Request
from engine.runner.route_log import StagedRoutes
from engine.runner.sampler import SampledOnDevice
from engine.runner.step_plan import PendingTokens

log = logging.getLogger("siesta.engine")


@dataclass
class SampleResult:
    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]] | None


@dataclass
class LaunchedStep:
    """A step whose work is queued on the device: `batch` as scheduled; `requests` the rows that
    sample, in batch order; `samples` their tokens (None when no row samples); `routes` the
    routed experts of its tokens on their way to the host (None unless they are recorded)."""

    batch: Batch
    requests: list[Request]
    samples: SampledOnDevice | None
    routes: StagedRoutes | None = None

    @property
    def needs_host_tokens(self) -> bool:
        """Whether scheduling the next step needs this one's tokens on the host: penalties count
        every output token of a request, and a grammar's mask follows them, so its pending one
        must be known; a row with drafts ends with as many tokens as the step accepted."""
        return bool(self.batch.drafts) or any(r.grammar is not None or r.sampling_params.penalized for r in self.requests)

    def pending_tokens(self) -> PendingTokens | None:
        """Where the next step finds the tokens of this one on the device."""
        if self.samples is None:
            return None
        return PendingTokens(self.samples.token_ids, {r: j for j, r in enumerate(self.requests)})

    def results(self) -> list[SampleResult]:
        """Wait for the step; one result per sampling row, aligned with `requests`."""
        if self.samples is None:
            return []
        out = self.samples.wait()
        for r, token in zip(self.requests, out.token_ids, strict=True):
            if r.grammar is not None and not r.finished and not r.grammar.accept(token):
                log.error("request %s: token %d sampled against its grammar's mask; unconstrained from here", r.request_id, token)
                r.grammar = None
        tops = out.top_logprobs or [None] * len(out.token_ids)
        return [SampleResult(t, lp, top) for t, lp, top in zip(out.token_ids, out.logprobs, tops, strict=True)]
