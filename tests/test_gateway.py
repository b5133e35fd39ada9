"""Two real Siesta servers behind the real SGLang Model Gateway (`smg`, its Rust binary started
by `python -m smg.launch_router` on loopback ports), as RL frameworks deploy replicas
(docs/SMG_GATEWAY.md says what the gateway asks a worker):

- the gateway registers both as SGLang workers (engine `sglang`, model, capacity, limits) and
  parses their `/v1/loads`;
- `/generate` through it reaches both replicas, and one prompt family stays on one replica
  (cache-aware routing);
- `/v1/rl/engine/...` fan-outs selected by `engine=sglang` release and resume memory on both,
  and an `update_weights_from_disk` leaves both generating what a fresh server on the new
  checkpoint generates;
- smg's own RL client (`smg.rl.RL.fanout`, `smg.rl.paused`) pauses both, flushes their caches
  and lets them continue.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest
from server_util import ServerProcess, free_port, stop_process

pytest.importorskip("smg")

READY_TIMEOUT_S = 60.0


class Gateway:
    """`python -m smg.launch_router` in front of `workers`, ready once every worker is."""

    def __init__(self, workers: list[str], log_path: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [
            sys.executable, "-m", "smg.launch_router", "--worker-urls", *workers,
            "--policy", "cache_aware", "--enable-rl", "--host", "127.0.0.1", "--port", str(self.port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
            "--health-check-interval-secs", "1", "--load-monitor-interval", "1",
            "--worker-startup-check-interval", "1",
        ]  # fmt: skip
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        self.http = httpx.Client(base_url=self.url, timeout=60.0)
        self._wait_workers(len(workers))

    def _wait_workers(self, n: int) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"smg exited with {self.proc.returncode}")
            try:
                workers = self.http.get("/v1/rl/workers").json()["workers"]
                if len(workers) == n and all(w["health"] == "ready" for w in workers):
                    return
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"smg did not report {n} ready workers within {READY_TIMEOUT_S} s")

    def generate(self, text: str, max_new_tokens: int = 4) -> httpx.Response:
        body = {"text": text, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0}}
        return self.http.post("/generate", json=body)

    def fanout(self, path: str, body: dict) -> dict:
        r = self.http.post(f"/v1/rl/engine/{path}", params={"selector": "engine=sglang"}, json=body)
        assert r.status_code == 200, r.text
        return r.json()

    def stop(self) -> None:
        self.http.close()
        stop_process(self.proc)
        self.log.close()


@pytest.fixture(scope="module")
def replicas(demo_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gateway, list[ServerProcess]]]:
    logs = tmp_path_factory.mktemp("gateway")
    servers = [ServerProcess(demo_dir, "--max-model-len", "512", log_path=str(logs / f"siesta{i}.log")) for i in range(2)]
    gateway = None
    try:
        gateway = Gateway([s.url for s in servers], str(logs / "smg.log"))
        yield gateway, servers
    finally:
        if gateway is not None:
            gateway.stop()
        for s in servers:
            s.stop()


def _requests_served(server: ServerProcess) -> float:
    """Requests the replica finished, over every outcome label of siesta_requests_total."""
    from prometheus_client.parser import text_string_to_metric_families

    with server.client() as http:
        families = text_string_to_metric_families(http.get("/metrics").text)
        return sum(s.value for f in families for s in f.samples if s.name == "siesta_requests_total")


def test_the_gateway_registers_siesta_as_an_sglang_worker(replicas) -> None:
    gateway, servers = replicas
    workers = {w["url"]: w for w in gateway.http.get("/v1/rl/workers").json()["workers"]}
    assert set(workers) == {s.url for s in servers}
    for w in workers.values():
        assert w["engine"] == "sglang" and w["health"] == "ready" and w["tp_size"] == 1
        assert w["labels"]["max_running_requests"] == "256" and w["labels"]["context_length"] == "512"
        assert w["labels"]["is_generation"] == "true"
    deadline = time.monotonic() + 10
    loads = []
    while time.monotonic() < deadline and len(loads) < 2:  # the load monitor polls every second
        loads = gateway.http.get("/get_loads").json().get("loads", [])
        time.sleep(0.2)
    assert {entry["worker"] for entry in loads} == {s.url for s in servers}
    assert all(entry["max_running_requests"] == 256 and entry["max_total_num_tokens"] > 0 for entry in loads)


def test_generate_reaches_both_replicas_and_a_prompt_family_stays_on_one(replicas) -> None:
    gateway, servers = replicas
    before = [_requests_served(s) for s in servers]
    routed = {}
    words = ["apple", "zebra", "quantum", "mango", "violet", "kettle", "orbit", "nectar", "bishop", "delta"]
    for word in words:
        r = gateway.generate(f"{word} is where this prompt starts")
        assert r.status_code == 200, r.text
        assert r.json()["meta_info"]["completion_tokens"] == 4
        routed[word] = r.headers["x-smg-routed-worker-id"]
    served = [_requests_served(s) - b for s, b in zip(servers, before, strict=True)]
    assert sum(served) == len(words) and min(served) > 0, served  # both replicas did work
    assert sorted(set(routed.values())) == sorted(s.url for s in servers)
    family = {gateway.generate(f"zebra is where this prompt starts, then goes on {i}").headers["x-smg-routed-worker-id"] for i in range(5)}
    assert family == {routed["zebra"]}  # the family's prefix lives in that replica's cache


def test_rl_fanouts_release_resume_and_update_weights_on_both(replicas, tmp_path_factory: pytest.TempPathFactory) -> None:
    from engine.demo_model import create_demo_model

    gateway, servers = replicas
    released = gateway.fanout("release_memory_occupation", {})
    assert released["total"] == 2 and released["succeeded"] == 2 and not released["failed"]
    for s in servers:
        with s.client() as http:
            assert http.get("/server_info").json()["memory"] == "released"
    resumed = gateway.fanout("resume_memory_occupation", {})
    assert resumed["succeeded"] == 2
    for s in servers:
        with s.client() as http:
            assert http.get("/server_info").json()["memory"] == "resident"

    new_dir = create_demo_model(str(tmp_path_factory.mktemp("demo-v2")), seed=7)
    updated = gateway.fanout("update_weights_from_disk", {"model_path": new_dir, "weight_version": "v2"})
    assert updated["succeeded"] == 2
    assert all(r["body"]["success"] and r["body"]["weight_version"] == "v2" for r in updated["results"].values())
    fresh = ServerProcess(new_dir, "--max-model-len", "512", log_path=os.devnull)
    try:
        with fresh.client() as http:
            prompts = ["apple is where this prompt starts", "zebra is where this prompt starts"]
            body = {"sampling_params": {"max_new_tokens": 8, "temperature": 0.0}}
            want = [http.post("/generate", json=body | {"text": p}).json()["output_ids"] for p in prompts]
    finally:
        fresh.stop()
    for prompt, ids in zip(prompts, want, strict=True):
        r = gateway.generate(prompt, max_new_tokens=8)
        assert r.json()["output_ids"] == ids and r.json()["meta_info"]["weight_version"] == "v2"
    for s in servers:  # each replica itself, not only the ones the gateway picked
        with s.client() as http:
            got = http.post("/generate", json={"text": prompts[0], "sampling_params": {"max_new_tokens": 8, "temperature": 0.0}})
            assert got.json()["output_ids"] == want[0]


def test_smg_rl_client_pauses_flushes_and_continues_both(replicas) -> None:
    """smg's own Python client (`smg.rl.RL`, `smg.rl.paused`), as a trainer drives a refit."""
    from smg.rl import RL, paused

    gateway, servers = replicas

    def paused_flags() -> list[bool]:
        flags = []
        for s in servers:
            with s.client() as http:
                flags.append(http.get("/server_info").json()["paused"])
        return flags

    rl = RL(gateway.url, timeout=60.0)
    assert {w.url for w in rl.workers()} == {s.url for s in servers}
    with paused(rl, "engine=sglang", mode="abort") as pause:
        assert pause.succeeded == 2 and not pause.failed
        assert paused_flags() == [True, True]
        flushed = rl.fanout("flush_cache", {}, selector="engine=sglang")
        assert flushed.succeeded == 2
        assert all(r.status == 200 and r.body["success"] for r in flushed.results.values())
    assert paused_flags() == [False, False]
    r = gateway.generate("after the pause")
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 4
