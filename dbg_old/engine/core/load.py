"""The load of `EngineCore`, in the fields of SGLang's `/v1/loads` (one data-parallel rank), which
routers and RL clients poll (slime waits for `num_running_reqs + num_waiting_reqs` to reach 0
after an abort).

Definitions, where SGLang's are its own scheduler's:
- tokens count KV slots: `num_used_tokens` is blocks held by requests times the block size,
  `max_total_num_tokens` every block times the block size; `token_usage` their ratio.
- `num_waiting_uncached_tokens`: tokens of waiting requests the prefix cache does not hold now.
- `num_total_tokens`: used tokens plus every token of the waiting requests.
- `gen_throughput`: output tokens per second over the last THROUGHPUT_WINDOW_S seconds.
- `cache_hit_rate`: prompt tokens served by the prefix cache over prompt tokens, since start.
- `utilization`: the larger of running / max_num_seqs and token_usage.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from engine.core import calls

THROUGHPUT_WINDOW_S = 10.0
GB = 1e9  # SGLang reports memory in GB


class LoadStats:
    """Counters the engine loop feeds after each step."""

    def __init__(self) -> None:
        self._generated: deque[tuple[float, int]] = deque()  # (when, output tokens) per step
        self.prompt_tokens = 0
        self.cached_tokens = 0

    def on_step(self, num_generated: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if num_generated:
            self._generated.append((now, num_generated))
        self._prune(now)

    def on_prefilled(self, prompt_tokens: int, cached_tokens: int) -> None:
        """A request's prompt is computed (its first sample): count its prefix-cache hits."""
        self.prompt_tokens += prompt_tokens
        self.cached_tokens += cached_tokens

    def gen_throughput(self, now: float | None = None) -> float:
        self._prune(time.monotonic() if now is None else now)
        return sum(n for _, n in self._generated) / THROUGHPUT_WINDOW_S

    @property
    def cache_hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def _prune(self, now: float) -> None:
        while self._generated and self._generated[0][0] < now - THROUGHPUT_WINDOW_S:
            self._generated.popleft()


class LoadCalls:
    """Mixed into EngineCore; uses its scheduler, block_manager, runner, config, paused, load_stats."""

    def get_load(self, call: calls.GetLoad | None = None) -> dict[str, Any]:
        """SGLang's per-rank load: the core fields, plus `memory` and `queues` sections."""
        bm, sched = self.block_manager, self.scheduler
        used = bm.num_used_blocks * bm.block_size
        capacity = bm.num_blocks * bm.block_size
        waiting = list(sched.waiting)
        usage = used / capacity if capacity else 0.0
        max_running = self.config.max_num_seqs
        graph_bytes = self.runner.graph_bytes
        return {
            "dp_rank": 0,
            "num_running_reqs": sched.num_running,
            "num_waiting_reqs": sched.num_waiting,
            "num_waiting_uncached_tokens": sum(r.num_tokens - bm.match_prefix(r) for r in waiting if not r.block_table),
            "num_used_tokens": used,
            "num_total_tokens": used + sum(r.num_tokens for r in waiting),
            "max_total_num_tokens": capacity,
            "max_running_requests": max_running,
            "token_usage": round(usage, 4),
            "gen_throughput": round(self.load_stats.gen_throughput(), 2),
            "cache_hit_rate": round(self.load_stats.cache_hit_rate, 4),
            "utilization": round(max(sched.num_running / max_running, usage), 4),
            "memory": {
                "weight_gb": round(self.runner.weights_bytes / GB, 3),
                "kv_cache_gb": round(self.runner.kv_cache_bytes / GB, 3),
                "graph_gb": round(graph_bytes / GB, 3),
                "token_capacity": capacity,
            },
            "queues": {
                "waiting": sched.num_waiting,
                "grammar": 0,
                "paused": sched.num_running + sched.num_waiting if self.availability.paused else 0,
                "retracted": sum(1 for r in waiting if r.num_preemptions > 0),
            },
        }
