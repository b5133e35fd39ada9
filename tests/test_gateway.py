"""Two real Siesta servers behind the real SGLang Model Gateway (tests/gateway_util.py), as RL
frameworks deploy replicas: what the gateway learns of them, and the traffic it routes.

- the gateway registers both as SGLang workers (engine `sglang`, model, capacity, limits) and
  parses their `/v1/loads`;
- `/generate` through it reaches both replicas, one prompt family stays on one replica
  (cache-aware routing), and the prefix cache hits as often as on one replica alone;
- streamed `/generate` and the OpenAI routes (the official client) pass through unchanged;
- `X-SMG-Routing-Key` pins a session to one replica (`--sticky-sessions`).

The RL control plane through the gateway is tests/test_gateway_rl.py; a killed replica,
tests/test_gateway_failover.py.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest
from gateway_util import Gateway, replicas, requests_served
from server_util import ServerProcess

pytest.importorskip("smg")

# A request with a routing key goes where its key's first request went (placed cache-aware).
STICKY = ("--sticky-sessions",)
WORDS = ["apple", "zebra", "quantum", "mango", "violet", "kettle", "orbit", "nectar", "bishop", "delta"]


@pytest.fixture(scope="module")
def pair(demo_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gateway, list[ServerProcess]]]:
    with replicas(demo_dir, str(tmp_path_factory.mktemp("gateway")), 2, *STICKY) as both:
        yield both


def test_the_gateway_registers_siesta_as_an_sglang_worker(pair) -> None:
    gateway, servers = pair
    workers = gateway.workers()
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


def test_generate_reaches_both_replicas_and_a_prompt_family_stays_on_one(pair) -> None:
    gateway, servers = pair
    before = [requests_served(s) for s in servers]
    routed = {}
    for word in WORDS:
        r = gateway.generate(f"{word} is where this prompt starts")
        assert r.status_code == 200, r.text
        assert r.json()["meta_info"]["completion_tokens"] == 4
        routed[word] = r.headers["x-smg-routed-worker-id"]
    served = [requests_served(s) - b for s, b in zip(servers, before, strict=True)]
    assert sum(served) == len(WORDS) and min(served) > 0, served  # both replicas did work
    assert sorted(set(routed.values())) == sorted(s.url for s in servers)
    family = {gateway.generate(f"zebra is where this prompt starts, then goes on {i}").headers["x-smg-routed-worker-id"] for i in range(5)}
    assert family == {routed["zebra"]}  # the family's prefix lives in that replica's cache


def test_the_prefix_cache_hits_as_often_as_on_one_replica_alone(pair) -> None:
    """Prompt families (a long shared prefix, a short own suffix) sent interleaved: cache-aware
    routing keeps each family where its prefix is cached, so the hit rate over both replicas
    equals that of one replica serving everything."""
    import random
    import string

    gateway, servers = pair
    families = [random.Random(f).choices(string.ascii_lowercase + "    ", k=200) for f in range(4)]
    prompts = [f"{''.join(prefix)} question {j}: {j * 7919}" for j in range(4) for prefix in families]

    def hit_rate(post) -> float:
        metas = [post("/generate", json={"text": p, "sampling_params": {"max_new_tokens": 2}}).json()["meta_info"] for p in prompts]
        return sum(m["cached_tokens"] for m in metas) / sum(m["prompt_tokens"] for m in metas)

    assert gateway.fanout("flush_cache", {})["succeeded"] == 2
    through_gateway = hit_rate(gateway.http.post)
    with servers[0].client() as http:
        assert http.post("/flush_cache").json()["success"]
        alone = hit_rate(http.post)
    print(f"prefix-cache hit rate: {through_gateway:.3f} through the gateway, {alone:.3f} on one replica alone")
    assert alone > 0.5  # 3 of every family's 4 prompts find its prefix
    assert through_gateway >= 0.98 * alone


def test_streamed_generate_passes_through_the_gateway(pair) -> None:
    gateway, servers = pair
    body = {"text": "a streamed prompt", "stream": True,
            "sampling_params": {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}}
    with gateway.http.stream("POST", "/generate", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        worker = r.headers["x-smg-routed-worker-id"]
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    ids = [e["output_ids"] for e in events]
    assert len(events) > 1 and all(b[: len(a)] == a for a, b in zip(ids, ids[1:], strict=False))  # cumulative
    last = events[-1]
    assert last["meta_info"]["finish_reason"]["type"] == "length" and len(last["output_ids"]) == 12
    with next(s for s in servers if s.url == worker).client() as http:
        plain = http.post("/generate", json=body | {"stream": False}).json()
    assert (plain["output_ids"], plain["text"]) == (last["output_ids"], last["text"])


def test_openai_routes_pass_through_the_gateway(pair) -> None:
    """The official client against the gateway gets what it gets from a replica directly."""
    import openai

    gateway, servers = pair
    model = gateway.http.get("/v1/models").json()["data"][0]["id"]
    with servers[0].client() as http:
        assert model == http.get("/v1/models").json()["data"][0]["id"]
    via, direct = (openai.OpenAI(base_url=f"{url}/v1", api_key="unused") for url in (gateway.url, servers[0].url))
    chat = {"model": model, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 6, "temperature": 0}
    got, want = (c.chat.completions.create(**chat) for c in (via, direct))
    assert got.choices[0].message.content == want.choices[0].message.content
    assert got.usage.completion_tokens == want.usage.completion_tokens > 0
    streamed = "".join(c.choices[0].delta.content or "" for c in via.chat.completions.create(**chat, stream=True) if c.choices)
    assert streamed == want.choices[0].message.content
    completion = {"model": model, "prompt": "once upon a time", "max_tokens": 5, "temperature": 0}
    assert via.completions.create(**completion).choices[0].text == direct.completions.create(**completion).choices[0].text
    with pytest.raises(openai.NotFoundError):  # the gateway routes by model: an unknown one has no worker
        via.completions.create(**completion | {"model": "no-such-model"})


def test_a_routing_key_pins_a_session_to_one_replica(pair) -> None:
    """`X-SMG-Routing-Key` under --sticky-sessions: every request with a key lands on the replica
    its first one did, even a prompt whose family cache-aware routing keeps on the other one."""
    gateway, servers = pair
    home = {w: gateway.generate(f"{w} is where this prompt starts").headers["x-smg-routed-worker-id"] for w in WORDS}
    assert set(home.values()) == {s.url for s in servers}  # families live on both replicas
    for key in ("agent-0", "agent-1"):
        placed = [gateway.generate(f"{w} is where this prompt starts", headers={"X-SMG-Routing-Key": key})
                  for w in WORDS]
        assert all(r.status_code == 200 for r in placed)
        assert len({r.headers["x-smg-routed-worker-id"] for r in placed}) == 1, [r.headers["x-smg-routed-worker-id"] for r in placed]
