"""The SGLang-native HTTP routes, against a real `siesta serve` process on a loopback port."""

from __future__ import annotations

import json
import os
import random
import signal
import time

import httpx
import pytest
from oracle import hf_greedy
from server_util import ServerProcess

from engine import Engine, SamplingParams


def _prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in lengths]


def _sse(lines: list[str]) -> list[dict]:
    """The JSON events of an SSE body; asserts it ends with [DONE]."""
    data = [line[len("data: "):] for line in lines if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def _all_blocks_free(http: httpx.Client) -> bool:
    info = http.get("/get_server_info").json()
    return info["kv_blocks_free"] == info["kv_blocks_total"] and info["num_running"] == 0


def test_generate_matches_engine_and_transformers(demo_server: ServerProcess, demo_dir: str) -> None:
    prompts = _prompts(11, (6, 21, 40))
    expected = hf_greedy(demo_dir, prompts, 24)
    greedy = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    with demo_server.client() as http:
        r = http.post("/generate", json={"input_ids": prompts, "sampling_params": greedy})
        assert r.status_code == 200
        outs = r.json()
        assert [o["output_ids"] for o in outs] == expected
        single = http.post("/generate", json={"input_ids": prompts[0], "sampling_params": greedy}).json()
        assert isinstance(single, dict) and single["output_ids"] == expected[0]
        meta = single["meta_info"]
        assert meta["finish_reason"]["type"] == "length"
        assert meta["prompt_tokens"] == 6 and meta["completion_tokens"] == 24
        assert meta["weight_version"] == "default" and meta["e2e_latency"] > 0
    with Engine(model=demo_dir, device="cpu", dtype="float32") as llm:
        params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
        engine_outs = llm.generate(input_ids=prompts, sampling_params=params)
    assert [o.output_ids for o in engine_outs] == expected
    assert [o["text"] for o in outs] == [o.text for o in engine_outs]


def test_text_stream_logprobs_and_n(demo_server: ServerProcess) -> None:
    body = {"text": "Hello there", "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True},
            "return_logprob": True, "top_logprobs_num": 2}
    with demo_server.client() as http:
        whole = http.post("/generate", json=body).json()
        triples = whole["meta_info"]["output_token_logprobs"]
        assert [t[1] for t in triples] == whole["output_ids"] and all(t[2] is None for t in triples)
        top = whole["meta_info"]["output_top_logprobs"]
        assert [row[0][1] for row in top] == whole["output_ids"]  # greedy: the best token is chosen
        assert all(row[0][0] >= row[1][0] for row in top)
        with http.stream("POST", "/generate", json=body | {"stream": True}) as r:
            events = _sse(list(r.iter_lines()))
        assert 2 <= len(events) <= 12  # one per step while the client keeps up, merged when it lags
        assert events[-1]["text"] == whole["text"] and events[-1]["output_ids"] == whole["output_ids"]
        assert all(events[i]["text"].startswith(events[i - 1]["text"]) for i in range(1, len(events)))
        # n samples with a seed: reproducible, and different from each other.
        sampled = {"text": ["Hi", "Yo"], "sampling_params": {"max_new_tokens": 16, "temperature": 1.0, "seed": 5, "n": 3, "ignore_eos": True}}
        a, b = http.post("/generate", json=sampled).json(), http.post("/generate", json=sampled).json()
        assert len(a) == 6 and [o["output_ids"] for o in a] == [o["output_ids"] for o in b]
        assert len({tuple(o["output_ids"]) for o in a[:3]}) > 1
        assert _all_blocks_free(http)


def test_info_health_and_metrics(demo_server: ServerProcess) -> None:
    with demo_server.client() as http:
        assert http.get("/health").status_code == 200
        assert http.get("/health_generate").status_code == 200
        info = http.get("/get_model_info").json()
        assert info["architecture"] == "Qwen3ForCausalLM" and info["max_context_length"] == 512
        assert info["dtype"] == "float32" and info["weight_version"] == "default"
        assert info["architectures"] == ["Qwen3ForCausalLM"] and http.get("/model_info").json() == info
        server = http.get("/get_server_info").json()
        assert server["kv_blocks_total"] > 0 and server["config"]["block_size"] == 16
        assert server["server_args"]["port"] == demo_server.port
        http.post("/generate", json={"text": "metrics", "sampling_params": {"max_new_tokens": 3}})
        text = http.get("/metrics").text
        for name in ("siesta_requests_total", "siesta_prompt_tokens_total", "siesta_generation_tokens_total",
                     "siesta_time_to_first_token_seconds_bucket", "siesta_inter_token_latency_seconds_bucket",
                     "siesta_num_requests_running", "siesta_num_requests_waiting", "siesta_kv_cache_usage_ratio"):
            assert name in text, name
        done = [line for line in text.splitlines() if line.startswith('siesta_requests_total{outcome="length"}')]
        assert float(done[0].split()[-1]) >= 1


def test_abort_flush_pause_and_continue(demo_server: ServerProcess) -> None:
    long = {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True}
    with demo_server.client() as http, httpx.Client(base_url=demo_server.url, timeout=60) as other:
        with http.stream("POST", "/generate", json={"input_ids": [5, 6, 7], "rid": "long-1", "sampling_params": long, "stream": True}) as r:
            lines = r.iter_lines()
            next(lines)  # the request is running
            flush = other.post("/flush_cache")
            assert flush.status_code == 400 and "running" in flush.json()["error"]["message"]
            assert other.post("/abort_request", json={"rid": "long-1"}).json()["num_aborted"] == 1
            events = _sse(list(lines))
        assert events[-1]["meta_info"]["finish_reason"]["type"] == "abort"
        assert len(events[-1]["output_ids"]) < 400
        assert http.post("/flush_cache").status_code == 200
        # Paused: a new request waits; continue lets it finish.
        assert http.post("/pause_generation", json={"mode": "in_place"}).json()["paused"] is True
        with pytest.raises(httpx.ReadTimeout):
            other.post("/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}, timeout=1.0)
        assert http.post("/continue_generation").json()["paused"] is False
        ok = http.post("/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}})
        assert ok.status_code == 200
        # abort_all while requests run
        with http.stream("POST", "/generate", json={"input_ids": [8, 9], "sampling_params": long, "stream": True}) as r:
            lines = r.iter_lines()
            next(lines)
            assert other.post("/abort_request", json={"abort_all": True}).json()["success"] is True
            assert _sse(list(lines))[-1]["meta_info"]["finish_reason"]["type"] == "abort"
        deadline = time.monotonic() + 10
        while not _all_blocks_free(http) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _all_blocks_free(http)


BAD_BODIES = [
    ("{not json", "JSON"),
    (json.dumps({"text": 5}), "text"),
    (json.dumps({"text": "x", "sampling_params": {"temperatur": 1}}), "temperatur"),
    (json.dumps({"text": "x", "sampling_params": {"temperature": -1}}), "temperature"),
    (json.dumps({"text": "x", "sampling_params": {"top_p": 0}}), "top_p"),
    (json.dumps({"text": "x", "sampling_params": {"top_p": 1.5}}), "top_p"),
    (json.dumps({"text": "x", "sampling_params": {"max_new_tokens": -1}}), "max_new_tokens"),
    (json.dumps({"text": "x", "sampling_params": {"max_new_tokens": 600}}), "context length"),
    (json.dumps({"text": "", "sampling_params": {"max_new_tokens": 2}}), "empty"),
    (json.dumps({"input_ids": [], "sampling_params": {"max_new_tokens": 2}}), "empty"),
    (json.dumps({"input_ids": [1, 99999]}), "vocabulary"),
    (json.dumps({"text": "x", "sampling_params": {"n": 0}}), "n must be"),
    (json.dumps({"text": "x", "sampling_params": {"max_new_tokens": "many"}}), "max_new_tokens"),
    (json.dumps({}), "exactly one"),
]


@pytest.mark.parametrize("body,needle", BAD_BODIES)
def test_bad_input_is_a_400(demo_server: ServerProcess, body: str, needle: str) -> None:
    with demo_server.client() as http:
        r = http.post("/generate", content=body, headers={"Content-Type": "application/json"})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert needle in err["message"] and err["type"] == "invalid_request_error"
        assert "Traceback" not in r.text


def test_bad_input_leaves_other_requests_running(demo_server: ServerProcess) -> None:
    with demo_server.client() as http, httpx.Client(base_url=demo_server.url, timeout=60) as other:
        body = {"input_ids": [4, 4, 4], "sampling_params": {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}}
        expected = http.post("/generate", json=body).json()["output_ids"]
        with http.stream("POST", "/generate", json=body | {"stream": True}) as r:
            lines = r.iter_lines()
            next(lines)
            for bad, _ in BAD_BODIES:
                assert other.post("/generate", content=bad).status_code == 400
            assert _sse(list(lines))[-1]["output_ids"] == expected


def test_api_key(demo_dir: str) -> None:
    server = ServerProcess(demo_dir, api_key="sekret")
    try:
        assert httpx.get(f"{server.url}/health").status_code == 200
        for path in ("/get_model_info", "/get_server_info", "/metrics", "/v1/models"):
            r = httpx.get(f"{server.url}{path}")
            assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
            wrong = httpx.get(f"{server.url}{path}", headers={"Authorization": "Bearer nope"})
            assert wrong.status_code == 401
        assert httpx.post(f"{server.url}/generate", json={"text": "x"}).status_code == 401
        with server.client() as http:
            assert http.get("/get_model_info").status_code == 200
            assert http.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 2}}).status_code == 200
    finally:
        server.stop()


def test_dead_engine_means_503_fast(demo_dir: str) -> None:
    server = ServerProcess(demo_dir)
    try:
        with server.client() as http:
            pid = http.get("/get_server_info").json()["engine_pid"]
            os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 5
            while http.get("/health").status_code != 503:
                assert time.monotonic() < deadline, "/health still 200 after the engine died"
                time.sleep(0.1)
            t0 = time.monotonic()
            r = http.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 2}})
            assert r.status_code == 503 and "engine" in r.json()["error"]["message"]
            assert time.monotonic() - t0 < 2
    finally:
        server.stop()


def test_serve_without_model_serves_the_demo(tmp_path) -> None:
    log = tmp_path / "serve.log"
    server = ServerProcess(None, log_path=str(log), env={"XDG_CACHE_HOME": str(tmp_path / "cache")})
    try:
        info = httpx.get(f"{server.url}/get_model_info").json()
        assert info["model_path"].startswith(str(tmp_path / "cache")) and info["architecture"] == "Qwen3ForCausalLM"
        r = httpx.post(f"{server.url}/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 3}})
        assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] >= 1
    finally:
        server.stop()
    text = log.read_text()
    assert "demo model" in text and "engine ready in" in text


def test_every_engine_knob_is_a_flag() -> None:
    import dataclasses

    from engine.config import EngineConfig
    from server.cli import build_parser, engine_config_from

    args = build_parser().parse_args(["serve", "--model", "m", "--block-size", "32", "--no-enable-prefix-caching",
                                      "--num-kv-blocks", "7", "--mem-fraction", "0.5"])
    config = engine_config_from(args)
    assert config == EngineConfig(model="m", block_size=32, enable_prefix_caching=False, num_kv_blocks=7, mem_fraction=0.5)
    defaults = engine_config_from(build_parser().parse_args(["serve"]))
    assert defaults == EngineConfig()
    assert {f.name for f in dataclasses.fields(EngineConfig)} <= set(vars(args))


def test_input_token_logprobs(demo_server: ServerProcess, demo_dir: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    prompt = _prompts(21, (40,))[0]
    ref = AutoModelForCausalLM.from_pretrained(demo_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logp = torch.log_softmax(ref(torch.tensor([prompt])).logits[0], -1)
    want = [None] + [logp[i - 1, prompt[i]].item() for i in range(1, len(prompt))]
    top_values, top_ids = logp.topk(3, dim=-1)  # position i's alternatives score token i + 1
    want_top = [None] + [list(zip(top_ids[i - 1].tolist(), top_values[i - 1].tolist(), strict=True)) for i in range(1, len(prompt))]
    with demo_server.client() as http:
        for start, top_n in ((0, 0), (3, 3), (37, 0), (0, 2)):
            for _ in range(2):  # the second time the prompt's blocks are in the prefix cache
                body = {"input_ids": prompt, "return_logprob": True, "logprob_start_len": start, "top_logprobs_num": top_n,
                        "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
                meta = http.post("/generate", json=body).json()["meta_info"]
                got = meta["input_token_logprobs"]
                assert [t for _, t, _ in got] == prompt[start:]
                for (lp, _, _), w in zip(got, want[start:], strict=True):
                    assert (lp is None) == (w is None) and (w is None or abs(lp - w) < 1e-4)
                if not top_n:
                    assert "input_top_logprobs" not in meta
                    continue
                # SGLang's input_top_logprobs: per position [logprob, token id, text] best first, None at token 0.
                assert len(meta["input_top_logprobs"]) == len(prompt) - start and len(meta["output_top_logprobs"]) == 2
                for row, w in zip(meta["input_top_logprobs"], want_top[start:], strict=True):
                    assert (row is None) == (w is None)
                    if w is not None:
                        assert [t for _, t, _ in row] == [t for t, _ in w[:top_n]]
                        assert [lp for lp, _, _ in row] == pytest.approx([v for _, v in w[:top_n]], abs=1e-4)
        plain = http.post("/generate", json={"input_ids": prompt, "return_logprob": True}).json()
        assert "input_token_logprobs" not in plain["meta_info"] and "input_top_logprobs" not in plain["meta_info"]


def test_n_samples_share_the_prompt_blocks(demo_server: ServerProcess) -> None:
    prompt = _prompts(33, (40,))[0]
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 6, "temperature": 0, "n": 4}}
    with demo_server.client() as http:
        http.post("/flush_cache")
        outs = http.post("/generate", json=body).json()
        assert [o["meta_info"]["cached_tokens"] for o in outs] == [0, 32, 32, 32]  # 2 full blocks of 16
        assert len({tuple(o["output_ids"]) for o in outs}) == 1  # greedy: the same output each time
        assert _all_blocks_free(http)


def _without_timing(result: dict) -> dict:
    """A result less what differs between two runs of the same request (latency, prefix cache)."""
    meta = {k: v for k, v in result["meta_info"].items() if k not in ("e2e_latency", "cached_tokens", "id")}
    return result | {"meta_info": meta}


def test_stream_ends_with_the_whole_result(demo_server: ServerProcess) -> None:
    """A stream's last event per job is the non-streamed result, field for field (same seed):
    sampled, n > 1, a stop string, logprobs, a stream interval; the text only ever grows."""
    prompt = _prompts(41, (12,))[0]
    cases = [
        {"sampling_params": {"max_new_tokens": 40, "temperature": 1.0, "seed": 7, "n": 3, "ignore_eos": True}},
        {"sampling_params": {"max_new_tokens": 40, "temperature": 1.0, "seed": 3, "ignore_eos": True,
                             "stream_interval": 3}, "return_logprob": True, "top_logprobs_num": 2},
    ]
    sampled = {"max_new_tokens": 60, "temperature": 1.0, "seed": 1, "ignore_eos": True}
    with demo_server.client() as http:
        text = http.post("/generate", json={"input_ids": prompt, "sampling_params": sampled}).json()["text"]
        stop = next(text[i : i + 2] for i in range(len(text) // 3, len(text) - 1)
                    if text[i : i + 2].isprintable() and text[i : i + 2].strip() and "\ufffd" not in text[i : i + 2])
        cases.append({"sampling_params": sampled | {"stop": ["\x00never", stop]}})
        for case in cases:
            body = {"input_ids": prompt} | case
            whole = http.post("/generate", json=body).json()
            whole = whole if isinstance(whole, list) else [whole]
            with http.stream("POST", "/generate", json=body | {"stream": True}) as r:
                events = _sse(list(r.iter_lines()))
            last: dict[int, dict] = {}
            for e in events:
                i = e.pop("index", 0)
                if i in last:
                    assert e["text"].startswith(last[i]["text"]) and e["output_ids"][: len(last[i]["output_ids"])] == last[i]["output_ids"]
                last[i] = e
            assert sorted(last) == list(range(len(whole)))
            for i, w in enumerate(whole):
                assert _without_timing(last[i]) == _without_timing(w), case
            if "stop" in case["sampling_params"]:
                assert whole[0]["meta_info"]["finish_reason"]["type"] == "stop"
            interval = case["sampling_params"].get("stream_interval", 1)
            if interval > 1:
                counts = [e["meta_info"]["completion_tokens"] for e in events]
                assert all(b - a >= interval for a, b in zip(counts, counts[1:-1], strict=False)), counts


def test_engine_death_mid_stream_is_an_error_event(demo_dir: str) -> None:
    server = ServerProcess(demo_dir)
    try:
        with server.client() as http:
            pid = http.get("/get_server_info").json()["engine_pid"]
            body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}, "stream": True}
            with http.stream("POST", "/generate", json=body) as r:
                lines = r.iter_lines()
                next(lines)  # running
                os.kill(pid, signal.SIGKILL)
                t0 = time.monotonic()
                data = [line[len("data: "):] for line in lines if line.startswith("data: ")]
            assert time.monotonic() - t0 < 5
            assert data[-1] == "[DONE]" and "engine" in json.loads(data[-2])["error"]["message"]
    finally:
        server.stop()


def test_stream_events_are_the_json_of_the_result() -> None:
    """/generate's incremental event writer gives, byte for byte, `data: ` + the JSON of the whole
    result so far (what the events were before it kept their JSON as it grows)."""
    from engine.client.output import GenerationOutput
    from engine.request import SamplingParams
    from server.generation import Job
    from server.native_api import _JSON, _EventWriter, _result

    rng = random.Random(3)
    pieces = ["", "a", ' "q" ', "\\", "\n\t\x01", "é中😀", "\u2028", "</script>", "\ufffd"]
    for indexed in (False, True):
        job = Job(index=3, request_id='r"1', prompt_token_ids=[1, 2, 3], params=SamplingParams())
        writer, out = _EventWriter(job, "v\\1", indexed), GenerationOutput(request_id='r"1', prompt_token_ids=[1, 2, 3])
        for step in range(60):
            out.text += rng.choice(pieces)
            out.output_ids += [rng.randrange(200000) for _ in range(rng.choice([0, 1, 1, 2]))]
            out.cached_tokens = step // 10
            writer.add(out)
            if rng.random() < 0.7:
                want = _result(out, "v\\1") | ({"index": 3} if indexed else {})
                assert writer.event(out) == b"data: " + _JSON.encode(want) + b"\n\n"


def test_an_idle_connection_outlives_the_clients_keep_alive(demo_server: ServerProcess) -> None:
    """The server keeps an idle HTTP/1.1 connection open past httpx's 5 s keep-alive (and
    uvicorn's default), so a client's pooled connection is never closed under its next request."""
    import http.client
    import socket

    from server.server_config import KEEP_ALIVE_S

    host, port = demo_server.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("GET", "/health")
        first = conn.getresponse()
        assert first.status == 200 and first.read()
        sock = conn.sock
        time.sleep(6)  # past 5 s: uvicorn's default would have closed it by now
        sock.setblocking(False)
        try:
            closed = sock.recv(1, socket.MSG_PEEK) == b""
        except BlockingIOError:
            closed = False  # open, nothing to read
        sock.setblocking(True)
        assert not closed, f"the server closed an idle connection before {KEEP_ALIVE_S} s"
        conn.request("GET", "/health")
        second = conn.getresponse()
        assert second.status == 200 and second.read() and conn.sock is sock  # the same connection
    finally:
        conn.close()
