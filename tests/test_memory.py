"""Memory occupation on the CPU (CI): regions are no-ops here, so this checks the state machine,
the answers (`memory_saver: false`, 0 bytes), refusal while released, wait vs abort with requests in
flight, and unchanged outputs across cycles. Real page release is tests/test_gpu_memory.py."""

from __future__ import annotations

import itertools
import threading
import time

import pytest
from server_util import BackgroundStream, ServerProcess

from engine import Engine, InvalidRequest, SamplingParams

TAGS = ["weights", "kv_cache", "cuda_graph"]
GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 9, 13, 200], [7] * 30]


@pytest.fixture(scope="module")
def llm(demo_dir: str):
    with Engine(model=demo_dir, device="cpu", dtype="float32") as engine:
        yield engine


def _outputs(llm: Engine) -> list[list[int]]:
    return [o.output_ids for o in llm.generate(input_ids=PROMPTS, sampling_params=GREEDY)]


def test_every_order_of_release_and_resume(llm: Engine) -> None:
    expected = _outputs(llm)
    for release_order in itertools.permutations(TAGS):
        for resume_order in itertools.permutations(TAGS):
            for i, tag in enumerate(release_order):
                answer = llm.release_memory_occupation([tag])
                assert answer["changed"] == [tag] and answer["tags"][tag] == "released"
                assert answer["memory_saver"] is False and answer["bytes_freed"] == 0
                assert list(answer["seconds_by_tag"]) == [tag] and 0 <= answer["seconds_by_tag"][tag] <= answer["seconds"]
                assert sorted(t for t, s in answer["tags"].items() if s == "released") == sorted(release_order[: i + 1])
            for i, tag in enumerate(resume_order):
                answer = llm.resume_memory_occupation([tag])
                assert answer["changed"] == [tag] and answer["tags"][tag] == "resident"
                assert answer["bytes_restored"] == 0 and list(answer["seconds_by_tag"]) == [tag]
                still = sorted(resume_order[i + 1 :])
                assert sorted(t for t, s in answer["tags"].items() if s == "released") == still
        assert _outputs(llm) == expected


def test_double_calls_are_no_ops_and_unknown_tags_are_refused(llm: Engine) -> None:
    noop = llm.resume_memory_occupation(None)
    assert noop["changed"] == [] and noop["seconds_by_tag"] == {}  # all resident already
    first = llm.release_memory_occupation(None)
    assert first["changed"] == ["kv_cache", "weights", "cuda_graph"]  # release order
    # A CPU copies the host copy synchronously: nothing is left to wait for.
    assert 0.0 <= first["host_copy_wait_seconds"] < 1.0
    assert first["weights_stale_bytes"] > 0  # poisoned: the first forward restores them
    again = llm.release_memory_occupation([])
    assert again["changed"] == [] and set(again["tags"].values()) == {"released"}
    with pytest.raises(InvalidRequest, match="valid tags: weights, kv_cache, cuda_graph"):
        llm.release_memory_occupation(["weights", "activations"])
    with pytest.raises(InvalidRequest, match="release mode"):
        llm.release_memory_occupation(None, mode="later")
    resumed = llm.resume_memory_occupation(None)
    assert resumed["changed"] == ["cuda_graph", "weights", "kv_cache"]  # resume order
    occupation = llm.memory_occupation()
    assert occupation["memory_saver"] is False and occupation["weights_valid"] is True
    assert {t: v["state"] for t, v in occupation["tags"].items()} == dict.fromkeys(TAGS, "resident")


def test_requests_are_refused_while_released(llm: Engine) -> None:
    expected = _outputs(llm)
    llm.release_memory_occupation(["kv_cache"])
    outs = llm.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert all(o.finish_reason == "abort" and o.output_ids == [] and o.unavailable for o in outs)
    assert "kv_cache" in outs[0].error
    llm.resume_memory_occupation(["kv_cache"])
    assert _outputs(llm) == expected
    info = llm.get_server_info()
    assert info["kv_blocks_free"] == info["kv_blocks_total"]


@pytest.fixture(scope="module")
def server(demo_dir: str, tmp_path_factory: pytest.TempPathFactory):
    log = str(tmp_path_factory.mktemp("logs") / "memory_server.log")
    proc = ServerProcess(demo_dir, "--max-model-len", "512", log_path=log)
    yield proc
    proc.stop()


LONG = {"input_ids": [3, 4, 5], "sampling_params": {"max_new_tokens": 300, "temperature": 0, "ignore_eos": True}}


def test_http_routes_and_503_while_released(server: ServerProcess) -> None:
    with server.client() as http:
        greedy = {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 12, "temperature": 0}}
        before = http.post("/generate", json=greedy).json()["output_ids"]
        assert http.get("/health").json()["memory"] == "resident"
        bad = http.post("/release_memory_occupation", json={"tags": ["gpu"]})
        assert bad.status_code == 400 and "valid tags" in bad.json()["error"]["message"]
        answer = http.post("/release_memory_occupation", json={"tags": None}).json()
        assert answer["changed"] == ["kv_cache", "weights", "cuda_graph"] and answer["bytes_freed"] == 0
        assert answer["memory_saver"] is False
        health = http.get("/health")
        assert health.status_code == 200 and health.json()["memory"] == "released"
        for path, body in [("/generate", greedy), ("/generate", greedy | {"stream": True}),
                           ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})]:
            r = http.post(path, json=body)
            assert r.status_code == 503, (path, r.text)
            assert "kv_cache" in r.json()["error"]["message"], path
        occupation = http.get("/memory_occupation").json()
        assert occupation["tags"]["weights"]["state"] == "released"
        assert http.post("/resume_memory_occupation", json={"tags": ["weights"]}).json()["changed"] == ["weights"]
        assert http.post("/generate", json=greedy).status_code == 503  # kv_cache, cuda_graph still out
        assert http.post("/resume_memory_occupation").json()["changed"] == ["cuda_graph", "kv_cache"]
        assert http.post("/generate", json=greedy).json()["output_ids"] == before


@pytest.mark.parametrize("mode", ["wait", "abort"])
def test_release_with_a_stream_in_flight(server: ServerProcess, mode: str) -> None:
    stream = BackgroundStream(server.url, LONG)
    assert stream.started()
    with server.client() as http:
        released: list = []
        releaser = threading.Thread(
            target=lambda: released.append(http.post("/release_memory_occupation", json={"mode": mode}).json())
        )
        releaser.start()
        time.sleep(0.3)
        # While the release drains or after it, new requests are refused.
        assert http.post("/generate", json=LONG).status_code == 503
        last = stream.join()
        releaser.join(120)
        if mode == "wait":
            assert last["finish_reason"]["type"] == "length" and last["completion_tokens"] == 300
        else:
            assert last["finish_reason"]["type"] == "abort" and 0 < last["completion_tokens"] < 300
        assert released[0]["changed"] == ["kv_cache", "weights", "cuda_graph"]
        http.post("/resume_memory_occupation", json={"tags": None})
        info = http.get("/get_server_info").json()
        assert info["kv_blocks_free"] == info["kv_blocks_total"] and info["num_running"] == 0
        assert http.post("/generate", json=LONG).status_code == 200
