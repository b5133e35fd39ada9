"""`ServingCalls`: the control calls about serving itself, mixed into `EngineCore`: ping, info,
flushing the prefix cache, pausing and continuing generation, aborting requests. Each runs between
steps, as every control call (one struct each in calls.py; the handler table in engine_core.py)."""

from __future__ import annotations

from typing import Any

import msgspec

from engine.core import calls
from engine.core.deferred import Deferred
from engine.memory.regions import RELEASED, RESIDENT
from engine.request import SAMPLE_SEP

# pause_generation's modes: SGLang's three and vLLM's `wait` (vLLM's `keep` is `in_place`).
PAUSE_MODES = ("abort", "retract", "in_place", "wait")


class ServingCalls:
    """Uses `EngineCore`'s state: scheduler, block_manager, availability, memory, runner, ranks,
    drafter, pending, and its `abort`."""

    def flush_cache(self, call: calls.FlushCache | None = None) -> bool:
        """Drop the prefix cache; refused (False) while requests hold blocks."""
        if self.scheduler.has_unfinished():
            return False
        return self.block_manager.reset_prefix_cache()

    def ping(self, call: calls.Ping | None = None) -> str:
        """The engine answers; says whether its memory is resident or released."""
        return RELEASED if self.memory.released else RESIDENT

    def pause_generation(self, call: calls.PauseGeneration) -> calls.PauseReply | Deferred:
        """Stop stepping. `abort` finishes every request with finish_reason abort; `retract` frees
        running requests' KV and requeues them (they recompute on continue); `in_place` keeps
        everything as it is (vLLM's `keep`: the requests continue where they stopped, across a
        weight update too); `wait` admits no more requests and answers once the running ones
        finished (those waiting stay queued). New requests queue until `continue_generation`.
        `clear_cache` then drops every prefix hash (blocks in use keep their KV)."""
        mode, availability = call.mode, self.availability
        if mode not in PAUSE_MODES:
            raise ValueError(f"unknown pause mode {mode!r}; use {', '.join(PAUSE_MODES)}")

        def paused() -> calls.PauseReply:
            availability.paused, availability.pausing = True, False
            if call.clear_cache:
                self.block_manager.forget_prefixes()
            return calls.PauseReply(paused=True, mode=mode, num_running=self.scheduler.num_running,
                                    num_waiting=self.scheduler.num_waiting)

        if mode == "wait" and availability.can_step():
            availability.pausing = True
            return Deferred(ready=lambda: self.scheduler.num_running == 0, run=paused)
        if mode == "abort":
            self.pending += self.abort(None, "aborted by pause_generation (mode abort)")
        elif mode == "retract":
            self.scheduler.retract_all()
        return paused()

    def continue_generation(self, call: calls.ContinueGeneration) -> calls.PauseReply:
        self.availability.paused = False
        return calls.PauseReply(paused=False)

    def abort_requests(self, call: calls.Abort) -> int:
        """Abort the named requests (None: all), with `samples` also their samples (id + SAMPLE_SEP
        + i); returns how many were found."""
        ids = call.request_ids
        if ids is not None and call.samples:
            names, samples = set(ids), tuple(rid + SAMPLE_SEP for rid in ids)
            ids = [r for r in self.scheduler.request_ids() if r in names or r.startswith(samples)]
        deltas = self.abort(ids, "aborted by abort_request")
        self.pending += deltas
        return len(deltas)

    def get_info(self, call: calls.GetInfo | None = None) -> dict[str, Any]:
        mc = self.model_config
        return {
            "model_path": mc.path,
            "architecture": mc.architecture,
            "dtype": str(self.runner.dtype).replace("torch.", ""),
            "device": str(self.runner.device),
            "tp_size": self.config.tp_size,
            # SGLang's ep_size: the ranks the experts are spread over whole (1: sliced, or no experts)
            "ep_size": self.config.ep_size if mc.num_experts else 1,
            "tp_worker_pids": self.ranks.pids,
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
            "weight_version": self.availability.weight_version,
            "num_steps": self.num_steps,
            "paused": self.availability.paused,
            "memory": self.ping(),
            "released_tags": self.memory.released,
            "num_preemptions": self.scheduler.num_preemptions,
            # speculative decoding: draft tokens verified and accepted since start (0, 0 when off)
            "spec_draft_tokens": self.drafter.proposed if self.drafter else 0,
            "spec_accepted_tokens": self.drafter.accepted if self.drafter else 0,
            "memory_saver": self.memory.enabled,
            "config": msgspec.to_builtins(self.config),
        }
