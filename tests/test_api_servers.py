"""`siesta serve --api-server-count 2`: two real API server processes on one port in front of one
engine process (server/api_servers.py, engine/core/client_pipes.py).

Each test reaches a chosen process by opening connections until one lands on it (the kernel
spreads connections over the processes' SO_REUSEPORT sockets) and keeping that connection.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from server_util import ServerProcess, logged_server

PROMPTS = [[3, 17, 29, 41, 5], [7, 11, 13], [19, 23, 31, 37, 43, 47, 53]]
N = 12
GREEDY = {"max_new_tokens": N, "temperature": 0, "ignore_eos": True}
LONG = {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(qwen3_dir: str, tmp_path_factory: pytest.TempPathFactory):
    proc = logged_server(qwen3_dir, str(tmp_path_factory.mktemp("logs")), "api_servers", "--api-server-count", "2")
    yield proc
    proc.stop()


@contextlib.contextmanager
def on_process(server: ServerProcess, index: int, attempts: int = 200) -> Iterator[httpx.Client]:
    """A client whose one kept-alive connection is served by API server process `index`."""
    for _ in range(attempts):
        with server.client(limits=httpx.Limits(max_connections=1, max_keepalive_connections=1)) as http:
            if http.get("/get_server_info").json()["api_server"]["index"] == index:
                yield http
                return
    raise AssertionError(f"no connection reached API server process {index} in {attempts} tries")


def _generate(http: httpx.Client, prompts: list[list[int]] = PROMPTS) -> list[dict]:
    r = http.post("/generate", json={"input_ids": prompts, "sampling_params": GREEDY})
    assert r.status_code == 200, r.text
    return r.json()


def _counts(http: httpx.Client) -> dict[str, float]:
    """Finished requests, first tokens and inter-token gaps that /metrics counts."""
    lines = http.get("/metrics").text.splitlines()
    names = {"requests": "siesta_requests_total{", "first": "siesta_time_to_first_token_seconds_count ",
             "gaps": "siesta_inter_token_latency_seconds_count "}
    return {k: sum(float(line.split()[-1]) for line in lines if line.startswith(prefix)) for k, prefix in names.items()}


def test_both_processes_serve_one_engine(server: ServerProcess, expected) -> None:
    with on_process(server, 0) as first, on_process(server, 1) as second:
        infos = [http.get("/get_server_info").json() for http in (first, second)]
        assert [i["api_server"]["count"] for i in infos] == [2, 2]
        assert infos[0]["api_server"]["pid"] != infos[1]["api_server"]["pid"]
        assert infos[0]["api_server"]["pid"] == server.proc.pid  # process 0 is the one `siesta serve` started
        assert infos[0]["engine_pid"] == infos[1]["engine_pid"]
        before = _counts(first)
        outs: dict[str, list[dict]] = {}
        threads = [threading.Thread(target=lambda n=n, h=h: outs.__setitem__(n, _generate(h)))
                   for n, h in (("first", first), ("second", second))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        for name in ("first", "second"):
            assert [o["output_ids"] for o in outs[name]] == expected["old"], name
        # /metrics on either process counts the requests and tokens of both (multiprocess metrics).
        after = _counts(second)
        assert after == _counts(first)
        n = 2 * len(PROMPTS)
        assert {k: after[k] - before[k] for k in after} == {"requests": n, "first": n, "gaps": n * (N - 1)}


def test_a_weight_update_through_one_process_shows_in_the_other(
    server: ServerProcess, qwen3_dir: str, qwen3_next_dir: str, expected
) -> None:
    with on_process(server, 0) as first, on_process(server, 1) as second:
        try:
            r = second.post("/update_weights_from_disk", json={"model_path": qwen3_next_dir, "weight_version": "step-1"})
            assert r.status_code == 200 and r.json()["weight_version"] == "step-1"
            # Process 0 made no control call: the engine told it the state (StateUpdate).
            outs = _generate(first)
            assert [o["output_ids"] for o in outs] == expected["new"]
            assert {o["meta_info"]["weight_version"] for o in outs} == {"step-1"}
            released = first.post("/release_memory_occupation", json={})
            assert released.status_code == 200
            refused = second.post("/generate", json={"input_ids": PROMPTS[0], "sampling_params": GREEDY})
            assert refused.status_code == 503 and "released" in refused.json()["error"]["message"]
            assert second.post("/resume_memory_occupation", json={}).status_code == 200
            assert [o["output_ids"] for o in _generate(first)] == expected["new"]
        finally:
            assert second.post("/update_weights_from_disk", json={"model_path": qwen3_dir,
                                                                 "weight_version": "default"}).status_code == 200
        assert [o["output_ids"] for o in _generate(second)] == expected["old"]


def test_abort_and_request_ids_across_processes(server: ServerProcess) -> None:
    with on_process(server, 0) as first, on_process(server, 1) as second:
        result: dict[str, httpx.Response] = {}
        body = {"input_ids": PROMPTS[0], "sampling_params": LONG | {"n": 2}, "rid": "shared-rid"}
        runner = threading.Thread(target=lambda: result.__setitem__("r", second.post("/generate", json=body)))
        runner.start()
        deadline = time.monotonic() + 30
        while first.get("/get_server_info").json()["num_running"] < 2:
            assert time.monotonic() < deadline, "the n=2 request never ran"
            time.sleep(0.02)
        # The same id through the other process: refused there, the running one untouched.
        dup = first.post("/generate", json={"input_ids": PROMPTS[1], "sampling_params": GREEDY, "rid": "shared-rid#0"})
        assert dup.status_code == 400 and "already running" in dup.json()["error"]["message"]
        # Aborting the rid through process 0 aborts both samples that process 1 sent.
        abort = first.post("/abort_request", json={"rid": "shared-rid"})
        assert abort.status_code == 200 and abort.json()["num_aborted"] == 2
        runner.join(60)
        outs = result["r"].json()
        assert result["r"].status_code == 200
        assert [o["meta_info"]["finish_reason"]["type"] for o in outs] == ["abort", "abort"]
        assert all(len(o["output_ids"]) < LONG["max_new_tokens"] for o in outs)
        assert first.post("/abort_request", json={"rid": "nothing-here"}).json()["num_aborted"] == 0


def _pids(server: ServerProcess) -> tuple[int, int]:
    with on_process(server, 1) as second:
        info = second.get("/get_server_info").json()
    return info["api_server"]["pid"], info["engine_pid"]


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _wait_gone(pids: list[int], timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not all(_gone(p) for p in pids):
        assert time.monotonic() < deadline, f"still running: {[p for p in pids if not _gone(p)]}"
        time.sleep(0.1)


def test_stopping_the_server_stops_every_process(qwen3_dir: str) -> None:
    server = ServerProcess(qwen3_dir, "--max-model-len", "256", "--api-server-count", "2")
    helper, engine = _pids(server)
    server.stop()
    _wait_gone([helper, engine])


@pytest.mark.parametrize("victim", ["helper", "engine"])
def test_a_dead_process_stops_the_server(qwen3_dir: str, victim: str) -> None:
    """A dead API server process or a dead engine: the server exits non-zero (a supervisor
    restarts it); until then a dead engine means 503 at once on every process."""
    server = ServerProcess(qwen3_dir, "--max-model-len", "256", "--api-server-count", "2")
    try:
        helper, engine = _pids(server)
        with on_process(server, 1) as second:
            os.kill(helper if victim == "helper" else engine, signal.SIGKILL)
            if victim == "engine":
                deadline = time.monotonic() + 5
                while second.get("/health").status_code != 503:
                    assert time.monotonic() < deadline, "/health still 200 after the engine died"
                    time.sleep(0.1)
                r = second.post("/generate", json={"input_ids": PROMPTS[0], "sampling_params": GREEDY})
                assert r.status_code == 503 and "engine" in r.json()["error"]["message"]
        assert server.proc.wait(30) == 1
        _wait_gone([helper, engine])
    finally:
        server.stop()
