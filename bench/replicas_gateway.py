"""The replicas of bench_replicas.py and the gateway in front of them: `replica` starts a
`siesta serve` on the index-th GPU, `Gateway` runs the SGLang Model Gateway (smg) on loopback
and fans calls out to every replica, `requests_served` reads how many requests a replica
finished."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from typing import Any

import httpx
from bench_runtime import free_port, say
from serving_server import Server


def replica(model: str, flags: list[str], log_path: str, index: int, gpu: bool) -> Server:
    """A `Server` on this process's index-th GPU: it inherits the environment, so
    CUDA_VISIBLE_DEVICES is set only while it spawns (to the id this process's own list names)."""
    seen = os.environ.get("CUDA_VISIBLE_DEVICES")
    if gpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = seen.split(",")[index].strip() if seen else str(index)
    try:
        return Server(model, flags, log_path)
    finally:
        if seen is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = seen


class Gateway(Server):
    """`python -m smg.launch_router` in a process group of its own in front of `workers` (this
    interpreter and environment: the GPU machine has smg from wheels on PYTHONPATH only). Stopped
    by Server's bounded `stop` (it has no engine process)."""

    def __init__(self, workers: list[str], log_path: str) -> None:
        self.workers, self.engine_pid, port = workers, None, free_port()
        self.url = f"http://127.0.0.1:{port}"
        # its Prometheus port too is a free one: the default 29000 may clash
        cmd = [sys.executable, "-m", "smg.launch_router", "--worker-urls", *workers, "--policy", "cache_aware",
               "--enable-rl", "--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1",
               "--prometheus-port", str(free_port()), "--health-check-interval-secs", "1", "--load-monitor-interval", "1",
               "--worker-startup-check-interval", "1", "--shutdown-grace-period-secs", "0"]
        self.log = open(log_path, "w")
        say(f"gateway: {shlex.join(cmd)} (log: {log_path})")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.http = httpx.Client(base_url=self.url)  # one client: making one costs ~20 ms (its SSL context)

    def wait_ready(self, timeout_s: float) -> dict[str, Any]:
        """Until `/v1/rl/workers` lists every worker, each `ready` (`/readiness` needs only one)."""
        deadline, seen = time.monotonic() + timeout_s, {}
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"smg exited with {self.proc.returncode}: see {self.log.name}")
            try:
                seen = {w["url"]: w["health"] for w in self.http.get("/v1/rl/workers", timeout=5.0).json()["workers"]}
            except (httpx.HTTPError, ValueError, KeyError):
                seen = {}
            if set(seen) == set(self.workers) and set(seen.values()) == {"ready"}:
                return seen
            time.sleep(0.2)
        raise RuntimeError(f"smg did not report {len(self.workers)} ready workers in {timeout_s:.0f} s (last: {seen})")

    def fanout(self, route: str, body: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """One call to every replica: its wall time, status, per-worker answers, slowest worker."""
        t = time.perf_counter()
        r = self.http.post(f"/v1/rl/engine/{route}", params={"selector": "engine=sglang"}, json=body, timeout=timeout_s)
        wall_ms, ans = 1e3 * (time.perf_counter() - t), r.json()
        results = ans.get("results") or {}
        return {"wall_ms": wall_ms, "status": r.status_code, "succeeded": ans.get("succeeded"), "failed": ans.get("failed"),
                "worker_max_latency_ms": max((x.get("latency_ms") or 0.0 for x in results.values()), default=None),
                "results": results}

    def stop(self) -> None:
        self.http.close()
        super().stop()


def requests_served(url: str) -> float:
    """The replica's finished requests: siesta_requests_total summed over its outcome labels."""
    text = httpx.get(f"{url}/metrics", timeout=30.0).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("siesta_requests_total"))
