"""Control calls as typed messages (engine/core/calls.py) and availability owned by the engine
(engine/core/availability.py): every call has one handler and one reply type, the HTTP bodies and
the calls agree field for field, every reply carries the engine's state to the client, and the
server answers from that state without deriving it again."""

from __future__ import annotations

import threading
import time
import typing

import msgspec
import pytest
from pydantic import BaseModel
from server_util import BackgroundStream, ServerProcess

from engine import Engine, InvalidRequest, SamplingParams
from engine.core import calls
from engine.core.engine_core import _HANDLERS
from server import profile_api, schemas, weight_checks_api, weights_api

GREEDY = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
LONG = {"input_ids": [3, 4, 5], "sampling_params": {"max_new_tokens": 300, "temperature": 0, "ignore_eos": True}}


@pytest.fixture(scope="module")
def server(demo_dir: str, tmp_path_factory: pytest.TempPathFactory):
    log = str(tmp_path_factory.mktemp("logs") / "control_server.log")
    proc = ServerProcess(demo_dir, "--max-model-len", "512", log_path=log)
    yield proc
    proc.stop()


def test_every_call_has_one_handler_and_a_reply_type() -> None:
    union = set(typing.get_args(calls.ControlCall))
    defined = {c for c in vars(calls).values() if isinstance(c, type) and issubclass(c, calls.Call) and c is not calls.Call}
    assert union == defined == set(_HANDLERS)
    tags = [msgspec.inspect.type_info(c).tag for c in union]
    assert len(set(tags)) == len(tags)
    # Only reports run with a step in flight.
    assert {c for c in union if c.read_only} == {calls.Ping, calls.GetInfo, calls.GetLoad, calls.GetMemoryOccupation}


# Call fields only vLLM's routes set (server/vllm_api.py: /pause's clear_cache, /sleep's level 2;
# server/vllm_weights_api.py: prime-rl's /init_broadcaster timeout).
VLLM_ONLY = {"clear_cache", "discard_weights", "timeout_s"}


@pytest.mark.parametrize(("body", "call"), [
    (schemas.PauseGenerationIn, calls.PauseGeneration),
    (schemas.ReleaseMemoryIn, calls.ReleaseMemory),
    (schemas.ResumeMemoryIn, calls.ResumeMemory),
    (weights_api.InitGroupIn, calls.InitWeightsUpdateGroup),
    (weights_api.DestroyGroupIn, calls.DestroyWeightsUpdateGroup),
    (weight_checks_api.CheckWeightsIn, calls.CheckWeights),
    (profile_api.ProfileIn, calls.StartProfile),
])
def test_route_bodies_and_calls_agree_field_for_field(body: type[BaseModel], call: type[calls.Call]) -> None:
    """A route builds its call from its validated body as it is: same names, same defaults."""
    fields = {f.name: None if f.required else f.default for f in msgspec.structs.fields(call)
              if f.name != "call_id" and f.name not in VLLM_ONLY}
    accepted = {n: None if f.is_required() else f.default for n, f in body.model_fields.items()
                if n != "profile_stages"}  # SGLang's, accepted and ignored
    assert accepted == fields
    required = {f.name for f in msgspec.structs.fields(call) if f.required}
    assert required == {n for n, f in body.model_fields.items() if f.is_required()}


def test_routes_that_decode_into_their_call_publish_its_schema(server: ServerProcess) -> None:
    """The weight-update routes decode their JSON straight into the call: their OpenAPI body is the
    call's schema, and a body that does not fit it is a 400 naming the field."""
    with server.client() as http:
        paths = http.get("/openapi.json").json()["paths"]
        for path, call in [("/update_weights_from_disk", calls.UpdateWeightsFromDisk),
                           ("/update_weights_from_tensor", calls.UpdateWeightsFromTensor),
                           ("/update_weights_from_distributed", calls.UpdateWeightsFromDistributed)]:
            schema = paths[path]["post"]["requestBody"]["content"]["application/json"]["schema"]
            fields = {f.name for f in msgspec.structs.fields(call)} - {"call_id"}
            assert set(schema["properties"]) == fields, path
            assert set(schema["required"]) == {f.name for f in msgspec.structs.fields(call) if f.required}, path
        bad = http.post("/update_weights_from_distributed", json={"names": ["a"], "dtypes": ["bfloat16"], "shapes": [[2**64]]})
        assert bad.status_code == 400 and "$.shapes[0][0]" in bad.json()["error"]["message"]
        bad = http.post("/update_weights_from_disk", json={"model_path": "x", "weight_version": True})
        assert bad.status_code == 400 and "weight_version" in bad.json()["error"]["message"]
        assert http.post("/update_weights_from_tensor", content=b"{").status_code == 400


def test_engine_state_rides_on_every_reply(demo_dir: str, tmp_path) -> None:
    with Engine(model=demo_dir, device="cpu", dtype="float32") as llm:
        state = llm.state
        assert state.unavailable is None and set(state.tags.values()) == {"resident"} and state.weight_version == "default"
        llm.release_memory_occupation(["kv_cache"])
        assert llm.state.tags["kv_cache"] == "released" and "kv_cache" in llm.state.unavailable
        # A refused call answers with the state too: still released.
        with pytest.raises(InvalidRequest, match="valid tags"):
            llm.release_memory_occupation(["vram"])
        assert "kv_cache" in llm.state.unavailable
        refused = llm.generate(input_ids=[[5, 6, 7]], sampling_params=GREEDY)[0]
        assert refused.unavailable and refused.error == llm.state.unavailable
        llm.resume_memory_occupation(None)
        assert llm.state.unavailable is None
        llm.pause_generation("in_place")
        assert llm.state.paused
        assert llm.update_weights_from_disk(demo_dir, weight_version="v2")["weight_version"] == "v2"
        assert llm.state.weight_version == "v2" and not llm.state.updating  # an update while paused runs at once
        llm.continue_generation()
        assert not llm.state.paused
        assert len(llm.generate(input_ids=[[5, 6, 7]], sampling_params=GREEDY)[0].output_ids) == 4
        # Calls are checked by type in the caller's process, before the engine sees them.
        with pytest.raises(InvalidRequest, match="weight_version"):
            llm.update_weights_from_disk(demo_dir, weight_version=[3])
        assert llm.get_server_info()["weight_version"] == "v2"


def test_the_server_answers_from_the_engines_state(server: ServerProcess) -> None:
    """A release in wait mode: the engine drains at once (new requests 503 "being released"), the
    server learns it from the next reply and renders it; afterwards it says which tags are out."""
    stream = BackgroundStream(server.url, LONG)
    assert stream.started()
    with server.client() as http:
        released: list = []
        releaser = threading.Thread(target=lambda: released.append(http.post("/release_memory_occupation", json={"tags": ["kv_cache"]})))
        releaser.start()
        deadline = time.monotonic() + 30
        while not (state := http.get("/get_server_info").json()["engine_state"])["draining"]:
            assert time.monotonic() < deadline and releaser.is_alive(), "the release never started draining"
            time.sleep(0.02)
        assert state["unavailable"] == "memory is being released" and state["tags"]["kv_cache"] == "resident"
        refused = http.post("/generate", json=LONG)
        assert refused.status_code == 503 and refused.json()["error"]["message"] == "memory is being released"
        assert stream.join()["completion_tokens"] == 300  # wait mode: the running request finished
        releaser.join(60)
        assert released[0].status_code == 200 and released[0].json()["changed"] == ["kv_cache"]
        state = http.get("/get_server_info").json()["engine_state"]
        assert not state["draining"] and state["tags"]["kv_cache"] == "released"
        refused = http.post("/generate", json=LONG)
        assert refused.status_code == 503 and refused.json()["error"]["message"] == state["unavailable"]
        assert "kv_cache" in state["unavailable"]
        assert http.post("/resume_memory_occupation", json={"tags": ["kv_cache"]}).status_code == 200
        assert http.get("/get_server_info").json()["engine_state"]["unavailable"] is None
        assert http.post("/generate", json=LONG | {"sampling_params": {"max_new_tokens": 2}}).status_code == 200
