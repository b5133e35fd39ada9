"""RL weight updates on the CPU: from disk and from tensors, through the Engine API and HTTP.
Checked: outputs after an update equal transformers (and a fresh engine) on the new weights; a bad
update names the bad tensor and leaves the old weights in use; paths outside the allowed
directories are refused; updates wait for (or abort) requests in flight."""

from __future__ import annotations

import json
import os
import threading

import httpx
import pytest
from oracle import hf_greedy
from server_util import ServerProcess

from engine import Engine, SamplingParams

PROMPTS = [[5, 9, 13, 200, 7], [7] * 20]
N = 12
GREEDY = SamplingParams(max_new_tokens=N, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def expected(qwen3_dir: str, qwen3_next_dir: str) -> dict[str, list[list[int]]]:
    return {"old": hf_greedy(qwen3_dir, PROMPTS, N), "new": hf_greedy(qwen3_next_dir, PROMPTS, N)}


def _outputs(llm: Engine) -> list[list[int]]:
    return [o.output_ids for o in llm.generate(input_ids=PROMPTS, sampling_params=GREEDY)]


def test_update_from_disk(qwen3_dir: str, qwen3_next_dir: str, llama_dir: str, expected, tmp_path) -> None:
    assert expected["old"] != expected["new"]
    with Engine(model=qwen3_dir, device="cpu", dtype="float32") as llm:
        assert _outputs(llm) == expected["old"]
        answer = llm.update_weights_from_disk(qwen3_next_dir)
        assert answer["success"] is True and answer["weight_version"] == "1" and answer["seconds"] >= 0
        assert _outputs(llm) == expected["new"]
        assert llm.update_weights_from_disk(qwen3_dir, weight_version="v7")["weight_version"] == "v7"
        assert _outputs(llm) == expected["old"]
        # A checkpoint of another architecture: refused, naming a tensor; old weights in use.
        with pytest.raises(RuntimeError, match=r"model\.layers\.\d+\.|tensor"):
            llm.update_weights_from_disk(llama_dir)
        with pytest.raises(RuntimeError, match="not a directory"):
            llm.update_weights_from_disk(os.path.join(os.path.dirname(qwen3_dir), "nowhere"))
        outside = tmp_path.parent.parent  # above the session's base directory
        link = os.path.join(os.path.dirname(qwen3_dir), "link-out")
        os.symlink(str(outside), link)
        for path in ("/etc", os.path.join(qwen3_dir, "..", "..", ".."), link):
            with pytest.raises(PermissionError, match="allowed-model-dirs"):
                llm.update_weights_from_disk(path)
        os.unlink(link)
        assert _outputs(llm) == expected["old"]
        assert llm.get_server_info()["weight_version"] == "v7"


@pytest.fixture(scope="module")
def server(qwen3_dir: str, tmp_path_factory: pytest.TempPathFactory):
    log = str(tmp_path_factory.mktemp("logs") / "weights_server.log")
    proc = ServerProcess(qwen3_dir, "--max-model-len", "512", log_path=log)
    yield proc
    proc.stop()


def _generate(http: httpx.Client) -> list[list[int]]:
    body = {"input_ids": PROMPTS, "sampling_params": {"max_new_tokens": N, "temperature": 0, "ignore_eos": True}}
    return [o["output_ids"] for o in http.post("/generate", json=body).json()]


def test_http_update_from_disk(server: ServerProcess, qwen3_dir: str, qwen3_next_dir: str, expected) -> None:
    with server.client() as http:
        assert _generate(http) == expected["old"]
        r = http.post("/update_weights_from_disk", json={"model_path": qwen3_next_dir, "weight_version": "step-1"})
        assert r.status_code == 200 and r.json()["success"] is True and r.json()["weight_version"] == "step-1"
        assert _generate(http) == expected["new"]
        meta = http.post("/generate", json={"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 2}}).json()
        assert meta["meta_info"]["weight_version"] == "step-1"
        assert http.get("/get_model_info").json()["weight_version"] == "step-1"
        forbidden = http.post("/update_weights_from_disk", json={"model_path": "/etc"})
        assert forbidden.status_code == 403 and "allowed-model-dirs" in forbidden.json()["error"]["message"]
        missing = http.post("/update_weights_from_disk", json={"model_path": qwen3_dir + "-missing"})
        assert missing.status_code == 400
        assert http.post("/update_weights_from_disk", json={"model_path": qwen3_dir}).status_code == 200
        assert _generate(http) == expected["old"]


LONG = {"input_ids": [3, 4, 5], "sampling_params": {"max_new_tokens": 300, "temperature": 0, "ignore_eos": True}}


@pytest.mark.parametrize("abort", [False, True])
def test_update_while_a_request_streams(server: ServerProcess, qwen3_dir: str, abort: bool) -> None:
    events: list[dict] = []
    first = threading.Event()

    def stream() -> None:
        with httpx.stream("POST", f"{server.url}/generate", json=LONG | {"stream": True}, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[6:]))
                    first.set()

    streamer = threading.Thread(target=stream)
    streamer.start()
    assert first.wait(30)
    with server.client() as http:
        r = http.post("/update_weights_from_disk", json={"model_path": qwen3_dir, "abort_all_requests": abort})
        assert r.status_code == 200
        streamer.join(120)
        last = events[-1]["meta_info"]
        if abort:
            assert last["finish_reason"]["type"] == "abort" and last["completion_tokens"] < 300
        else:  # the update waited for the request, which finished on the old weights
            assert last["finish_reason"]["type"] == "length" and last["completion_tokens"] == 300
            assert last["weight_version"] != r.json()["weight_version"]
