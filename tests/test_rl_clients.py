"""slime's and verl's HTTP calls, replayed with their exact payloads against a real server on CPU.

Payloads and call orders are copied from the clients' code (cited per payload: slime @624b824,
verl @1dda039; ../shared/RL_CLIENTS.md surveys them). Weight syncs are checked against
transformers on the new checkpoint. One server serves the whole module; each test leaves it
resident, unpaused, with the old weights.
"""

from __future__ import annotations

import base64
import gzip
import json
import os
import threading
import time
from typing import Any

import httpx
import pytest
import torch
from oracle import hf_greedy, hf_named_parameters
from server_util import ServerProcess
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.weights.payload import LocalSerializedTensor, flatten_bucket, serialize_payload

PROMPT = [5, 9, 13, 200, 7, 31, 64]
N = 12
GREEDY = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": N, "temperature": 0, "ignore_eos": True}}


@pytest.fixture(scope="module")
def server(qwen3_dir: str, tmp_path_factory: pytest.TempPathFactory):
    log = str(tmp_path_factory.mktemp("logs") / "rl_clients_server.log")
    proc = ServerProcess(qwen3_dir, "--max-model-len", "512", log_path=log)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def expected(qwen3_dir: str, qwen3_next_dir: str) -> dict[str, list[int]]:
    return {"old": hf_greedy(qwen3_dir, [PROMPT], N)[0], "new": hf_greedy(qwen3_next_dir, [PROMPT], N)[0]}


@pytest.fixture
def http(server: ServerProcess, qwen3_dir: str):
    """A client; afterwards the server is back on the old weights, resident and unpaused."""
    with server.client() as client:
        yield client
        client.post("/continue_generation", json={})
        client.post("/resume_memory_occupation", json={"tags": None})
        assert client.post("/update_weights_from_disk", json={"model_path": qwen3_dir}).status_code == 200


def slime_payload(max_new_tokens: int = 32, **extra: Any) -> dict[str, Any]:
    """slime/rollout/sglang_rollout.py::GenerateState.__init__ (sampling_params, default
    arguments of slime/utils/arguments.py) and ::generate (the payload; `input_ids`, no rid)."""
    sampling_params = dict(
        temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=max_new_tokens, stop=None, stop_token_ids=None,
        skip_special_tokens=False, no_stop_trim=True, spaces_between_special_tokens=False,
    )
    return {"sampling_params": sampling_params | extra, "return_logprob": True, "input_ids": PROMPT}


def _check_slime_output(out: dict[str, Any]) -> None:
    """What slime reads (sglang_rollout.py::generate, utils/types.py::Sample.append_response_tokens)."""
    meta = out["meta_info"]
    assert isinstance(out["text"], str)
    triples = meta["output_token_logprobs"]
    assert len(triples) == len(out["output_ids"]) == meta["completion_tokens"]
    assert all(isinstance(lp, float) and isinstance(t, int) and x is None for lp, t, x in triples)
    assert [t for _, t, _ in triples] == out["output_ids"]
    assert isinstance(meta["finish_reason"], dict) and meta["finish_reason"]["type"] in ("stop", "length", "abort")
    assert isinstance(meta["weight_version"], str)


def test_slime_rollout_payloads(http: httpx.Client) -> None:
    r = http.post("/generate", json=slime_payload())
    assert r.status_code == 200, r.text
    _check_slime_output(r.json())
    # rollout_top_p != 1: custom_params (slime's sglang-top_p.patch; accepted, no effect here).
    r = http.post("/generate", json=slime_payload(top_p=0.9, custom_params={"return_top_p_token_ids": True}))
    assert r.status_code == 200, r.text
    # Deterministic mode (generate_and_rm_group): sampling_seed = rollout_seed + idx.
    a, b, c = (http.post("/generate", json=slime_payload(sampling_seed=s)).json() for s in (42, 42, 43))
    assert a["output_ids"] == b["output_ids"] != c["output_ids"]
    assert http.post("/generate", json=slime_payload(sampling_seed=42, seed=42)).json()["output_ids"] == a["output_ids"]
    clash = http.post("/generate", json=slime_payload(sampling_seed=42, seed=7))
    assert clash.status_code == 400 and "sampling_seed" in clash.json()["error"]["message"]
    # SGLang's other fields: null is their default; stop_regex is refused, a malformed structural
    # tag is a 400 naming what it lacks (constrained decoding: tests/test_grammar.py,
    # tests/test_structural_tags.py); unknown fields stay a 400.
    assert http.post("/generate", json=slime_payload(regex=None, json_schema=None, logit_bias=None)).status_code == 200
    refused = http.post("/generate", json=slime_payload(stop_regex="x"))
    assert refused.status_code == 400 and "not supported" in refused.json()["error"]["message"]
    malformed = http.post("/generate", json=slime_payload(structural_tag="{}"))
    assert malformed.status_code == 400 and "structures" in malformed.json()["error"]["message"]
    assert http.post("/generate", json=slime_payload(bogus=1)).status_code == 400
    # logit_bias is applied: a large bias on one token makes greedy pick it every time.
    biased = http.post("/generate", json=GREEDY | {"sampling_params": GREEDY["sampling_params"] | {"logit_bias": {"77": 100.0}}})
    assert biased.json()["output_ids"] == [77] * N


def test_slime_stop_trim(http: httpx.Client, qwen3_dir: str) -> None:
    """no_stop_trim keeps what ended the request in the text; SGLang's default cuts it."""
    tok = AutoTokenizer.from_pretrained(qwen3_dir)
    sp = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True, "skip_special_tokens": False}
    full = http.post("/generate", json={"input_ids": PROMPT, "sampling_params": sp}).json()
    stop = full["text"][len(full["text"]) // 2:][:2]
    assert stop and "\ufffd" not in stop
    cut = full["text"].find(stop)
    trimmed = http.post("/generate", json={"input_ids": PROMPT, "sampling_params": sp | {"stop": [stop]}}).json()
    kept = http.post("/generate", json={"input_ids": PROMPT, "sampling_params": sp | {"stop": [stop], "no_stop_trim": True}}).json()
    assert trimmed["text"] == full["text"][:cut] and trimmed["meta_info"]["finish_reason"]["matched"] == stop
    assert kept["text"].startswith(full["text"][: cut + len(stop)]) and kept["output_ids"] == trimmed["output_ids"]
    stop_id = full["output_ids"][5]
    ids = full["output_ids"][: full["output_ids"].index(stop_id) + 1]
    by_id = {"input_ids": PROMPT, "sampling_params": sp | {"stop_token_ids": [stop_id], "ignore_eos": False}}
    trimmed = http.post("/generate", json=by_id).json()
    kept = http.post("/generate", json=by_id | {"sampling_params": by_id["sampling_params"] | {"no_stop_trim": True}}).json()
    assert trimmed["output_ids"] == kept["output_ids"] == ids
    assert trimmed["text"] == tok.decode(ids[:-1], skip_special_tokens=False)
    assert kept["text"] == tok.decode(ids, skip_special_tokens=False)


def _sse_events(http: httpx.Client, body: dict[str, Any]) -> list[dict[str, Any]]:
    """slime/rollout/sglang_streaming_rollout.py::generate_streaming: `data:` lines, [DONE] and
    non-JSON lines skipped, every chunk cumulative."""
    events = []
    with http.stream("POST", "/generate", json=body | {"stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                events.append(json.loads(line[5:]))
    return events


def test_slime_streaming_is_cumulative(http: httpx.Client) -> None:
    events = _sse_events(http, slime_payload(64, sampling_seed=1))
    final = events[-1]
    # One event per step while the client keeps up; updates merge when it lags (never more).
    assert 2 <= len(events) <= len(final["output_ids"]) == 64
    _check_slime_output(final)
    texts = [e["text"] for e in events]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False))
    assert any(texts[:-1]), "the text must grow while the request runs"
    for e in events:
        assert len(e["meta_info"]["output_token_logprobs"]) == len(e["output_ids"])
        assert final["output_ids"][: len(e["output_ids"])] == e["output_ids"]
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-1]) and final["meta_info"]["finish_reason"]
    # stream_interval: an event once that many more tokens are in (and the last).
    sparse = _sse_events(http, slime_payload(16, stream_interval=4, sampling_seed=1))
    counts = [len(e["output_ids"]) for e in sparse]
    assert 1 <= len(sparse) <= 4 and counts[-1] == 16
    assert all(b - a >= 4 for a, b in zip([0, *counts[:-2]], counts[:-1], strict=True)), counts


def test_opd_teacher_prefill_only(http: httpx.Client, qwen3_dir: str) -> None:
    """slime/rollout/on_policy_distillation.py::reward_func: max_new_tokens 0, reads
    meta_info.input_token_logprobs[1:] (item[0])."""
    tokens = PROMPT + [11, 12, 13]
    body = {"input_ids": tokens, "sampling_params": {"temperature": 1.0, "max_new_tokens": 0, "skip_special_tokens": False},
            "return_logprob": True, "logprob_start_len": 0}
    out = http.post("/generate", json=body).json()
    meta = out["meta_info"]
    assert out["output_ids"] == [] and meta["finish_reason"]["type"] == "length" and meta["completion_tokens"] == 0
    got = meta["input_token_logprobs"]
    assert got[0][0] is None and [t for _, t, _ in got] == tokens
    model = AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0, :-1]
    want = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]
    assert torch.allclose(torch.tensor([lp for lp, _, _ in got[1:]]), want, atol=1e-4)


def num_requests_from_load(load: Any) -> int:
    """slime/backends/sglang_utils/server_control.py::num_requests_from_load, as written there."""
    if isinstance(load, list):
        return sum(num_requests_from_load(x) for x in load)
    if "loads" in load:
        return num_requests_from_load(load["loads"])
    for key in ("num_reqs", "num_total_reqs", "total_reqs"):
        if isinstance(load.get(key), int):
            return load[key]
    running = load.get("num_running_reqs", load.get("total_running_reqs"))
    waiting = load.get("num_waiting_reqs", load.get("total_waiting_reqs"))
    return (running if isinstance(running, int) else 0) + (waiting if isinstance(waiting, int) else 0)


def test_slime_abort_until_idle(http: httpx.Client, server: ServerProcess) -> None:
    """sglang_rollout.py::abort -> server_control.py::abort_servers_until_idle: abort_all, then
    GET /v1/loads?include=core until no request is left. The aborted /generate answers 200."""
    answers: list[httpx.Response] = []
    long = slime_payload(400, min_new_tokens=400)  # the eval variant's min_new_tokens: no early EOS
    worker = threading.Thread(target=lambda: answers.append(httpx.post(f"{server.url}/generate", json=long, timeout=120)))
    worker.start()
    deadline = time.monotonic() + 30
    while num_requests_from_load(http.get("/v1/loads", params={"include": "core"}).json()) == 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert http.post("/abort_request", json={"abort_all": True}).status_code == 200
    while True:
        load = http.get("/v1/loads", params={"include": "core"})
        assert load.status_code == 200 and set(load.json()) == {"timestamp", "version", "loads"}
        assert set(load.json()["loads"][0]) >= {"dp_rank", "num_running_reqs", "num_waiting_reqs", "num_used_tokens",
                                                "max_total_num_tokens", "token_usage"}
        if num_requests_from_load(load.json()) <= 0:
            break
        assert time.monotonic() < deadline
        time.sleep(0.1)
    worker.join(60)
    assert answers[0].status_code == 200
    out = answers[0].json()
    assert out["meta_info"]["finish_reason"]["type"] == "abort" and len(out["output_ids"]) < 400
    _check_slime_output(out)
    assert http.get("/v1/loads", params={"include": "core,bogus"}).status_code == 400


def slime_flush_cache(http: httpx.Client) -> None:
    """SGLangEngine.flush_cache: GET /flush_cache until 200 (slime retries 60 times, 1 s apart)."""
    for _ in range(60):
        if http.get("/flush_cache").status_code == 200:
            return
        time.sleep(0.2)
    raise TimeoutError("flush_cache never answered 200")


def test_slime_colocated_tensor_sync(http: httpx.Client, qwen3_next_dir: str, expected) -> None:
    """Sequence A (update_weight_from_tensor.py::UpdateWeightFromTensor.update_weights, bodies of
    sglang_engine.py::SGLangEngine.*): two flattened buckets, weight_version "3" then 3."""
    slime_flush_cache(http)  # RolloutManager.offload: flush, then release everything
    assert http.post("/release_memory_occupation", json={}).status_code == 200
    resumed = http.post("/resume_memory_occupation", json={"tags": ["weights"]})
    assert resumed.status_code == 200 and isinstance(resumed.json(), dict)
    assert http.post("/pause_generation", json={}).status_code == 200
    slime_flush_cache(http)
    pairs = hf_named_parameters(qwen3_next_dir)
    half = len(pairs) // 2
    for bucket, version in ((pairs[:half], "3"), (pairs[half:], 3)):
        # _send_to_colocated_engine: one serialized FlattenedTensorBucket per engine GPU
        # (CPU shared memory here instead of CUDA IPC).
        body = {"serialized_named_tensors": [serialize_payload(flatten_bucket(bucket))],
                "load_format": "flattened_bucket", "flush_cache": False, "weight_version": version}
        r = http.post("/update_weights_from_tensor", json=body)
        assert r.status_code == 200 and r.json()["success"] is True and r.json()["weight_version"] == "3", r.text
    assert http.post("/continue_generation", json={}).status_code == 200
    assert http.post("/resume_memory_occupation", json={"tags": ["kv_cache", "cuda_graph"]}).status_code == 200
    out = http.post("/generate", json=GREEDY).json()
    assert out["output_ids"] == expected["new"] and out["meta_info"]["weight_version"] == "3"
    assert http.get("/get_weight_version").json() == {"weight_version": "3"}


def test_slime_disk_sync(http: httpx.Client, qwen3_next_dir: str, expected) -> None:
    """Sequence C (slime/ray/actor_group.py::_reload_rollout_weights_from_disk); --ci-test reads
    GET /get_weight_version and compares str(v)."""
    assert http.post("/pause_generation", json={}).status_code == 200
    slime_flush_cache(http)
    r = http.post("/update_weights_from_disk", json={"model_path": qwen3_next_dir, "weight_version": "4"})
    assert r.status_code == 200 and r.json()["success"] is True, r.text
    assert str(http.get("/get_weight_version").json()["weight_version"]) == "4"
    assert http.get("/weight_version").json()["weight_version"] == "4"
    assert http.post("/continue_generation", json={}).status_code == 200
    assert http.post("/generate", json=GREEDY).json()["output_ids"] == expected["new"]
    outside = http.post("/update_weights_from_disk", json={"model_path": "/etc", "weight_version": 5})
    assert outside.status_code == 403 and "--allowed-model-dirs" in outside.json()["error"]["message"]


def test_server_info_discovery(http: httpx.Client, server: ServerProcess) -> None:
    """external.py::get_server_info (/server_info, then /get_server_info) and the keys that
    discover_external_engines and SGLangEngine._init_external read; sgl-router's registration."""
    for path in ("/server_info", "/get_server_info"):
        info = http.get(path).json()
        assert (info["pp_size"], info["tp_size"], info["ep_size"], info["moe_dp_size"], info["dp_size"]) == (1,) * 5
        assert info["num_gpus"] == 0 and info["encoder_only"] is False and info["disaggregation_mode"] == "null"
        assert info["enable_memory_saver"] is False  # == args.offload_rollout: no regions on a CPU
        assert info["max_total_num_tokens"] == info["kv_blocks_total"] * info["block_size"]
        assert info["status"] == "ready" and info["version"] and isinstance(info["weight_version"], str)
        assert info["model_path"] and info["served_model_name"] and info["max_running_requests"] == 256
        assert 0 < info["max_req_input_len"] < info["context_length"] == 512
        assert set(info["internal_states"][0]["memory_usage"]) == {"weight", "kvcache", "token_capacity", "graph"}
        assert info["server_args"]["port"] == server.port and info["engine_pid"] > 0


def _verl_payload(pairs: list[tuple[str, torch.Tensor]]) -> str:
    """What verl's ServerAdapter sends (SGLang's weight_sync/utils.py::update_weights): a
    ForkingPickler pickle of [(name, LocalSerializedTensor(values=[raw pickle of the tensor]))],
    base64-encoded by http_server_engine.py."""
    wrapped = [(n, LocalSerializedTensor(values=[base64.b64decode(serialize_payload(t))])) for n, t in pairs]
    return serialize_payload(wrapped)


def test_verl_hybrid_sequence(http: httpx.Client, qwen3_next_dir: str, expected) -> None:
    """verl/workers/fsdp_workers.py rollout_mode() through http_server_engine.py's adapter bodies,
    then async_sglang_server.py::SGLangHttpServer.generate's request as a /generate body."""
    assert http.post("/release_memory_occupation", json={"tags": ["kv_cache", "weights"]}).status_code == 200
    assert http.post("/resume_memory_occupation", json={"tags": ["weights"]}).status_code == 200
    pairs = hf_named_parameters(qwen3_next_dir)
    body = {"serialized_named_tensors": [_verl_payload(pairs)], "load_format": None, "flush_cache": True}
    r = http.post("/update_weights_from_tensor", json=body)
    assert r.status_code == 200 and r.json()["success"] is True, r.text
    assert http.get("/flush_cache").status_code == 200
    assert http.post("/resume_memory_occupation", json={"tags": ["kv_cache"]}).status_code == 200
    sampling_params = {"temperature": 1.0, "top_p": 1, "top_k": -1, "repetition_penalty": 1.0, "max_new_tokens": 16}
    request = {"rid": os.urandom(16).hex(), "input_ids": PROMPT, "sampling_params": sampling_params,
               "return_logprob": True, "image_data": None}
    out = http.post("/generate", json=request).json()
    assert out["meta_info"]["id"] == request["rid"] and out["meta_info"]["finish_reason"]["type"] in ("stop", "length")
    assert len(out["meta_info"]["output_token_logprobs"]) == len(out["output_ids"]) > 0
    assert http.post("/generate", json=GREEDY).json()["output_ids"] == expected["new"]
    assert http.post("/generate", json=request | {"image_data": ["data:image/png;base64,AAAA"]}).status_code == 400
    released = http.post("/release_memory_occupation", json={"tags": ["kv_cache", "weights"]})
    assert released.status_code == 200 and released.json()["changed"] == ["kv_cache", "weights"]


def test_slime_weights_checker(http: httpx.Client, qwen3_dir: str, expected) -> None:
    """--check-weight-update-equal: snapshot and reset_tensors at startup, a sync, then compare
    (sglang_engine.py::SGLangEngine.check_weights)."""
    checksum = http.post("/weights_checker", json={"action": "checksum"}).json()["per_engine_checksum"]
    assert http.post("/weights_checker", json={"action": "snapshot"}).json()["success"] is True
    assert http.post("/weights_checker", json={"action": "reset_tensors"}).status_code == 200
    assert http.post("/generate", json=GREEDY).json()["output_ids"] != expected["old"]
    differs = http.post("/weights_checker", json={"action": "compare"})
    assert differs.status_code == 400 and differs.json()["success"] is False and "differ" in differs.json()["message"]
    bucket = serialize_payload(flatten_bucket(hf_named_parameters(qwen3_dir)))
    body = {"serialized_named_tensors": [bucket], "load_format": "flattened_bucket", "flush_cache": False, "weight_version": "1"}
    assert http.post("/update_weights_from_tensor", json=body).status_code == 200
    same = http.post("/weights_checker", json={"action": "compare"})
    assert same.status_code == 200 and same.json()["success"] is True, same.text
    assert http.post("/weights_checker", json={"action": "checksum"}).json()["per_engine_checksum"] == checksum
    assert http.post("/generate", json=GREEDY).json()["output_ids"] == expected["old"]
    # slime's patch route: nothing is quantized here, so nothing to post-process.
    post = http.post("/post_process_weights", json={"restore_weights_before_load": True, "post_process_quantization": False})
    assert post.status_code == 200 and post.json()["success"] is True


def test_profile(http: httpx.Client, tmp_path) -> None:
    """SGLangEngine.start_profile / stop_profile bodies (sglang_engine.py)."""
    body = {"output_dir": str(tmp_path), "start_step": None, "num_steps": None, "activities": ["CPU", "GPU"],
            "profile_by_stage": False, "with_stack": None, "record_shapes": None}
    started = http.post("/start_profile", json=body)
    assert started.status_code == 200 and started.json()["output_dir"] == str(tmp_path), started.text
    assert http.post("/start_profile", json=body).status_code == 400  # one at a time
    http.post("/generate", json=GREEDY)
    stopped = http.post("/stop_profile", json={})
    assert stopped.status_code == 200
    [trace] = stopped.json()["files"]
    assert os.path.dirname(trace) == str(tmp_path)
    with gzip.open(trace, "rt") as f:
        assert json.load(f)["traceEvents"]
    assert http.post("/stop_profile", json={}).status_code == 400
    # num_steps: it stops by itself after that many engine steps.
    auto = http.post("/start_profile", json=body | {"num_steps": 3, "output_dir": str(tmp_path / "auto")}).json()
    http.post("/generate", json=GREEDY)
    assert auto["stop_step"] - auto["start_step"] == 3
    assert http.post("/start_profile", json=body | {"output_dir": str(tmp_path / "again")}).status_code == 200
    assert len(os.listdir(tmp_path / "auto")) == 1
    assert http.post("/stop_profile").status_code == 200
