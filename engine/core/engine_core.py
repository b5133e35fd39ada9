"""`EngineCore`: the engine process. It builds its parts in the order docs/ARCHITECTURE.md gives, then loops:
take new requests and control calls, schedule and launch step k+1, read step k's tokens (overlap
scheduling: the host works while the device runs), send token deltas back. Control calls run
between steps, in the order they arrive, with no step in flight (read-only ones excepted).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import msgspec

from engine.config import EngineConfig, ModelConfig
from engine.core.checks import WeightCheckCalls
from engine.core.load import LoadCalls, LoadStats
from engine.core.memory_calls import MemoryCalls
from engine.core.profiler import ProfileCalls, StepProfiler
from engine.core.protocol import (
    AddRequest,
    RequestDelta,
)
from engine.core.scheduler import Scheduler
from engine.core.weight_calls import WeightUpdateCalls
from engine.memory.kv_cache import BlockManager
from engine.memory.regions import RELEASED, RESIDENT
from engine.request import FINISH_ABORT, FINISH_ERROR, Request
from engine.runner.launched_step import LaunchedStep
from engine.runner.model_runner import ModelRunner
from engine.weights.updater import WeightUpdater

log = logging.getLogger("siesta.engine")


class EngineCore(MemoryCalls, WeightUpdateCalls, WeightCheckCalls, ProfileCalls, LoadCalls):
    def __init__(self, config: EngineConfig) -> None:
        t0 = time.perf_counter()
        self.config = config
        self.model_config = ModelConfig.from_hf(config.model)
        self.max_model_len = min(
            config.max_model_len or self.model_config.max_position_embeddings,
            self.model_config.max_position_embeddings,
        )
        self.runner = ModelRunner(config, self.model_config, self.max_model_len)
        self.block_manager = BlockManager(
            self.runner.num_kv_blocks, config.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_batched_tokens, config.max_num_seqs, self.max_model_len
        )
        self.num_steps = 0
        # Paused: no step runs; new requests queue. Set by pause_generation, cleared by
        # continue_generation.
        self.paused = False
        # Names the weights in use; RL weight updates set it (SGLang's default is "default").
        self.weight_version = "default"
        self.memory = self.runner.memory
        # A release in progress: running requests finish, new ones are refused.
        self.draining = False
        # Deltas produced outside a step (aborts from control calls), sent by the loop.
        self.pending: list[RequestDelta] = []
        # The step launched last and not read yet (overlap scheduling); None between steps
        # when overlap is off, and always before a control call runs.
        self.in_flight: LaunchedStep | None = None
        self.updater = WeightUpdater(self.runner.weights, config)
        self.profiler = StepProfiler(self.runner.device)
        self.load_stats = LoadStats()
        log.info("engine core ready in %.2f s", time.perf_counter() - t0)

    # ---- requests -------------------------------------------------------------------------------

    def add_request(self, msg: AddRequest) -> RequestDelta | None:
        """Queue a request, or refuse it at once with an error delta naming the problem."""
        req = Request(
            request_id=msg.request_id,
            prompt_token_ids=list(msg.prompt_token_ids),
            sampling_params=msg.sampling_params,
            eos_token_ids=self.model_config.eos_token_ids,
        )
        unavailable = self.unavailable()
        if unavailable is not None:
            req.finish(FINISH_ERROR, error=unavailable)
            return _final_delta(req, unavailable=True)
        error = self._check_request(req)
        if error is not None:
            req.finish(FINISH_ERROR, error=error)
            return _final_delta(req)
        self.scheduler.add(req)
        return None

    def _check_request(self, req: Request) -> str | None:
        n = req.num_prompt_tokens
        if n == 0:
            return "the prompt is empty"
        vocab = self.model_config.vocab_size
        bad = next((t for t in req.prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            return f"token id {bad} is outside the vocabulary [0, {vocab})"
        bad = next((t for t, _ in req.sampling_params.logit_bias if not 0 <= t < vocab), None)
        if bad is not None:
            return f"logit_bias token id {bad} is outside the vocabulary [0, {vocab})"
        if req.max_total_tokens > self.max_model_len:
            return (
                f"prompt ({n} tokens) + max_new_tokens ({req.sampling_params.max_new_tokens}) "
                f"exceeds the context length of {self.max_model_len} tokens"
            )
        return None

    def abort(self, request_ids: list[str] | None) -> list[RequestDelta]:
        ids = request_ids if request_ids is not None else self.scheduler.request_ids()
        aborted = (self.scheduler.abort(rid) for rid in ids)
        return [_final_delta(r) for r in aborted if r is not None]

    def step(self) -> list[RequestDelta]:
        """Schedule and launch one step, then read the step launched before it: the host packs
        step k+1 while the device runs step k, and step k's tokens come back while k+1 runs.
        Returns the deltas of the step read (and of requests refused). With overlap off, or
        when a step needs the previous tokens on the host (penalties count them), the previous
        step is read first."""
        deltas: list[RequestDelta] = []
        step = self.in_flight
        if step is not None and (self.config.disable_overlap_schedule or step.needs_host_tokens):
            deltas += self.drain()
        batch, refused = self.scheduler.schedule()
        deltas += [_final_delta(r) for r in refused]
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
        live = [(r, s) for r, s in zip(step.requests, results, strict=True) if not r.finished]
        self.scheduler.resolve(step.batch, [(r, s.token_id) for r, s in live])
        deltas: list[RequestDelta] = []
        for req, s in live:
            # A prefill-only request (max_new_tokens 0) keeps no token: its one delta is empty.
            kept = req.sampling_params.max_new_tokens > 0
            first = req.num_known_tokens - req.num_prompt_tokens == int(kept)
            if first:
                self.load_stats.on_prefilled(req.num_prompt_tokens, req.num_cached_tokens)
            want_lp = req.sampling_params.logprobs
            want_top = req.sampling_params.top_logprobs_num > 0
            deltas.append(
                RequestDelta(
                    request_id=req.request_id,
                    new_token_ids=[s.token_id] if kept else [],
                    new_logprobs=([s.logprob] if kept else []) if want_lp else None,
                    new_top_logprobs=([s.top_logprobs or []] if kept else []) if want_top else None,
                    input_logprobs=_input_logprobs(req) if first else None,
                    finished=req.finished,
                    finish_reason=req.finish_reason,
                    stop_matched=req.stop_matched,
                    num_prompt_tokens=req.num_prompt_tokens,
                    num_cached_tokens=req.num_cached_tokens,
                )
            )
        self.load_stats.on_step(sum(len(d.new_token_ids) for d in deltas))
        return deltas

    def unavailable(self) -> str | None:
        """Why no new request can run now (HTTP 503), or None."""
        if self.memory.released:
            return f"memory is released ({', '.join(self.memory.released)}): resume_memory_occupation first"
        if self.draining:
            return "memory is being released"
        if not self.weights_valid:
            return "weights were released without a host copy (--weights-backup none): update the weights first"
        return None

    def after_reply(self) -> None:
        """Run once a control call's reply is sent: the host copy of weights an update wrote
        starts refreshing now, off the update's answer (engine/weights/store.py), and what the
        update's receive leaves behind is freed."""
        self.updater.after_reply()
        self.runner.weights.refresh_host()

    def has_work(self) -> bool:
        """A step may run (not paused, every tag resident: one forward sees all of them), or one
        is in flight and must be read."""
        if self.in_flight is not None:
            return True
        return not self.paused and not self.memory.released and self.scheduler.has_unfinished()

    def take_pending(self) -> list[RequestDelta]:
        out, self.pending = self.pending, []
        return out

    # ---- control calls (run between steps) ------------------------------------------------------

    def flush_cache(self) -> bool:
        """Drop the prefix cache; refused (False) while requests hold blocks."""
        if self.scheduler.has_unfinished():
            return False
        return self.block_manager.reset_prefix_cache()

    def ping(self) -> str:
        """The engine answers; says whether its memory is resident or released."""
        return RELEASED if self.memory.released else RESIDENT

    def pause_generation(self, mode: str = "abort") -> dict[str, Any]:
        """Stop stepping. `abort` finishes every request with finish_reason abort; `retract` frees
        running requests' KV and requeues them (they recompute on continue); `in_place` keeps
        everything as it is. New requests queue until `continue_generation`."""
        if mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"unknown pause mode {mode!r}; use abort, retract or in_place")
        self.paused = True
        if mode == "abort":
            self.pending += self.abort(None)
        elif mode == "retract":
            self.scheduler.retract_all()
        return {"paused": True, "mode": mode, "num_running": self.scheduler.num_running,
                "num_waiting": self.scheduler.num_waiting}

    def continue_generation(self) -> dict[str, Any]:
        self.paused = False
        return {"paused": False}

    def abort_requests(self, request_ids: list[str] | None) -> int:
        """Abort the named requests (None: all); returns how many were found."""
        deltas = self.abort(request_ids)
        self.pending += deltas
        return len(deltas)

    def get_info(self) -> dict[str, Any]:
        mc = self.model_config
        return {
            "model_path": mc.path,
            "architecture": mc.architecture,
            "dtype": str(self.runner.dtype).replace("torch.", ""),
            "device": str(self.runner.device),
            "max_context_length": self.max_model_len,
            "vocab_size": mc.vocab_size,
            "eos_token_ids": list(mc.eos_token_ids),
            "attention_backend": self.runner.backend_name,
            "weights_bytes": self.runner.weights_bytes,
            "kv_cache_bytes": self.runner.kv_cache_bytes,
            "cuda_graph_bytes": self.runner.graph_bytes,
            "cuda_graph_batch_sizes": self.runner.graphs.batch_sizes if self.runner.graphs else [],
            "piecewise_cuda_graph_tokens": self.runner.piecewise.token_sizes if self.runner.piecewise else [],
            "kv_blocks_total": self.block_manager.num_blocks,
            "kv_blocks_free": self.block_manager.num_free_blocks,
            "block_size": self.block_manager.block_size,
            "num_running": self.scheduler.num_running,
            "num_waiting": self.scheduler.num_waiting,
            "weight_version": self.weight_version,
            "num_steps": self.num_steps,
            "paused": self.paused,
            "memory": self.ping(),
            "released_tags": self.memory.released,
            "num_preemptions": self.scheduler.num_preemptions,
            "memory_saver": self.memory.enabled,
            "config": msgspec.to_builtins(self.config),
        }

    def call(self, method: str, kwargs: dict[str, Any]) -> Any:
        """Run a control call between steps. Every call but a read-only one first reads the step
        in flight (its deltas go out before the reply), so that it sees and changes a state
        with no device work queued."""
        if method not in _CONTROL_METHODS:
            raise ValueError(f"unknown control method {method!r}")
        if method not in _READ_ONLY_METHODS:
            self.pending += self.drain()
        return getattr(self, method)(**kwargs)


_CONTROL_METHODS = frozenset({
    "flush_cache", "get_info", "ping", "pause_generation", "continue_generation", "abort_requests",
    "release_memory_occupation", "resume_memory_occupation", "memory_occupation",
    "update_weights_from_disk", "update_weights_from_tensor", "init_weights_update_group",
    "update_weights_from_distributed", "destroy_weights_update_group",
    "check_weights", "start_profile", "stop_profile", "get_load",
})


# Control calls that only report: they run with a step in flight.
_READ_ONLY_METHODS = frozenset({"get_info", "ping", "memory_occupation", "get_load"})


def _input_logprobs(req: Request) -> list[float | None] | None:
    start = req.sampling_params.logprob_start_len
    return req.prompt_logprobs[start:] if req.prompt_logprobs else None


def _final_delta(req: Request, unavailable: bool = False) -> RequestDelta:
    return RequestDelta(
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
