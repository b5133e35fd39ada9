"""The real SGLang Model Gateway (`smg`, its Rust binary started by `python -m smg.launch_router`)
on a free loopback port in front of real Siesta servers, for the gateway tests
(docs/SMG_GATEWAY.md says what the gateway asks a worker)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
from server_util import ServerProcess, free_port, stop_process

READY_TIMEOUT_S = 60.0
# Probe health and loads every second (the defaults are 60 s and 10 s).
FAST_PROBES = ("--health-check-interval-secs", "1", "--load-monitor-interval", "1", "--worker-startup-check-interval", "1")


class Gateway:
    """`python -m smg.launch_router --policy cache_aware --enable-rl ... EXTRA` in front of
    `workers`, ready once every worker is."""

    def __init__(self, workers: list[str], log_path: str, *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [
            sys.executable, "-m", "smg.launch_router", "--worker-urls", *workers,
            "--policy", "cache_aware", "--enable-rl", "--host", "127.0.0.1", "--port", str(self.port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()), *FAST_PROBES, *extra,
        ]  # fmt: skip
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        self.http = httpx.Client(base_url=self.url, timeout=60.0)
        try:
            self.wait_health({url: "ready" for url in workers})
        except BaseException:
            self.stop()
            raise

    def workers(self) -> dict[str, dict]:
        """The gateway's RL view of its workers, by URL (`/v1/rl/workers`)."""
        return {w["url"]: w for w in self.http.get("/v1/rl/workers").json()["workers"]}

    def wait_health(self, want: dict[str, str | tuple[str, ...]], timeout_s: float = READY_TIMEOUT_S) -> None:
        """Until the gateway reports each URL's health as `want[url]` (one of them, for a tuple)."""
        deadline = time.monotonic() + timeout_s
        seen: dict[str, str] = {}
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"smg exited with {self.proc.returncode}")
            try:
                seen = {url: w["health"] for url, w in self.workers().items()}
            except (httpx.HTTPError, ValueError, KeyError):
                seen = {}
            if set(seen) == set(want) and all(seen[u] in (h if isinstance(h, tuple) else (h,)) for u, h in want.items()):
                return
            time.sleep(0.2)
        raise RuntimeError(f"smg did not report {want} within {timeout_s} s (last: {seen})")

    def generate(self, text: str, max_new_tokens: int = 4, headers: dict[str, str] | None = None) -> httpx.Response:
        body = {"text": text, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0}}
        return self.http.post("/generate", json=body, headers=headers)

    def fanout(self, path: str, body: dict) -> dict:
        r = self.http.post(f"/v1/rl/engine/{path}", params={"selector": "engine=sglang"}, json=body)
        assert r.status_code == 200, r.text
        return r.json()

    def stop(self) -> None:
        self.http.close()
        stop_process(self.proc)
        self.log.close()


@contextmanager
def replicas(
    model_dir: str, logs: str, n: int = 2, *gateway_args: str, server_args: tuple[str, ...] = (),
    envs: list[dict[str, str]] | None = None,
) -> Iterator[tuple[Gateway, list[ServerProcess]]]:
    """`n` Siesta servers on `model_dir` (512-token context, then `server_args`; replica i with
    `envs[i]` added to its environment) and a gateway in front of them."""
    servers: list[ServerProcess] = []
    gateway = None
    try:
        for i in range(n):
            servers.append(ServerProcess(model_dir, "--max-model-len", "512", *server_args,
                                         log_path=f"{logs}/siesta{i}.log", env=envs[i] if envs else None))
        gateway = Gateway([s.url for s in servers], f"{logs}/smg.log", *gateway_args)
        yield gateway, servers
    finally:
        if gateway is not None:
            gateway.stop()
        for s in servers:
            s.stop()


def requests_served(server: ServerProcess) -> float:
    """Requests the replica finished, over every outcome label of siesta_requests_total."""
    from prometheus_client.parser import text_string_to_metric_families

    with server.client() as http:
        families = text_string_to_metric_families(http.get("/metrics").text)
        return sum(s.value for f in families for s in f.samples if s.name == "siesta_requests_total")
