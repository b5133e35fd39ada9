"""`EngineCore`: the engine process. It builds its parts in the order docs/ARCHITECTURE.md gives, then loops:
take new requests and control calls, schedule and launch step k+1, read step k's tokens (overlap
scheduling: the host works while the device runs), send token deltas back. Control calls run
between steps, in the order they arrive, with no step in flight (read-only ones excepted).
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections.abc import Callable
from itertools import groupby
from typing import Any, TypeVar

from engine.config import EngineConfig, ModelConfig, context_length
from engine.core import calls
from engine.core.availability import Availability
from engine.core.checks import WeightCheckCalls
from engine.core.drafts import ModelDrafter, NgramDrafter
from engine.core.load import LoadCalls, LoadStats
from engine.core.memory_calls import MemoryCalls
from engine.core.profiler import ProfileCalls, StepProfiler
from engine.core.protocol import AddRequest, RequestDelta
from engine.core.rank import Rank
from engine.core.ranks import Ranks
from engine.core.scheduler import Scheduler
from engine.core.serving_calls import ServingCalls
from engine.core.weight_calls import WeightUpdateCalls
from engine.limits import RequestLimits, prompt_error
from engine.memory.kv_cache import BlockManager
from engine.parallel import TensorParallel
from engine.request import FINISH_ABORT, FINISH_ERROR, Request
from engine.runner.grammar import Grammars
from engine.runner.launched_step import LaunchedStep

log = logging.getLogger("siesta.engine")

class EngineCore(ServingCalls, MemoryCalls, WeightUpdateCalls, WeightCheckCalls, ProfileCalls, LoadCalls):
    def __init__(self, config: EngineConfig, log_level: str = "INFO", client_addrs: list[str] | None = None) -> None:
        """`client_addrs`: where a dead tensor-parallel worker is reported (engine/core/ranks.py)."""
        t0 = time.perf_counter()
        self.config = config
        self._seeds = random.Random(config.seed) if config.deterministic else None  # seeds of unseeded requests
        self.model_config = ModelConfig.from_hf(config.model)
        self.max_model_len = context_length(config, self.model_config)
        # Tensor parallelism: the other ranks' workers start, every rank joins the group, then
        # each builds its own Rank in step (their startup forwards run collectives).
        tp = TensorParallel(0, config.tp_size)
        self.ranks = Ranks.start(config, log_level, client_addrs)
        try:
            self.rank = Rank(config, self.model_config, self.max_model_len, tp, self.ranks.init_method, self.ranks.store)
            self.ranks.attach(self.rank)
        except BaseException:
            self.ranks.close()
            raise
        self.runner = self.rank.runner
        self.block_manager = BlockManager(
            self.runner.num_kv_blocks, config.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(self.block_manager, config.max_num_batched_tokens, config.max_num_seqs)
        self.limits = RequestLimits(
            self.model_config.vocab_size, self.max_model_len, self.block_manager.num_blocks, config.block_size,
            tuple(self.model_config.eos_token_ids),
        )
        self.num_steps = 0
        self.memory = self.runner.memory
        self.availability = Availability(self.memory, self.runner.weights)
        # Deltas produced outside a step (aborts from control calls), sent by the loop.
        self.pending: list[RequestDelta] = []
        # The step launched last and not read yet (overlap scheduling); None between steps
        # when overlap is off, and always before a control call runs.
        self.in_flight: LaunchedStep | None = None
        self.updater = self.rank.updater
        self.profiler = StepProfiler(self.runner.device)
        self.grammars = Grammars(config.tokenizer or config.model, self.model_config.vocab_size)
        self.load_stats = LoadStats()
        self.drafter: NgramDrafter | None = None
        if config.speculative_algorithm == "ngram":
            self.drafter = NgramDrafter(
                config.speculative_num_draft_tokens, config.speculative_ngram_min_match_window_size,
                config.speculative_ngram_max_match_window_size, config.speculative_disable_by_batch_size,
            )  # fmt: skip
        elif config.speculative_algorithm == "draft":
            self.drafter = ModelDrafter(config.speculative_num_draft_tokens, config.speculative_disable_by_batch_size,
                                        self.runner, self.block_manager)  # fmt: skip
        log.info("engine core ready in %.2f s", time.perf_counter() - t0)

    # ---- requests -------------------------------------------------------------------------------

    def add_request(self, msg: AddRequest) -> RequestDelta | None:
        """Queue a request, or refuse it at once with an error delta naming the problem. With
        `--deterministic` a request without a seed gets one here: each row then samples from its
        own generator (seeded by seed and position), never from one shared with its batch."""
        params = msg.sampling_params
        if self._seeds is not None and params.seed is None:
            params = dataclasses.replace(params, seed=self._seeds.getrandbits(31))
        req = Request(
            request_id=msg.request_id,
            prompt_token_ids=list(msg.prompt_token_ids),
            sampling_params=params,
            eos_token_ids=self.model_config.eos_token_ids,
        )
        unavailable = self.availability.unavailable()
        if unavailable is not None:
            req.finish(FINISH_ERROR, error=unavailable)
            return _final_delta(req, unavailable=True)
        error = prompt_error(req.prompt_token_ids, req.sampling_params, self.limits)
        if error is None and self.scheduler.has(req.request_id):  # another API server's request
            error = f"request id {req.request_id!r} is already running"
        if error is None:
            error = self.grammars.attach(req)
        if error is None and req.sampling_params.return_routed_experts and self.runner.route_log is None:
            error = "return_routed_experts needs the engine started with --enable-return-routed-experts (and a MoE model)"
        if error is not None:
            req.finish(FINISH_ERROR, error=error)
            return _final_delta(req)
        self.scheduler.add(req)
        return None

    def abort(self, request_ids: list[str] | None, message: str = "aborted by the client") -> list[RequestDelta]:
        """Finish the named requests (None: all) with finish_reason abort and `message` (what
        aborted them, SGLang's finish_reason.message): one final delta each, with the routed
        experts of its known positions when asked (read before its blocks go)."""
        ids = request_ids if request_ids is not None else self.scheduler.request_ids()
        deltas = []
        for rid in ids:
            req = self.scheduler.get(rid)
            if req is None:
                continue
            routes = self._routes([req], [req.num_known_tokens - 1]) if req.sampling_params.return_routed_experts else {}
            self.scheduler.abort(rid, message)
            deltas.append(_final_delta(req, routed_experts=routes.get(req)))
        return deltas

    def step(self) -> list[RequestDelta]:
        """Schedule and launch one step, then read the step launched before it: the host packs
        step k+1 while the device runs step k, and step k's tokens come back while k+1 runs.
        Returns the deltas of the step read. With overlap off, or
        when a step needs the previous tokens on the host (penalties count them), or requests may
        get drafts (speculative decoding: drafts follow the last token), the previous step is
        read first."""
        deltas: list[RequestDelta] = []
        step = self.in_flight
        drafting = self.drafter.candidates(self.scheduler.running) if self.drafter is not None else []
        if step is not None and (self.config.disable_overlap_schedule or step.needs_host_tokens or drafting):
            deltas += self.drain()
        if drafting:
            self.drafter.propose(drafting)
        batch = self.scheduler.schedule(admit=self.availability.admitting)
        previous, self.in_flight = self.in_flight, None
        if len(batch) > 0:
            self.in_flight = self.runner.launch(batch, previous)
            self.scheduler.advance(batch)
            self.num_steps += 1
        if previous is not None:
            deltas += self._read(previous)
        if self.config.disable_overlap_schedule:
            deltas += self.drain()
        self.profiler.after_step(self.num_steps)
        return deltas

    def drain(self) -> list[RequestDelta]:
        """Read the step in flight, if any: afterwards every token is known on the host."""
        step, self.in_flight = self.in_flight, None
        return self._read(step) if step is not None else []

    def _read(self, step: LaunchedStep) -> list[RequestDelta]:
        """Wait for a launched step's tokens; apply them; one delta per request still running."""
        results = step.results()
        if step.routes is not None:
            step.routes.commit()
        rows = list(zip(step.requests, results, strict=True))
        if step.batch.drafts:  # a drafted request's rows up to its first token unlike its draft
            rows = self.drafter.accepted_rows(step.batch, rows)
        live = [(r, s) for r, s in rows if not r.finished]
        # Routed experts up to the position this step's token came from (before its blocks may go).
        asking = [r for r, _ in live if r.sampling_params.return_routed_experts]
        routes = self._routes(asking, [r.num_known_tokens if r.sampling_params.max_new_tokens else r.num_prompt_tokens - 1
                                       for r in asking]) if asking else {}
        known = {r: r.num_known_tokens for r, _ in live}
        finished = self.scheduler.resolve(step.batch, [(r, s.token_id) for r, s in live])
        if self.drafter is not None:
            for req in finished:
                self.drafter.finished(req)
        deltas: list[RequestDelta] = []
        for req, rows_of_req in groupby(live, key=lambda row: row[0]):  # a request's rows are consecutive
            samples = [s for _, s in rows_of_req]
            # A prefill-only request (max_new_tokens 0) keeps no token: its one delta is empty.
            # Several tokens where drafts were accepted; none past the one that finished it.
            kept = samples[: req.num_known_tokens - known[req]]
            first = known[req] == req.num_prompt_tokens
            if first:
                self.load_stats.on_prefilled(req.num_prompt_tokens, req.num_cached_tokens)
            want_lp = req.sampling_params.logprobs
            want_top = req.sampling_params.top_logprobs_num > 0
            deltas.append(
                RequestDelta(
                    request_id=req.request_id,
                    new_token_ids=[s.token_id for s in kept],
                    new_logprobs=[s.logprob for s in kept] if want_lp else None,
                    new_top_logprobs=[s.top_logprobs or [] for s in kept] if want_top else None,
                    input_logprobs=_from_logprob_start(req, req.prompt_logprobs) if first else None,
                    input_top_logprobs=_from_logprob_start(req, req.prompt_top_logprobs) if first else None,
                    finished=req.finished,
                    finish_reason=req.finish_reason,
                    stop_matched=req.stop_matched,
                    num_prompt_tokens=req.num_prompt_tokens,
                    num_cached_tokens=req.num_cached_tokens,
                    routed_experts=routes.get(req),
                )
            )
        self.load_stats.on_step(sum(len(d.new_token_ids) for d in deltas))
        return deltas

    def _routes(self, requests: list[Request], ends: list[int]) -> dict[Request, bytes]:
        """The routed experts of each request's positions routes_sent .. end - 1, marked sent;
        none for a request whose positions have no KV now (preempted: they come once recomputed)."""
        log = self.runner.route_log
        if log is None:
            return {}
        ready = [(r, e) for r, e in zip(requests, ends, strict=True)
                 if e <= min(r.num_computed_tokens, len(r.block_table) * log.block_size)]  # fmt: skip
        rows = log.rows([(r.block_table, r.routes_sent, e) for r, e in ready])
        for r, e in ready:
            r.routes_sent = max(r.routes_sent, e)
        return {r: data for (r, _), data in zip(ready, rows, strict=True)}

    def after_reply(self) -> None:
        """Run once a control call's reply is sent, on every rank: the host copy of weights an
        update wrote starts refreshing now, off the update's answer (engine/weights/store.py), and
        what the update's receive leaves behind is freed."""
        self.ranks.after_reply()

    def close(self) -> None:
        """Stop the other ranks' workers."""
        self.ranks.close()

    def has_work(self) -> bool:
        """A step may run (not paused, every tag resident: one forward sees all of them), or one
        is in flight and must be read."""
        if self.in_flight is not None:
            return True
        return self.availability.can_step() and self.scheduler.has_unfinished()

    def take_pending(self) -> list[RequestDelta]:
        out, self.pending = self.pending, []
        return out

    # ---- control calls (run between steps; the serving ones: serving_calls.py) ---------------------

    def call(self, call: calls.ControlCall) -> Any:
        """Run a control call between steps, by its type: its reply (`call.reply`), or a
        `Deferred` that answers later. Every call but a read-only one first reads the step in
        flight (its deltas go out before the reply), so that it sees and changes a state with no
        device work queued."""
        if not call.read_only:
            self.pending += self.drain()
        return _HANDLERS[type(call)](self, call)


_HANDLERS: dict[type, Callable[[EngineCore, Any], Any]] = {
    calls.Ping: EngineCore.ping,
    calls.GetInfo: EngineCore.get_info,
    calls.GetLoad: EngineCore.get_load,
    calls.GetMemoryOccupation: EngineCore.memory_occupation,
    calls.FlushCache: EngineCore.flush_cache,
    calls.PauseGeneration: EngineCore.pause_generation,
    calls.ContinueGeneration: EngineCore.continue_generation,
    calls.Abort: EngineCore.abort_requests,
    calls.ReleaseMemory: EngineCore.release_memory_occupation,
    calls.ResetPrefixCache: EngineCore.reset_prefix_cache,
    calls.ResumeMemory: EngineCore.resume_memory_occupation,
    calls.UpdateWeightsFromDisk: EngineCore.update_weights_from_disk,
    calls.UpdateWeightsFromTensor: EngineCore.update_weights_from_tensor,
    calls.InitWeightsUpdateGroup: EngineCore.init_weights_update_group,
    calls.UpdateWeightsFromDistributed: EngineCore.update_weights_from_distributed,
    calls.DestroyWeightsUpdateGroup: EngineCore.destroy_weights_update_group,
    calls.UpdateWeightVersion: EngineCore.update_weight_version,
    calls.CheckWeights: EngineCore.check_weights,
    calls.StartProfile: EngineCore.start_profile,
    calls.StopProfile: EngineCore.stop_profile,
}


T = TypeVar("T")


def _from_logprob_start(req: Request, per_position: list[T]) -> list[T] | None:
    """A request's per-prompt-position values from its logprob_start_len on; None if not kept."""
    return per_position[req.sampling_params.logprob_start_len :] if per_position else None


def _final_delta(req: Request, unavailable: bool = False, routed_experts: bytes | None = None) -> RequestDelta:
    return RequestDelta(
        routed_experts=routed_experts,
        unavailable=unavailable,
        request_id=req.request_id,
        new_token_ids=[],
        finished=True,
        finish_reason=req.finish_reason or FINISH_ABORT,
        stop_matched=req.stop_matched,
        error=req.error,
        num_prompt_tokens=req.num_prompt_tokens,
        num_cached_tokens=req.num_cached_tokens,
    )

