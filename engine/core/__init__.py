"""The engine process: its loop, its messages, its scheduler and its control calls. Runs in the
ENGINE process (spawned by `engine.client.core_process.CoreProcess`), which owns the device.

- `loop.py`: the process's entry point; takes messages, answers control calls, runs steps.
- `engine_core.py`: `EngineCore`, built in startup order; a step schedules, launches and reads back.
- `protocol.py`: the msgspec messages between a client and this process.
- `client_pipes.py`: `ClientPipes`, this process's sockets to its clients (one pair each: the
  `Engine`, or each API server process), which client a request's deltas go to.
- `calls.py`: one struct per control call and the reply each answers with, dispatched by type.
- `availability.py`: `Availability`, the one owner of whether the engine serves; `EngineState`,
  its value, carried by every control reply.
- `scheduler.py`: continuous batching over the KV blocks (`engine.memory.kv_cache`).
- `drafts.py`: `NgramDrafter`, speculative decoding's model-free drafts and their verification;
  `ModelDrafter`, the same rules with a draft model's tokens (engine/runner/draft_model.py).
- Tensor parallelism: `rank.py` (`Rank`, one rank's device side: runner, regions, updater),
  `ranks.py` (`Ranks`, every rank as rank 0 drives them: the worker processes, their sockets, a
  watchdog), `rank_protocol.py` (one struct per thing a rank does), `worker.py` (the worker
  process of a rank above 0, spawned by `Ranks`).
- `process_title.py`: the names `ps` shows (`siesta::engine`, `siesta::tp1`, `siesta::api1`).
- `serving_calls.py`, `memory_calls.py`, `weight_calls.py`, `checks.py`, `load.py`, `profiler.py`:
  the control calls (ping, info, flush, pause/continue, abort; release/resume, weight updates,
  the weights checker, `/v1/loads`, profiling), mixed into
  `EngineCore`; `deferred.py`: a call that answers once the engine is ready for it.

Arrows: core -> runner, memory, weights (never the other way).
"""
