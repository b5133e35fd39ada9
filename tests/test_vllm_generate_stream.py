"""vLLM's `/inference/v1/generate` streamed (server/vllm_generate_reply.py `TokenChunks`) against a
real server on the CPU: the chunks carry what the whole answer carries, and a client that goes
away mid-stream frees its request.

Payloads: SkyRL's rollout body (skyrl/backends/skyrl_train/inference_servers/
remote_inference_client.py, RemoteInferenceClient._generate_single: {sampling_params, model,
token_ids}) with vLLM's `stream` and `stream_options` (vllm/entrypoints/serve/disagg/protocol.py
GenerateRequest); the chunks are vLLM's GenerateStreamResponse as
vllm/entrypoints/serve/disagg/serving.py ServingTokens.serve_tokens_stream_generator writes them.
"""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest
from server_util import ServerProcess

PROMPT = [5, 9, 13, 200, 7, 31, 64]
ROUTE = "/inference/v1/generate"


@pytest.fixture(scope="module")
def http(qwen3_dir: str):
    server = ServerProcess(qwen3_dir, "--max-model-len", "512", "--served-model-name", "siesta-test")
    try:
        with httpx.Client(base_url=server.url, timeout=300.0) as client:
            yield client
    finally:
        server.stop()


def _body(**sampling: Any) -> dict[str, Any]:
    return {"sampling_params": {"temperature": 0.0, "max_tokens": 24, "ignore_eos": True} | sampling,
            "model": "siesta-test", "token_ids": PROMPT}


def _stream(http: httpx.Client, body: dict[str, Any]) -> list[dict]:
    """Every chunk of a streamed answer, checking that `data: [DONE]` ends it."""
    chunks, done = [], False
    with http.stream("POST", ROUTE, json=body | {"stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                assert not done, "an event after [DONE]"
                done = line == "data: [DONE]"
                if not done:
                    chunks.append(json.loads(line[len("data: "):]))
    assert done
    return chunks


def _joined(chunks: list[dict], index: int = 0) -> dict[str, Any]:
    """One choice's chunks as vLLM's whole choice: ids and logprobs concatenated, the last reason."""
    mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == index]
    assert all(c["finish_reason"] is None for c in mine[:-1]) and mine[-1]["finish_reason"] is not None
    content = [e for c in mine for e in (c["logprobs"] or {"content": []})["content"]]
    return {"token_ids": [t for c in mine for t in c["token_ids"]], "finish_reason": mine[-1]["finish_reason"],
            "logprobs": {"content": content} if mine[0]["logprobs"] is not None else None}


def _same_logprobs(a: dict | None, b: dict | None) -> bool:
    if a is None or b is None:
        return a is b
    pairs = list(zip(a["content"], b["content"], strict=True))
    return all(x["token"] == y["token"] and abs(x["logprob"] - y["logprob"]) < 1e-4 and len(x["top_logprobs"]) == len(y["top_logprobs"])
               and all(p["token"] == q["token"] for p, q in zip(x["top_logprobs"], y["top_logprobs"], strict=True)) for x, y in pairs)  # fmt: skip


def test_streamed_ids_and_logprobs_are_the_whole_answer(http: httpx.Client) -> None:
    body = _body(logprobs=2)
    whole = http.post(ROUTE, json=body).json()
    chunks = _stream(http, body | {"stream_options": {"include_usage": True}})
    assert len({c["request_id"] for c in chunks}) == 1 and all(set(c) == {"request_id", "choices", "usage"} for c in chunks)
    joined, want = _joined(chunks[:-1]), whole["choices"][0]
    assert joined["token_ids"] == want["token_ids"] and len(want["token_ids"]) == 24
    assert joined["finish_reason"] == want["finish_reason"] == "length"
    assert _same_logprobs(joined["logprobs"], want["logprobs"])
    assert set(chunks[0]["choices"][0]) == {"index", "logprobs", "finish_reason", "token_ids", "routed_experts"}
    # include_usage: a last chunk with no choice and the request's usage; the others carry none.
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
    assert all(c["usage"] is None for c in chunks[:-1])


def test_stop_token_sampled_choices_and_continuous_usage(http: httpx.Client) -> None:
    want = http.post(ROUTE, json=_body()).json()["choices"][0]["token_ids"]
    stop = _body(stop_token_ids=[want[5]], ignore_eos=False)
    whole = http.post(ROUTE, json=stop).json()["choices"][0]
    joined = _joined(_stream(http, stop))
    assert joined["token_ids"] == whole["token_ids"] == want[:6] and joined["finish_reason"] == whole["finish_reason"] == "stop"
    assert joined["logprobs"] is None
    # n = 2, sampled: each index streams its own ids; continuous usage counts each job's tokens so far.
    sampled = _body(n=2, temperature=1.0, seed=3, max_tokens=16)
    chunks = _stream(http, sampled | {"stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    for i in (0, 1):
        mine = [c for c in chunks if c["choices"] and c["choices"][0]["index"] == i]
        counts = [c["usage"]["completion_tokens"] for c in mine]
        assert counts == sorted(counts) and counts[-1] == 16 == len(_joined(chunks, i)["token_ids"])
    assert chunks[-1]["usage"]["completion_tokens"] == 32


def test_a_client_gone_mid_stream_frees_its_request(http: httpx.Client) -> None:
    body = _body(max_tokens=480) | {"stream": True}
    with http.stream("POST", ROUTE, json=body) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[len("data: "):])["choices"][0]["finish_reason"] is None
        assert http.get("/get_server_info").json()["num_running"] == 1
    deadline = time.monotonic() + 60
    while (info := http.get("/get_server_info").json())["num_running"] or info["num_waiting"]:
        assert time.monotonic() < deadline, f"the request still runs after its client left: {info}"
        time.sleep(0.05)
    assert 'siesta_requests_total{outcome="disconnected"} 1.0' in http.get("/metrics").text  # ended by the abort
    after = http.post(ROUTE, json=_body(max_tokens=4)).json()["choices"][0]
    assert len(after["token_ids"]) == 4  # the engine serves on


def test_bad_streams_are_4xx_before_any_event(http: httpx.Client) -> None:
    for body, status, says in (
        (_body(structured_outputs={"regex": "a", "json": {}}), 400, "structured_outputs"),
        (_body() | {"stream_options": {"include_usage": "often"}}, 400, "include_usage"),
        (_body() | {"model": "nope"}, 404, "nope"),
        ({"token_ids": [5, 512], "sampling_params": {}}, 400, "512"),
    ):
        r = http.post(ROUTE, json=body | {"stream": True})
        assert r.status_code == status and says in r.json()["error"]["message"], (body, r.text)
