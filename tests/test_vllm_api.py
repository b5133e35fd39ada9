"""vLLM's RL dialect against a real server on CPU: SkyRL's and prime-rl's calls with their exact
payloads, checked against transformers on the tiny checkpoints.

Payloads are copied from the clients' code, cited per test: SkyRL
(skyrl/backends/skyrl_train/inference_servers/remote_inference_client.py, RemoteInferenceClient;
weight_sync/broadcast_strategy.py), prime-rl (src/prime_rl/orchestrator/inference_admin.py,
InferenceAdmin). Routes and defaults are vLLM's (entrypoints/serve/dev/rlhf/api_router.py,
serve/disagg/protocol.py). One server serves the module; each test leaves it awake, unpaused,
on the old weights.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from oracle import hf_named_parameters
from server_util import ServerProcess, free_port
from transformers import AutoModelForCausalLM

from engine.weights.groups import broadcast_from_trainer, trainer_group
from server.vllm_weights_api import VLLM_GROUP

PROMPT = [5, 9, 13, 200, 7, 31, 64]
N = 12
LONG = 200  # a request long enough to be frozen half-way


@pytest.fixture(scope="module")
def server(qwen3_dir: str, tmp_path_factory: pytest.TempPathFactory):
    log = str(tmp_path_factory.mktemp("logs") / "vllm_api_server.log")
    proc = ServerProcess(qwen3_dir, "--max-model-len", "512", log_path=log)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def models(qwen3_dir: str, qwen3_next_dir: str) -> dict[str, torch.nn.Module]:
    load = lambda d: AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()  # noqa: E731
    return {"old": load(qwen3_dir), "new": load(qwen3_next_dir)}


@pytest.fixture
def http(server: ServerProcess, qwen3_dir: str):
    """A client; afterwards the server is awake, unpaused and on the old weights."""
    with server.client() as client:
        yield client
        client.post("/resume")
        client.post("/wake_up", params={"tags": "weights"})
        assert client.post("/update_weights", json={"weight_dir": qwen3_dir}).status_code == 200
        assert client.post("/wake_up").status_code == 200


@pytest.fixture(scope="module")
def model_name(server: ServerProcess) -> str:
    return httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]


@torch.no_grad()
def greedy(model: torch.nn.Module, ids: list[int], n: int, cache: Any = None, first: int | None = None) -> list[int]:
    """n greedy tokens after `ids`; with `cache` (the KV of `ids`), from the token `first` on."""
    if cache is None:
        out = model(torch.tensor([ids]), use_cache=True)
        cache, nxt = out.past_key_values, int(out.logits[0, -1].argmax())
    else:
        step = model(torch.tensor([[first]]), past_key_values=cache, use_cache=True)
        cache, nxt = step.past_key_values, int(step.logits[0, -1].argmax())
    tokens = [nxt]
    while len(tokens) < n:
        step = model(torch.tensor([[tokens[-1]]]), past_key_values=cache, use_cache=True)
        cache = step.past_key_values
        tokens.append(int(step.logits[0, -1].argmax()))
    return tokens


@torch.no_grad()
def after_update(models: dict[str, torch.nn.Module], out: list[int], k: int) -> list[int]:
    """What a request frozen after its first k tokens generates once the weights change under
    it (vLLM's keep): the KV of the prompt and out[:k-1] is the old model's, every later position
    the new model's, starting from out[k-1]."""
    cache = models["old"](torch.tensor([PROMPT + out[: k - 1]]), use_cache=True).past_key_values
    return greedy(models["new"], [], len(out) - k, cache=cache, first=out[k - 1])


def _in_thread(fn: Any) -> tuple[threading.Thread, list[Any]]:
    box: list[Any] = []
    t = threading.Thread(target=lambda: box.append(fn()), daemon=True)
    t.start()
    return t, box


def _wait_running(http: httpx.Client) -> None:
    deadline = time.monotonic() + 60
    while http.get("/get_server_info").json()["num_running"] < 1:
        assert time.monotonic() < deadline, "the request never ran"
        time.sleep(0.01)


def _frozen_across(http: httpx.Client, server: ServerProcess, model_name: str, models: dict, update: Any) -> None:
    """SkyRL's rollout request (remote_inference_client.py::_generate_single: {sampling_params,
    model, token_ids}) frozen by /pause?mode=keep&clear_cache=false (::pause, and prime-rl's
    InferenceAdmin.on_new_version), the weights updated by `update`, then /resume: the request
    finishes, its tokens before the pause the old model's, after it the new model's on the KV
    it kept."""
    version = http.get("/get_weight_version").json()["weight_version"]
    # A server whose tokens take well under a ms (a GPU: tests/test_gpu_vllm_api.py) says how long
    # a request it must freeze half-way is, and how soon to pause it.
    long, wait_s = getattr(server, "long_request", LONG), getattr(server, "pause_after_s", 0.1)
    body = {"sampling_params": {"temperature": 0.0, "max_tokens": long, "ignore_eos": True}, "model": model_name,
            "token_ids": PROMPT}
    worker, answers = _in_thread(lambda: httpx.post(f"{server.url}/inference/v1/generate", json=body, timeout=300))
    _wait_running(http)
    time.sleep(wait_s)  # some tokens on the old weights (a token takes a few ms here)
    paused = http.post("/pause", params={"mode": "keep", "clear_cache": "false"})
    assert paused.status_code == 200 and paused.json()["status"] == "paused", paused.text
    assert http.get("/is_paused").json() == {"is_paused": True}
    assert http.get("/get_server_info").json()["num_running"] == 1, "the request ended before the pause"
    update()
    assert http.get("/get_weight_version").json()["weight_version"] == version  # no version named: kept
    assert worker.is_alive()  # still frozen
    assert http.post("/resume").json()["status"] == "resumed"
    worker.join(300)
    choice = answers[0].json()["choices"][0]
    out = choice["token_ids"]
    assert len(out) == long and choice["finish_reason"] == "length"
    old = greedy(models["old"], PROMPT, long)
    same = next((i for i, (a, b) in enumerate(zip(out, old, strict=True)) if a != b), long)
    assert 0 < same < long, f"{same} of {long} tokens are the old model's"
    # The first k tokens came before the pause (k <= same: a new token may equal the old one).
    k = next((k for k in range(same, 0, -1) if after_update(models, out, k) == out[k:]), None)
    assert k is not None, "no split of the output into old-model tokens, then new-model tokens on the kept KV"


def test_skyrl_pause_keep_broadcast_update_resume(http, server, model_name, models, qwen3_next_dir) -> None:
    """SkyRL's weight sync: get_world_size (remote_inference_client.py::get_world_size),
    init_weight_update_communicator ({"init_info": BroadcastInitInfo.to_api_payload()}, rank_offset
    1, world_size servers + 1), then update_named_weights ({"update_info": weight metadata +
    "packed": True}, broadcast_strategy.py::_send_chunks_vllm_native). The trainer joins with
    engine/weights/groups.py over gloo and broadcasts vLLM's one packed bucket."""

    def update() -> None:
        world_size = http.get("/get_world_size").json()["world_size"]
        assert world_size == 1
        port = free_port()
        init_info = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": world_size + 1}
        joiner, joined = _in_thread(lambda: http.post("/init_weight_transfer_engine", json={"init_info": init_info}))
        trainer = trainer_group("127.0.0.1", port, world_size + 1, VLLM_GROUP, "gloo", timeout_s=120)
        joiner.join(120)
        assert joined[0].status_code == 200, joined[0].text
        pairs = hf_named_parameters(qwen3_next_dir)
        update_info = {"names": [n for n, _ in pairs], "dtype_names": [str(t.dtype).split(".")[-1] for _, t in pairs],
                       "shapes": [list(t.shape) for _, t in pairs], "packed": True}
        sender, sent = _in_thread(lambda: http.post("/update_weights", json={"update_info": update_info}))
        broadcast_from_trainer(trainer, pairs, "flattened_bucket")  # vLLM's packed bucket: the bytes back to back
        sender.join(120)
        assert sent[0].status_code == 200 and sent[0].json()["receive_route"].startswith("packed"), sent[0].text

    _frozen_across(http, server, model_name, models, update)
    # The trainer is gone: its group goes too (vLLM's one group; a later init replaces it anyway).
    assert http.post("/destroy_weights_update_group", json={"group_name": VLLM_GROUP}).status_code == 200


def _prime_rl_trainer(send: Any, pairs: list[tuple[str, torch.Tensor]], step_dir: Path) -> None:
    """prime-rl's NCCLWeightBroadcast.broadcast_weights on rank 0: wait for the orchestrator's
    NCCL_READY marker, write NCCL_MANIFEST.json ({"num_chunks"}), then per chunk (the weights
    outside the layers, then each layer: filter_state_dict_by_layers) write NCCL_CHUNK_{i}.json
    ({names, dtype_names, shapes}) by a rename and broadcast the chunk's tensors one by one."""
    deadline = time.monotonic() + 120
    while not (step_dir / "NCCL_READY").exists():
        assert time.monotonic() < deadline, "the orchestrator never wrote NCCL_READY"
        time.sleep(0.01)
    layers = sorted({int(n.split(".")[2]) for n, _ in pairs if n.startswith("model.layers.")})
    chunks = [[(n, t) for n, t in pairs if not n.startswith("model.layers.")]]
    chunks += [[(n, t) for n, t in pairs if n.startswith(f"model.layers.{i}.")] for i in layers]

    def write(name: str, payload: dict) -> None:
        (step_dir / f"{name}.tmp").write_text(json.dumps(payload))
        (step_dir / f"{name}.tmp").replace(step_dir / name)

    write("NCCL_MANIFEST.json", {"num_chunks": len(chunks)})
    for i, chunk in enumerate(chunks):
        write(f"NCCL_CHUNK_{i}.json", {"names": [n for n, _ in chunk], "shapes": [list(t.shape) for _, t in chunk],
                                       "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in chunk]})
        send(chunk)  # NCCLWeightTransferEngine.trainer_send_weights: one broadcast per tensor


def prime_rl_nccl_update(http: httpx.Client, pairs: list[tuple[str, torch.Tensor]], send: Any, step_dir: Path) -> None:
    """The orchestrator's update_weights with the trainer sending beside it: the NCCL_READY marker,
    then /update_weights {weight_dir, mode} (the pause and resume around it: `_frozen_across`)."""
    step_dir.mkdir()
    sender = threading.Thread(target=_prime_rl_trainer, args=(send, pairs, step_dir), daemon=True)
    sender.start()
    (step_dir / "NCCL_READY").touch()
    r = http.post("/update_weights", json={"weight_dir": str(step_dir), "mode": "full"})
    sender.join(120)
    layers = {n.split(".")[2] for n, _ in pairs if n.startswith("model.layers.")}
    assert r.status_code == 200 and r.json()["chunks"] == 1 + len(layers), r.text


def test_prime_rl_nccl_broadcaster_pause_keep_update_resume(http, server, model_name, models, qwen3_next_dir, tmp_path) -> None:
    """prime-rl's NCCL weight broadcast: /init_broadcaster (AdminPlane.initialize_nccl's body)
    while its trainer joins (NCCLWeightBroadcastSender: vLLM's trainer_init; here gloo, a CPU has
    no NCCL), then the orchestrator's update_weights (prime_rl/utils/client.py): /pause keep,
    the NCCL_READY marker, /update_weights {weight_dir, mode}, /resume, while the trainer sends
    (`_prime_rl_trainer`). Afterwards /update_weights {weight_dir} loads from disk again once the
    group is destroyed."""
    from server.vllm_weights_api import PRIME_GROUP

    port = free_port()
    body = {"host": "127.0.0.1", "port": port, "rank_offset": 0, "inference_world_size": 1, "timeout": 120,
            "quantize_in_weight_transfer": False}
    joiner, joined = _in_thread(lambda: http.post("/init_broadcaster", json=body))
    trainer = trainer_group("127.0.0.1", port, 2, PRIME_GROUP, "gloo", timeout_s=120)
    joiner.join(120)
    assert joined and joined[0].status_code == 200, joined and joined[0].text
    pairs = hf_named_parameters(qwen3_next_dir)
    send = lambda chunk: broadcast_from_trainer(trainer, chunk, None)  # noqa: E731
    try:
        _frozen_across(http, server, model_name, models, lambda: prime_rl_nccl_update(http, pairs, send, tmp_path / "step_1"))
    finally:
        assert http.post("/destroy_weights_update_group", json={"group_name": PRIME_GROUP}).status_code == 200


def test_prime_rl_pause_keep_disk_update_resume(http, server, model_name, models, qwen3_next_dir) -> None:
    """prime-rl's InferenceAdmin.on_new_version: /pause (mode keep, clear_cache "false"), then
    /update_weights {"weight_dir": step dir}, then /resume."""

    def update() -> None:
        r = http.post("/update_weights", json={"weight_dir": qwen3_next_dir})
        assert r.status_code == 200 and r.json()["success"] is True, r.text

    _frozen_across(http, server, model_name, models, update)


def _generate(http: httpx.Client, model_name: str, **sampling: Any) -> httpx.Response:
    body = {"sampling_params": {"temperature": 0.0, "max_tokens": N, "ignore_eos": True} | sampling,
            "model": model_name, "token_ids": PROMPT}
    return http.post("/inference/v1/generate", json=body)


def test_tokens_in_generate_equals_transformers(http, model_name, models) -> None:
    """remote_inference_client.py::_generate_single reads choices[0].token_ids, .finish_reason and
    .logprobs.content[].logprob; prime-rl asks prompt_logprobs."""
    r = _generate(http, model_name, logprobs=2, prompt_logprobs=1)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    want = greedy(models["old"], PROMPT, N)
    assert choice["token_ids"] == want and choice["finish_reason"] == "length"
    with torch.no_grad():
        logp = torch.log_softmax(models["old"](torch.tensor([PROMPT + want])).logits[0], -1)
    content = choice["logprobs"]["content"]
    got = torch.tensor([c["logprob"] for c in content])
    expect = logp[len(PROMPT) - 1 : -1].gather(1, torch.tensor(want)[:, None])[:, 0]
    assert torch.allclose(got, expect, atol=1e-4)
    assert all(c["token"] == f"token_id:{t}" and c["top_logprobs"][0]["token"] == c["token"] and len(c["top_logprobs"]) <= 2
               for c, t in zip(content, want, strict=True))
    prompt_lps = r.json()["prompt_logprobs"]
    assert prompt_lps[0] is None and len(prompt_lps) == len(PROMPT)
    for i in range(1, len(PROMPT)):
        assert abs(prompt_lps[i][str(PROMPT[i])]["logprob"] - logp[i - 1, PROMPT[i]].item()) < 1e-4
    assert r.json()["usage"] == {"prompt_tokens": len(PROMPT), "completion_tokens": N, "total_tokens": len(PROMPT) + N}
    stop = _generate(http, model_name, stop_token_ids=[want[3]], ignore_eos=False).json()["choices"][0]
    assert stop["token_ids"] == want[:4] and stop["finish_reason"] == "stop" and stop["logprobs"] is None
    two = _generate(http, model_name, n=2, temperature=1.0, seed=3).json()["choices"]
    assert [c["index"] for c in two] == [0, 1] and all(len(c["token_ids"]) == N for c in two)


def test_structured_outputs_spell_the_regex(http, model_name) -> None:
    """vLLM's structured outputs: a regex the tokens must spell (the engine's grammar masks)."""
    shaped = _generate(http, model_name, max_tokens=40, structured_outputs={"regex": "(ab|ba){2,4}"}).json()["choices"][0]
    assert shaped["finish_reason"] == "stop" and 4 <= len(shaped["token_ids"]) <= 41


def test_skyrl_sleep_wake_is_a_release(http, model_name, models) -> None:
    """remote_inference_client.py::sleep sends {"level": 1} as a body (vLLM reads the query),
    ::wake_up {"tags": [...]} or {}; both dialects see one state."""
    want = greedy(models["old"], PROMPT, N)
    assert http.post("/sleep", json={"level": 1}).status_code == 200
    assert http.get("/is_sleeping").json()["is_sleeping"] is True
    occupation = http.get("/memory_occupation").json()
    assert "released" in str(occupation), occupation
    refused = _generate(http, model_name)
    assert refused.status_code == 503 and "released" in refused.json()["error"]["message"]
    assert http.post("/wake_up", json={"tags": ["weights"]}).status_code == 200
    assert http.get("/is_sleeping").json() == {"is_sleeping": True, "released_tags": ["kv_cache", "cuda_graph"]}
    assert http.post("/wake_up", json={}).status_code == 200
    assert http.get("/is_sleeping").json()["is_sleeping"] is False
    assert _generate(http, model_name).json()["choices"][0]["token_ids"] == want
    # The other way round: SGLang's release is a sleep, vLLM's wake its resume.
    assert http.post("/release_memory_occupation", json={"tags": ["kv_cache"]}).status_code == 200
    assert http.get("/is_sleeping").json() == {"is_sleeping": True, "released_tags": ["kv_cache"]}
    assert http.post("/wake_up", params={"tags": "kv_cache"}).status_code == 200
    assert _generate(http, model_name).json()["choices"][0]["token_ids"] == want


def test_level_2_sleep_needs_an_update_before_the_wake(http, model_name, models, qwen3_dir) -> None:
    """vLLM's level 2 discards the weights: wake weights, update, wake the rest (vLLM's order)."""
    assert http.post("/sleep", params={"level": "2"}).json()["level"] == 2
    early = http.post("/wake_up")
    assert early.status_code == 400 and "level-2" in early.json()["error"]["message"], early.text
    assert http.get("/is_sleeping").json()["is_sleeping"] is True
    assert http.post("/wake_up", params={"tags": "weights"}).status_code == 200
    sglang = http.post("/resume_memory_occupation", json={"tags": ["kv_cache"]})
    assert sglang.status_code == 400 and "update the weights" in sglang.json()["error"]["message"]
    refused = _generate(http, model_name)
    assert refused.status_code == 503, refused.text
    assert http.post("/update_weights", json={"weight_dir": qwen3_dir}).status_code == 200
    assert http.post("/wake_up").status_code == 200
    assert _generate(http, model_name).json()["choices"][0]["token_ids"] == greedy(models["old"], PROMPT, N)


def test_sleep_keep_freezes_requests_until_the_wake(http, server, model_name, models) -> None:
    """vLLM's /sleep?mode=keep: the running request is neither aborted nor finished; after the
    wake it continues (recomputing its KV) and ends as greedy decoding would have."""
    body = {"sampling_params": {"temperature": 0.0, "max_tokens": LONG, "ignore_eos": True}, "model": model_name,
            "token_ids": PROMPT}
    worker, answers = _in_thread(lambda: httpx.post(f"{server.url}/inference/v1/generate", json=body, timeout=300))
    _wait_running(http)
    slept = http.post("/sleep", params={"level": "1", "mode": "keep"})
    assert slept.status_code == 200 and slept.json()["mode"] == "keep", slept.text
    assert http.get("/is_paused").json() == {"is_paused": False}  # the pause was the sleep's own
    time.sleep(0.3)
    assert worker.is_alive()
    assert http.post("/wake_up").status_code == 200
    worker.join(300)
    choice = answers[0].json()["choices"][0]
    assert choice["finish_reason"] == "length" and choice["token_ids"] == greedy(models["old"], PROMPT, LONG)


def test_pause_abort_and_wait(http, server, model_name) -> None:
    """/pause?mode=abort ends the running request (finish_reason abort; SGLang's meta_info says
    what aborted it); mode=wait answers once it finished and holds new ones until /resume."""
    long = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": LONG, "temperature": 0, "ignore_eos": True}}
    worker, answers = _in_thread(lambda: httpx.post(f"{server.url}/generate", json=long, timeout=300))
    _wait_running(http)
    assert http.post("/pause", params={"mode": "abort"}).status_code == 200
    worker.join(60)
    reason = answers[0].json()["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and "pause" in reason["message"], reason
    assert http.post("/resume").status_code == 200
    body = {"sampling_params": {"temperature": 0.0, "max_tokens": 64, "ignore_eos": True}, "model": model_name, "token_ids": PROMPT}
    worker, answers = _in_thread(lambda: httpx.post(f"{server.url}/inference/v1/generate", json=body, timeout=300))
    _wait_running(http)
    assert http.post("/pause", params={"mode": "wait"}).json()["status"] == "paused"
    worker.join(30)
    assert answers[0].json()["choices"][0]["finish_reason"] == "length"
    held, later = _in_thread(lambda: httpx.post(f"{server.url}/inference/v1/generate", json=body, timeout=300))
    time.sleep(0.5)
    assert held.is_alive() and http.get("/is_paused").json() == {"is_paused": True}
    assert http.post("/resume").status_code == 200
    held.join(60)
    assert len(later[0].json()["choices"][0]["token_ids"]) == 64
    # remote_inference_client.py::reset_prefix_cache's body.
    reset = http.post("/reset_prefix_cache", json={"reset_running_requests": True})
    assert reset.status_code == 200 and reset.json()["status"] == "ok"


def test_tokenize_detokenize_round_trip(http, model_name) -> None:
    """remote_inference_client.py::tokenize ({model, prompt, add_special_tokens}, reads "tokens")
    and ::detokenize ({model, tokens}, reads "prompt"); SGLang's batch shape reads "text"."""
    text = "The quick brown fox"
    ids = http.post("/tokenize", json={"model": model_name, "prompt": text, "add_special_tokens": True}).json()
    assert ids["count"] == len(ids["tokens"]) > 0 and ids["max_model_len"] == 512
    assert http.post("/detokenize", json={"model": model_name, "tokens": ids["tokens"]}).json()["prompt"] == text
    batch = http.post("/v1/tokenize", json={"prompt": [text, "jumps"]}).json()["tokens"]
    assert batch[0] == ids["tokens"] and http.post("/v1/detokenize", json={"tokens": batch}).json()["text"] == [text, "jumps"]
    strs = http.post("/tokenize", json={"prompt": text, "return_token_strs": True}).json()["token_strs"]
    assert len(strs) == len(ids["tokens"])
    # vLLM's chat form: the ids /v1/chat/completions prompts the model with (its usage counts them).
    messages = [{"role": "user", "content": text}]
    chat_ids = http.post("/tokenize", json={"messages": messages}).json()["tokens"]
    chat = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1}).json()
    assert len(chat_ids) == chat["usage"]["prompt_tokens"] and len(chat_ids) > len(ids["tokens"])
    assert http.post("/tokenize", json={"messages": messages, "prompt": text}).status_code == 400


BAD: list[tuple[str, str, dict[str, Any], int, str]] = [
    ("post", "/pause", {"params": {"mode": "bogus"}}, 400, "mode"),
    ("post", "/pause", {"params": {"clear_cache": "maybe"}}, 400, "clear_cache"),
    ("post", "/sleep", {"params": {"level": "3"}}, 400, "level"),
    ("post", "/sleep", {"params": {"level": "x"}}, 400, "level"),
    ("post", "/sleep", {"params": {"mode": "later"}}, 400, "mode"),
    ("post", "/sleep", {"json": {"level": 1, "tag": ["weights"]}}, 400, "tag"),
    ("post", "/wake_up", {"params": {"tags": "bogus"}}, 400, "bogus"),
    ("post", "/reset_prefix_cache", {"params": {"reset_running_requests": "maybe"}}, 400, "reset_running_requests"),
    ("post", "/update_weights", {"json": {}}, 400, "update_info"),
    ("post", "/update_weights", {"json": {"update_info": {"names": [], "dtype_names": [], "shapes": [],
                                                          "ipc_handles_pickled": "x"}}}, 400, "ipc_handles_pickled"),
    ("post", "/update_weights", {"json": {"update_info": {"names": ["a"], "dtype_names": ["float32"], "shapes": [[1]],
                                                          "packed": True, "packed_buffer_size_bytes": 5}}}, 400, "packed_buffer_size_bytes"),
    ("post", "/update_weights", {"json": {"update_info": {"names": ["model.norm.weight"], "dtype_names": ["float32"],
                                                          "shapes": [[64]]}}}, 400, VLLM_GROUP),
    ("post", "/update_weights", {"json": {"update_info": {"names": ["a"], "dtype_names": ["float32"], "shapes": [[1]]}}},
     400, "'a'"),
    ("post", "/init_weight_transfer_engine", {"json": {"init_info": {}}}, 400, "master_address"),
    ("post", "/collective_rpc", {"json": {"method": "reload_weights"}}, 400, "reload_weights"),
    # prime-rl's AdminPlane.initialize_nccl body, asking for its fp8 refit.
    ("post", "/init_broadcaster", {"json": {"host": "trainer", "port": 29501, "rank_offset": 0, "inference_world_size": 1,
                                            "timeout": 1200, "quantize_in_weight_transfer": True}}, 400, "quantize_in_weight_transfer"),
    ("post", "/init_broadcaster", {"json": {"host": "trainer", "port": 0, "inference_world_size": 1}}, 400, "master_port"),
    ("post", "/init_broadcaster", {"json": {"host": "trainer", "port": 29501, "inference_world_size": 0}}, 400, "world_size"),
    ("post", "/update_weights", {"json": {"weight_dir": "/tmp", "mode": "delta"}}, 400, "delta"),
    ("post", "/inference/v1/generate", {"json": {"token_ids": PROMPT, "sampling_params": {"bogus": 1}}}, 400, "bogus"),
    ("post", "/inference/v1/generate", {"json": {"token_ids": PROMPT, "sampling_params": {"bad_words": ["x"]}}}, 400, "bad_words"),
    ("post", "/inference/v1/generate", {"json": {"token_ids": [5, 512]}}, 400, "512"),
    ("post", "/inference/v1/generate", {"json": {"token_ids": PROMPT, "model": "nope"}}, 404, "nope"),
    ("post", "/detokenize", {"json": {"tokens": [5, 10**6]}}, 400, "1000000"),
]


def test_bad_values_are_4xx_naming_them(http) -> None:
    for method, path, kwargs, status, named in BAD:
        r = getattr(http, method)(path, **kwargs)
        assert r.status_code == status and named in r.json()["error"]["message"], (path, kwargs, r.status_code, r.text)
    assert http.get("/is_paused").json() == {"is_paused": False}
    assert http.get("/is_sleeping").json()["is_sleeping"] is False
