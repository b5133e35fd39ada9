"""RL weight updates on the CPU: from disk and from tensors, through the Engine API and HTTP.
Checked: outputs after an update equal transformers (and a fresh engine) on the new weights; a bad
update names the bad tensor and leaves the old weights in use; paths outside the allowed
directories are refused; updates wait for (or abort) requests in flight."""

from __future__ import annotations

import os
import threading

import httpx
import pytest
import torch
from oracle import hf_named_parameters
from server_util import BackgroundStream, ServerProcess

from engine import Engine, SamplingParams
from engine.errors import Forbidden, InvalidRequest

PROMPTS = [[5, 9, 13, 200, 7], [7] * 20]
N = 12
GREEDY = SamplingParams(max_new_tokens=N, temperature=0.0, ignore_eos=True)


def _outputs(llm: Engine) -> list[list[int]]:
    return [o.output_ids for o in llm.generate(input_ids=PROMPTS, sampling_params=GREEDY)]


def test_update_from_disk(qwen3_dir: str, qwen3_next_dir: str, llama_dir: str, expected, tmp_path) -> None:
    assert expected["old"] != expected["new"]
    with Engine(model=qwen3_dir, device="cpu", dtype="float32") as llm:
        assert _outputs(llm) == expected["old"]
        answer = llm.update_weights_from_disk(qwen3_next_dir)
        # No weight_version named: the version stays (SGLang's).
        assert answer["success"] is True and answer["weight_version"] == "default" and answer["seconds"] >= 0
        assert _outputs(llm) == expected["new"]
        with Engine(model=qwen3_next_dir, device="cpu", dtype="float32") as fresh:
            assert _outputs(fresh) == expected["new"]  # as a fresh engine on the new weights
        assert llm.update_weights_from_disk(qwen3_dir, weight_version="v7")["weight_version"] == "v7"
        assert _outputs(llm) == expected["old"]
        # A checkpoint of another architecture: refused, naming a tensor; old weights in use.
        with pytest.raises(InvalidRequest, match=r"model\.layers\.\d+\.|tensor"):
            llm.update_weights_from_disk(llama_dir)
        with pytest.raises(InvalidRequest, match="not a directory"):
            llm.update_weights_from_disk(os.path.join(os.path.dirname(qwen3_dir), "nowhere"))
        outside = tmp_path.parent.parent  # above the session's base directory
        link = os.path.join(os.path.dirname(qwen3_dir), "link-out")
        os.symlink(str(outside), link)
        for path in ("/etc", os.path.join(qwen3_dir, "..", "..", ".."), link):
            with pytest.raises(Forbidden, match="allowed-model-dirs"):
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
    stream = BackgroundStream(server.url, LONG)
    assert stream.started()
    with server.client() as http:
        body = {"model_path": qwen3_dir, "abort_all_requests": abort, "weight_version": f"after-stream-{abort}"}
        r = http.post("/update_weights_from_disk", json=body)
        assert r.status_code == 200
        last = stream.join()
        if abort:
            assert last["finish_reason"]["type"] == "abort" and last["completion_tokens"] < 300
        else:  # the update waited for the request, which finished on the old weights
            assert last["finish_reason"]["type"] == "length" and last["completion_tokens"] == 300
            assert last["weight_version"] != r.json()["weight_version"]


def test_update_weight_version_renames_the_weights_in_use(server: ServerProcess, expected) -> None:
    """SGLang's /update_weight_version: outputs carry the new name, the weights stay as they are;
    with abort_all_requests the running request ends first."""
    stream = BackgroundStream(server.url, LONG)
    assert stream.started()
    with server.client() as http:
        before = _generate(http)
        r = http.post("/update_weight_version", json={"new_version": "base-0", "abort_all_requests": True})
        assert r.status_code == 200 and r.json() == {
            "success": True, "message": "weight version updated to base-0", "new_version": "base-0"}
        last = stream.join()
        assert last["finish_reason"]["type"] == "abort" and last["completion_tokens"] < 300
        assert http.get("/get_weight_version").json() == {"weight_version": "base-0"}
        out = http.post("/generate", json={"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 2}}).json()
        assert out["meta_info"]["weight_version"] == "base-0"
        assert _generate(http) == before
        assert http.post("/update_weight_version", json={"new_version": 7}).json()["new_version"] == "7"
        bad = http.post("/update_weight_version", json={"version": "x"})
        assert bad.status_code == 400 and "new_version" in bad.json()["error"]["message"]
        assert http.get("/get_weight_version").json() == {"weight_version": "7"}


def test_http_update_from_tensor(server: ServerProcess, qwen3_dir: str, qwen3_next_dir: str, expected) -> None:
    from engine.weights.payload import flatten_bucket, serialize_named_tensors, serialize_payload

    pairs = hf_named_parameters(qwen3_next_dir)
    name, tensor = pairs[3]
    with server.client() as http:
        http.post("/update_weights_from_disk", json={"model_path": qwen3_dir})
        bad_cases = [
            ([(name, tensor[:-1])], name),  # wrong shape
            ([("model.layers.0.mlp.nonsense.weight", tensor)], "nonsense"),  # unknown name
            ([(name, torch.ones(tensor.shape, dtype=torch.int32))], name),  # wrong dtype
        ]
        for bad, needle in bad_cases:
            r = http.post("/update_weights_from_tensor", json={"serialized_named_tensors": [serialize_named_tensors(bad)]})
            assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
        garbage = http.post("/update_weights_from_tensor", json={"serialized_named_tensors": ["not base64!"]})
        assert garbage.status_code == 400
        assert _generate(http) == expected["old"]  # every refused update left the old weights in use
        ok = http.post("/update_weights_from_tensor", json={"serialized_named_tensors": [serialize_named_tensors(pairs)]})
        assert ok.status_code == 200 and ok.json()["success"] is True
        answer = ok.json()  # where the time went, and the state the server renders its 503s from
        assert set(answer["seconds_by_phase"]) >= {"receive", "copy", "close_handles"}, answer
        assert sum(answer["seconds_by_phase"].values()) <= answer["seconds"] + 1e-3, answer
        assert answer["tags"] == dict.fromkeys(("weights", "kv_cache", "cuda_graph"), "resident")
        assert answer["weights_valid"] is True
        assert _generate(http) == expected["new"]
        http.post("/update_weights_from_disk", json={"model_path": qwen3_dir})
        bucket = serialize_payload(flatten_bucket(pairs))
        r = http.post("/update_weights_from_tensor", json={"serialized_named_tensors": [bucket], "load_format": "flattened_bucket"})
        assert r.status_code == 200, r.text
        assert _generate(http) == expected["new"]
        http.post("/update_weights_from_disk", json={"model_path": qwen3_dir})


def test_http_update_from_distributed(server: ServerProcess, qwen3_dir: str, qwen3_next_dir: str, expected) -> None:
    from server_util import free_port

    from engine.weights.groups import broadcast_from_trainer, trainer_group

    pairs = hf_named_parameters(qwen3_next_dir)
    port = free_port()
    group = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
             "group_name": "test-group", "backend": "gloo"}
    with server.client() as http:
        bad = http.post("/init_weights_update_group", json=group | {"world_size": 1})
        assert bad.status_code == 400 and "world_size" in bad.json()["error"]["message"]
        answers: list = []
        joiner = threading.Thread(target=lambda: answers.append(http.post("/init_weights_update_group", json=group)))
        joiner.start()
        handle = trainer_group("127.0.0.1", port, 2, "test-group", "gloo", timeout_s=60)
        joiner.join(60)
        assert answers[0].status_code == 200, answers[0].text
        meta = {"names": [n for n, _ in pairs], "dtypes": [str(t.dtype).replace("torch.", "") for _, t in pairs],
                "shapes": [list(t.shape) for _, t in pairs], "group_name": "test-group", "weight_version": "dist-1"}
        updater = threading.Thread(target=lambda: answers.append(http.post("/update_weights_from_distributed", json=meta)))
        updater.start()
        broadcast_from_trainer(handle, pairs)
        updater.join(60)
        assert answers[1].status_code == 200 and answers[1].json()["weight_version"] == "dist-1", answers[1].text
        assert _generate(http) == expected["new"]
        # The same (names, dtypes, shapes) again, as a trainer sends every step: the server reuses
        # its validation of the list, and the new bytes land; a changed list is checked afresh.
        updater = threading.Thread(target=lambda: answers.append(http.post("/update_weights_from_distributed", json=meta)))
        updater.start()
        broadcast_from_trainer(handle, hf_named_parameters(qwen3_dir))
        updater.join(60)
        assert answers[2].status_code == 200, answers[2].text
        assert _generate(http) == expected["old"]
        bad_shape = meta | {"shapes": [[7, *meta["shapes"][0]], *meta["shapes"][1:]]}
        refused = http.post("/update_weights_from_distributed", json=bad_shape)
        assert refused.status_code == 400 and meta["names"][0] in refused.json()["error"]["message"], refused.text
        assert _generate(http) == expected["old"]
        # SGLang's flattened bucket: the same list, the bytes in one broadcast.
        bucket = meta | {"load_format": "flattened_bucket", "weight_version": "dist-bucket"}
        updater = threading.Thread(target=lambda: answers.append(http.post("/update_weights_from_distributed", json=bucket)))
        updater.start()
        broadcast_from_trainer(handle, pairs, "flattened_bucket")
        updater.join(60)
        assert answers[3].status_code == 200 and answers[3].json()["weight_version"] == "dist-bucket", answers[3].text
        assert _generate(http) == expected["new"]
        bogus = http.post("/update_weights_from_distributed", json=meta | {"load_format": "safetensors"})
        assert bogus.status_code == 400 and "load_format" in bogus.json()["error"]["message"], bogus.text
        assert _generate(http) == expected["new"]
        unknown = http.post("/update_weights_from_distributed", json=meta | {"group_name": "nope"})
        assert unknown.status_code == 400 and "nope" in unknown.json()["error"]["message"]
        assert http.post("/destroy_weights_update_group", json={"group_name": "test-group"}).status_code == 200
        assert http.post("/destroy_weights_update_group", json={"group_name": "test-group"}).status_code == 400
        http.post("/update_weights_from_disk", json={"model_path": qwen3_dir})
        assert _generate(http) == expected["old"]


def test_update_while_paused_and_while_kv_released(server: ServerProcess, qwen3_dir: str, qwen3_next_dir: str, expected) -> None:
    """How slime and verl call it: pause (or release the KV cache), update, then go on."""
    stream = BackgroundStream(server.url, LONG)
    assert stream.started()
    with server.client() as http:
        assert http.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
        r = http.post("/update_weights_from_disk", json={"model_path": qwen3_dir}, timeout=10)  # no wait while paused
        assert r.status_code == 200
        assert http.post("/continue_generation").status_code == 200
        assert stream.join()["completion_tokens"] == 300
        assert http.post("/release_memory_occupation", json={"tags": ["kv_cache"]}).status_code == 200
        assert http.post("/update_weights_from_disk", json={"model_path": qwen3_next_dir}).status_code == 200
        assert http.post("/resume_memory_occupation", json={"tags": ["kv_cache"]}).status_code == 200
        assert _generate(http) == expected["new"]
        http.post("/release_memory_occupation", json={"tags": ["weights"]})
        refused = http.post("/update_weights_from_disk", json={"model_path": qwen3_dir})
        assert refused.status_code == 400 and "resume" in refused.json()["error"]["message"]
        http.post("/resume_memory_occupation")
        assert http.post("/update_weights_from_disk", json={"model_path": qwen3_dir}).status_code == 200
        assert _generate(http) == expected["old"]


def _mapped_files(pid: int) -> str:
    with open(f"/proc/{pid}/maps") as f:
        return f.read()


def test_a_pushed_tensor_is_let_go_when_its_answer_comes(qwen3_dir: str, qwen3_next_dir: str, expected) -> None:
    """The engine drops the tensors of a push, refused or accepted, before it answers: a trainer
    may free or reuse them at once. Garbage collection runs in the engine process only on its own
    schedule, so a reference kept by an exception's traceback would show here (CPU tensors travel
    as shared-memory files; the engine maps each one while it holds the tensor)."""
    from engine.weights.payload import serialize_named_tensors

    pairs = hf_named_parameters(qwen3_next_dir)
    bad = [*pairs[:-1], (pairs[-1][0], pairs[-1][1][:-1].clone())]  # the last one a row short
    with Engine(model=qwen3_dir, device="cpu", dtype="float32") as llm:
        pid = llm._core.pid
        assert pid is not None and os.path.exists(f"/proc/{pid}/maps")
        for push, accepted, outputs in ((bad, False, "old"), (pairs, True, "new"), (bad, False, "new")):
            payload = serialize_named_tensors(push)
            files = {t.untyped_storage()._share_filename_cpu_()[1].decode() for _, t in push}
            if accepted:
                assert llm.update_weights_from_tensor([payload])["success"]
            else:
                with pytest.raises(InvalidRequest, match=push[-1][0]):
                    llm.update_weights_from_tensor([payload])
            held = [f for f in files if f in _mapped_files(pid)]
            assert not held, f"the engine still maps {len(held)} of the push's {len(files)} tensors"
            assert _outputs(llm) == expected[outputs]
