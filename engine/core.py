"""`EngineCore`: the engine process. It builds its parts in the order DESIGN.md gives, then loops:
take new requests and control calls, schedule one step, run the model, send token deltas back.
Control calls run between steps, in the order they arrive.
"""

from __future__ import annotations

import logging
import os
import time
import traceback
from typing import Any

import msgspec
import zmq

from engine.config import EngineConfig, ModelConfig
from engine.kv_cache import BlockManager
from engine.model_runner import ModelRunner
from engine.protocol import (
    AbortRequests,
    AddRequest,
    ControlCall,
    ControlReply,
    Failed,
    FromCore,
    Ready,
    RequestDelta,
    Shutdown,
    StepOutputs,
    ToCore,
)
from engine.request import FINISH_ABORT, FINISH_ERROR, Request
from engine.scheduler import Scheduler

log = logging.getLogger("siesta.engine")

# How long the idle loop blocks on its socket before it looks at its parent again, ms.
_IDLE_POLL_MS = 100


class EngineCore:
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
        # Deltas produced outside a step (aborts from control calls), sent by the loop.
        self.pending: list[RequestDelta] = []
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
        """Schedule and run one step; return what it produced."""
        batch, refused = self.scheduler.schedule()
        deltas = [_final_delta(r) for r in refused]
        if len(batch) == 0:
            return deltas
        sampled = self.runner.execute(batch)
        self.scheduler.update(batch, {rid: s.token_id for rid, s in sampled.items()})
        self.num_steps += 1
        for req in batch.requests:
            s = sampled.get(req.request_id)
            if s is None:
                continue
            want_lp = req.sampling_params.logprobs
            want_top = req.sampling_params.top_logprobs_num > 0
            deltas.append(
                RequestDelta(
                    request_id=req.request_id,
                    new_token_ids=[s.token_id],
                    new_logprobs=[s.logprob] if want_lp else None,
                    new_top_logprobs=[s.top_logprobs or []] if want_top else None,
                    finished=req.finished,
                    finish_reason=req.finish_reason,
                    stop_matched=req.stop_matched,
                    num_prompt_tokens=req.num_prompt_tokens,
                    num_cached_tokens=req.num_cached_tokens,
                )
            )
        return deltas

    def has_work(self) -> bool:
        return not self.paused and self.scheduler.has_unfinished()

    def take_pending(self) -> list[RequestDelta]:
        out, self.pending = self.pending, []
        return out

    # ---- control calls (run between steps) ------------------------------------------------------

    def flush_cache(self) -> bool:
        """Drop the prefix cache; refused (False) while requests hold blocks."""
        if self.scheduler.has_unfinished():
            return False
        return self.block_manager.reset_prefix_cache()

    def ping(self) -> bool:
        return True

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
        # Names the weights in use; RL weight updates set it (SGLang's default is "default").
        self.weight_version = "default"
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
            "cuda_graph_bytes": self.runner.graphs.graph_bytes if self.runner.graphs else 0,
            "cuda_graph_batch_sizes": self.runner.graphs.batch_sizes if self.runner.graphs else [],
            "kv_blocks_total": self.block_manager.num_blocks,
            "kv_blocks_free": self.block_manager.num_free_blocks,
            "block_size": self.block_manager.block_size,
            "num_running": self.scheduler.num_running,
            "num_waiting": self.scheduler.num_waiting,
            "weight_version": self.weight_version,
            "num_steps": self.num_steps,
            "paused": self.paused,
            "num_preemptions": self.scheduler.num_preemptions,
            "config": msgspec.to_builtins(self.config),
        }

    def call(self, method: str, kwargs: dict[str, Any]) -> Any:
        if method not in _CONTROL_METHODS:
            raise ValueError(f"unknown control method {method!r}")
        return getattr(self, method)(**kwargs)


_CONTROL_METHODS = frozenset(
    {"flush_cache", "get_info", "ping", "pause_generation", "continue_generation", "abort_requests"}
)


def _final_delta(req: Request) -> RequestDelta:
    return RequestDelta(
        request_id=req.request_id,
        new_token_ids=[],
        finished=True,
        finish_reason=req.finish_reason or FINISH_ABORT,
        stop_matched=req.stop_matched,
        error=req.error,
        num_prompt_tokens=req.num_prompt_tokens,
        num_cached_tokens=req.num_cached_tokens,
    )


def run_engine_core(config: EngineConfig, in_addr: str, out_addr: str, log_level: str = "INFO") -> None:
    """Entry point of the engine process: build the core, say Ready (or Failed), serve until told
    to stop or until the parent process is gone."""
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parent = os.getppid()
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(in_addr)
    outbox = ctx.socket(zmq.PUSH)
    outbox.setsockopt(zmq.LINGER, 2000)
    outbox.connect(out_addr)
    encoder = msgspec.msgpack.Encoder()
    decoder = msgspec.msgpack.Decoder(ToCore)

    def send(msg: FromCore) -> None:
        outbox.send(encoder.encode(msg))

    try:
        core = EngineCore(config)
    except Exception as e:  # the client raises this text; the process exits non-zero
        send(Failed(error=f"{type(e).__name__}: {e}"))
        log.error("engine core failed to start:\n%s", traceback.format_exc())
        outbox.close()
        ctx.term()
        raise SystemExit(1) from None
    send(Ready(info=core.get_info()))

    poller = zmq.Poller()
    poller.register(inbox, zmq.POLLIN)
    try:
        while True:
            timeout = 0 if core.has_work() else _IDLE_POLL_MS
            while poller.poll(timeout):
                msg = decoder.decode(inbox.recv())
                if isinstance(msg, Shutdown):
                    return
                deltas = _handle(core, msg, send)
                if deltas:
                    send(StepOutputs(deltas=deltas))
                timeout = 0
            if core.has_work():
                deltas = core.step()
                if deltas:
                    send(StepOutputs(deltas=deltas))
            elif os.getppid() != parent:
                log.warning("parent process is gone; engine core exits")
                return
    except Exception as e:
        log.error("engine core died:\n%s", traceback.format_exc())
        send(Failed(error=f"engine core died: {type(e).__name__}: {e}"))
        raise SystemExit(1) from None
    finally:
        inbox.close()
        outbox.close()
        ctx.term()


def _handle(core: EngineCore, msg: ToCore, send: Any) -> list[RequestDelta]:
    """Apply one message; return the deltas it produced. A control call's own deltas (aborts) are
    sent before its reply, so a caller that sees the reply has seen them too."""
    if isinstance(msg, AddRequest):
        delta = core.add_request(msg)
        return [delta] if delta is not None else []
    if isinstance(msg, AbortRequests):
        return core.abort(msg.request_ids)
    if isinstance(msg, ControlCall):
        try:
            reply = ControlReply(call_id=msg.call_id, ok=True, result=core.call(msg.method, msg.kwargs))
        except Exception as e:  # a bad control call is the caller's error, not the engine's death
            reply = ControlReply(call_id=msg.call_id, ok=False, error=f"{type(e).__name__}: {e}")
        deltas = core.take_pending()
        if deltas:
            send(StepOutputs(deltas=deltas))
        send(reply)
    return []
