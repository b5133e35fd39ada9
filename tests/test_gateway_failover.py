"""A replica killed while requests run through the real SGLang Model Gateway, then started again
on its old URL (the gateway knows workers by URL; it keeps probing a dead one, as it does for
`--worker-urls`).

- streams still running on the killed replica end with an error event and `[DONE]`; those on the
  other replica finish as asked;
- non-streamed requests caught by the kill are retried on the other replica (smg retries a
  transport error) and answer in full;
- the gateway marks the dead replica not ready and routes everything to the other one;
- once the replica is back and healthy, the gateway routes to it again.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from gateway_util import replicas
from server_util import BackgroundStream, ServerProcess

pytest.importorskip("smg")

# One failed probe marks a worker not ready, one good probe ready again (probes every second).
FAST_HEALTH = ("--health-failure-threshold", "1", "--health-success-threshold", "1")
LONG = {"max_new_tokens": 440, "temperature": 0.0, "ignore_eos": True}


def _worker(stream: BackgroundStream) -> str:
    """The replica the gateway routed the stream to."""
    return stream.headers["x-smg-routed-worker-id"]


def _early(stream: BackgroundStream) -> bool:
    """Streaming still, with more than half its tokens to come (a kill now cuts it)."""
    if stream.done or not stream.events:
        return False
    return len(stream.events[-1].get("output_ids", [])) < LONG["max_new_tokens"] // 2


def test_a_killed_replica_fails_its_streams_and_the_gateway_routes_around_it(
    demo_dir: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    logs = str(tmp_path_factory.mktemp("gateway-failover"))
    with replicas(demo_dir, logs, 2, *FAST_HEALTH) as (gateway, servers):
        urls = [s.url for s in servers]
        streams: list[BackgroundStream] = []
        for i in range(24):  # until both replicas run at least two streams, one of them early in its tokens
            streams.append(BackgroundStream(gateway.url, {"text": f"stream {i} starts with {i * 7} and goes on",
                                                          "sampling_params": LONG}))
            assert streams[-1].started()
            mine = [[s for s in streams if _worker(s) == u] for u in urls]
            if all(len(m) >= 2 and any(_early(s) for s in m) for m in mine):
                break
        else:
            pytest.fail("the gateway never had a stream running on each replica")
        victim, survivor = servers
        plain: list[httpx.Response | Exception] = []

        def post(i: int) -> None:
            try:
                plain.append(httpx.post(f"{gateway.url}/generate", timeout=600, json={
                    "text": f"plain request {i}", "sampling_params": LONG | {"max_new_tokens": 200}}))
            except Exception as e:
                plain.append(e)

        posters = [threading.Thread(target=post, args=(i,)) for i in range(4)]
        for t in posters:
            t.start()
        victim.proc.kill()  # SIGKILL: no graceful shutdown; its engine exits with it

        broken = 0
        for s in streams:
            events = s.wait()
            assert s.done  # the gateway ends a broken stream with [DONE] too
            if _worker(s) == victim.url and "error" in events[-1]:
                assert "finish_reason" not in json.dumps(events[-1]), events[-1]
                assert all(e.get("meta_info", {}).get("finish_reason") is None for e in events[:-1])
                broken += 1
            elif _worker(s) == victim.url:  # it had finished before the kill (a slow machine starts the next ones late)
                assert events[-1]["meta_info"]["finish_reason"]["type"] == "length", events[-1]
                assert len(events[-1]["output_ids"]) == LONG["max_new_tokens"]
            else:
                assert _worker(s) == survivor.url
                assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"
                assert len(events[-1]["output_ids"]) == LONG["max_new_tokens"]
        assert {_worker(s) for s in streams} == {victim.url, survivor.url}
        assert broken >= 1, "no stream on the killed replica was cut by the kill"
        for t in posters:  # the streams above have ended: these run beside nothing but each other
            t.join(600)
        assert len(plain) == 4, f"{4 - len(plain)} of 4 non-streamed requests unanswered after 600 s: {plain}"
        print("non-streamed requests caught by the kill:", [getattr(r, "status_code", r) for r in plain])
        for r in plain:  # a transport error: smg retries the request on the survivor
            assert isinstance(r, httpx.Response) and r.status_code == 200, r
            assert r.json()["meta_info"]["completion_tokens"] == 200

        gateway.wait_health({victim.url: ("not_ready", "failed"), survivor.url: "ready"}, timeout_s=15)
        for i in range(6):
            r = gateway.generate(f"while one replica is down {i}")
            assert r.status_code == 200 and r.headers["x-smg-routed-worker-id"] == survivor.url

        servers[0] = ServerProcess(demo_dir, "--max-model-len", "512", port=victim.port, log_path=f"{logs}/siesta0-again.log")
        gateway.wait_health({victim.url: "ready", survivor.url: "ready"}, timeout_s=30)
        routed = set()
        for i in range(20):
            r = gateway.generate(f"{i} the replica is back {time.monotonic()}")
            assert r.status_code == 200
            routed.add(r.headers["x-smg-routed-worker-id"])
            if victim.url in routed:
                break
        assert victim.url in routed
