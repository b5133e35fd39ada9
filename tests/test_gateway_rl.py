"""The RL control plane through the real SGLang Model Gateway (`--enable-rl`): two real Siesta
servers, every call fanned out by `/v1/rl/engine/<route>?selector=engine=sglang` or made per worker
by `/v1/rl/workers/<id>/engine/<route>`, with per-worker results.

- release and resume act on both replicas;
- each of the three weight updates (disk, tensor, distributed) leaves both replicas generating
  what a fresh server on the new checkpoint generates;
- the weight version: every reply carries the replica's own; the gateway's label is read once at
  registration, so the trainer patches it (`PATCH /workers/<id>`) and selectors then see it;
- smg's own RL client (`smg.rl.RL.fanout`, `smg.rl.paused`) pauses both, flushes their caches and
  lets them continue.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator

import pytest
from gateway_util import Gateway, replicas
from server_util import ServerProcess, free_port

pytest.importorskip("smg")

PROMPTS = ["apple is where this prompt starts", "zebra is where this prompt starts"]
GREEDY = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def pair(qwen3_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gateway, list[ServerProcess]]]:
    with replicas(qwen3_dir, str(tmp_path_factory.mktemp("gateway-rl"))) as both:
        yield both


@pytest.fixture(scope="module")
def new_weights(qwen3_next_dir: str) -> tuple[str, list[list[int]]]:
    """Another checkpoint of the same shape, and what a fresh server on it generates for PROMPTS."""
    new_dir = qwen3_next_dir
    fresh = ServerProcess(new_dir, "--max-model-len", "512", log_path=os.devnull)
    try:
        with fresh.client() as http:
            return new_dir, [http.post("/generate", json={"text": p, "sampling_params": GREEDY}).json()["output_ids"] for p in PROMPTS]
    finally:
        fresh.stop()


def _outputs(url: str) -> list[list[int]]:
    """PROMPTS' greedy outputs from the server (or gateway) at `url`."""
    import httpx

    with httpx.Client(base_url=url, timeout=60) as http:
        return [http.post("/generate", json={"text": p, "sampling_params": GREEDY}).json()["output_ids"] for p in PROMPTS]


def _assert_both_generate(gateway: Gateway, servers: list[ServerProcess], want: list[list[int]]) -> None:
    assert _outputs(gateway.url) == want
    for s in servers:  # each replica itself, not only those the gateway picked
        assert _outputs(s.url) == want


def _reset(gateway: Gateway, model_dir: str) -> list[list[int]]:
    """Both replicas back on `model_dir`; their outputs on it (through the gateway)."""
    assert gateway.fanout("update_weights_from_disk", {"model_path": model_dir})["succeeded"] == 2
    return _outputs(gateway.url)


def test_release_resume_and_update_from_disk_fan_out_to_both(pair, new_weights) -> None:
    gateway, servers = pair
    new_dir, want = new_weights
    assert _outputs(gateway.url) != want
    released = gateway.fanout("release_memory_occupation", {})
    assert released["total"] == 2 and released["succeeded"] == 2 and not released["failed"]
    for s in servers:
        with s.client() as http:
            assert http.get("/server_info").json()["memory"] == "released"
    assert gateway.fanout("resume_memory_occupation", {})["succeeded"] == 2
    for s in servers:
        with s.client() as http:
            assert http.get("/server_info").json()["memory"] == "resident"

    updated = gateway.fanout("update_weights_from_disk", {"model_path": new_dir, "weight_version": "v2"})
    assert updated["succeeded"] == 2
    assert all(r["body"]["success"] and r["body"]["weight_version"] == "v2" for r in updated["results"].values())
    _assert_both_generate(gateway, servers, want)
    r = gateway.generate(PROMPTS[0])
    assert r.json()["meta_info"]["weight_version"] == "v2"


def test_update_from_tensor_fans_one_payload_out_to_both(pair, new_weights, qwen3_dir: str) -> None:
    """On the CPU the payload names shared-memory files, so both replicas read the trainer's
    tensors from the same pages (on GPUs each replica needs its own payload: CUDA IPC)."""
    from oracle import hf_named_parameters

    from engine.weights.payload import serialize_named_tensors

    gateway, servers = pair
    new_dir, want = new_weights
    assert _reset(gateway, qwen3_dir) != want
    pairs = hf_named_parameters(new_dir)
    body = {"serialized_named_tensors": [serialize_named_tensors(pairs)], "flush_cache": True, "weight_version": "t1"}
    updated = gateway.fanout("update_weights_from_tensor", body)
    assert updated["succeeded"] == 2 and {r["body"]["weight_version"] for r in updated["results"].values()} == {"t1"}
    _assert_both_generate(gateway, servers, want)


def test_update_from_distributed_joins_both_replicas_to_one_group(pair, new_weights, qwen3_dir: str) -> None:
    """slime's layout: the trainer is rank 0, replica i joins as rank 1 + i (one call per worker,
    since the bodies differ), then one fanned-out update receives the trainer's broadcast."""
    from oracle import hf_named_parameters
    from smg.rl import RL

    from engine.weights.groups import broadcast_from_trainer, trainer_group

    gateway, servers = pair
    new_dir, want = new_weights
    assert _reset(gateway, qwen3_dir) != want
    rl = RL(gateway.url, timeout=120.0)
    workers = sorted(rl.workers(), key=lambda w: w.url)
    port = free_port()
    group = {"master_address": "127.0.0.1", "master_port": port, "world_size": 1 + len(workers),
             "group_name": "rollout", "backend": "gloo"}
    joined: list = []
    joiners = [threading.Thread(target=lambda i=i, w=w: joined.append(
        rl.call(w.id, "init_weights_update_group", group | {"rank_offset": 1 + i}))) for i, w in enumerate(workers)]
    for t in joiners:
        t.start()
    handle = trainer_group("127.0.0.1", port, 1 + len(workers), "rollout", "gloo", timeout_s=60)
    for t in joiners:
        t.join(60)
    assert sorted(r.body["message"] for r in joined) == ["joined group 'rollout' as rank 1 of 3", "joined group 'rollout' as rank 2 of 3"]

    pairs = hf_named_parameters(new_dir)
    meta = {"names": [n for n, _ in pairs], "dtypes": ["float32"] * len(pairs), "shapes": [list(t.shape) for _, t in pairs],
            "group_name": "rollout", "weight_version": "d1"}
    answers: list = []
    updater = threading.Thread(target=lambda: answers.append(rl.fanout("update_weights_from_distributed", meta, selector="engine=sglang")))
    updater.start()
    broadcast_from_trainer(handle, pairs)
    updater.join(60)
    assert answers and answers[0].succeeded == 2
    assert {r.body["weight_version"] for r in answers[0].results.values()} == {"d1"}
    _assert_both_generate(gateway, servers, want)
    left = rl.fanout("destroy_weights_update_group", {"group_name": "rollout"}, selector="engine=sglang")
    assert left.succeeded == 2


def test_the_readme_rl_step(pair, new_weights, qwen3_dir: str) -> None:
    """README's "More than one GPU" RL step through smg's client, as written there."""
    import httpx
    from smg.rl import RL, paused

    gateway_, servers = pair
    new_dir, want = new_weights
    assert _reset(gateway_, qwen3_dir) != want
    gateway, every, ckpt = gateway_.url, "engine=sglang", new_dir
    rl = RL(gateway)
    with paused(rl, every, mode="abort"):
        released = rl.fanout("release_memory_occupation", {}, selector=every)
        assert released.succeeded == 2
        assert all(set(r.body["tags"].values()) == {"released"} for r in released.results.values())
        rl.fanout("resume_memory_occupation", {"tags": ["weights"]}, selector=every)
        rl.fanout("update_weights_from_disk", {"model_path": ckpt, "weight_version": "42"}, selector=every)
        rl.fanout("resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]}, selector=every)
    for w in rl.workers():
        httpx.patch(f"{gateway}/workers/{w.id}", json={"labels": {"weight_version": "42"}})
    _assert_both_generate(gateway_, servers, want)
    assert gateway_.generate(PROMPTS[0]).json()["meta_info"]["weight_version"] == "42"
    deadline = time.monotonic() + 10  # the gateway applies a patch in the background
    while time.monotonic() < deadline and {w.weight_version for w in rl.workers()} != {"42"}:
        time.sleep(0.1)
    assert {w.weight_version for w in rl.workers()} == {"42"}


def test_the_trainer_syncs_the_gateways_weight_version_label(pair) -> None:
    """smg reads `weight_version` from /server_info once, at registration. After a fanned-out
    update_weight_version every replica answers the new one at once; the gateway's own label
    follows a PATCH, and label selectors match on it from then on."""
    gateway, servers = pair
    renamed = gateway.fanout("update_weight_version", {"new_version": "step-5"})
    assert {r["body"]["new_version"] for r in renamed["results"].values()} == {"step-5"}
    versions = gateway.http.get("/v1/rl/engine/get_weight_version", params={"selector": "engine=sglang"}).json()
    assert {r["body"]["weight_version"] for r in versions["results"].values()} == {"step-5"}
    assert gateway.generate("which weights?").json()["meta_info"]["weight_version"] == "step-5"
    assert "step-5" not in {w["weight_version"] for w in gateway.workers().values()}  # not refreshed by smg
    for w in gateway.workers().values():
        assert gateway.http.patch(f"/workers/{w['id']}", json={"labels": {"weight_version": "step-5"}}).status_code == 202
    deadline = time.monotonic() + 10  # the gateway applies a patch in the background
    while time.monotonic() < deadline and {w["weight_version"] for w in gateway.workers().values()} != {"step-5"}:
        time.sleep(0.1)
    assert {w["weight_version"] for w in gateway.workers().values()} == {"step-5"}
    r = gateway.http.post("/v1/rl/engine/flush_cache", params={"selector": "weight_version=step-5"}, json={})
    assert r.status_code == 200 and r.json()["succeeded"] == 2


def test_smg_rl_client_pauses_flushes_and_continues_both(pair) -> None:
    """smg's own Python client (`smg.rl.RL`, `smg.rl.paused`), as a trainer drives a refit."""
    from smg.rl import RL, paused

    gateway, servers = pair

    def paused_flags() -> list[bool]:
        flags = []
        for s in servers:
            with s.client() as http:
                flags.append(http.get("/server_info").json()["paused"])
        return flags

    rl = RL(gateway.url, timeout=60.0)
    assert {w.url for w in rl.workers()} == {s.url for s in servers}
    with paused(rl, "engine=sglang", mode="abort") as pause:
        assert pause.succeeded == 2 and not pause.failed
        assert paused_flags() == [True, True]
        flushed = rl.fanout("flush_cache", {}, selector="engine=sglang")
        assert flushed.succeeded == 2
        assert all(r.status == 200 and r.body["success"] for r in flushed.results.values())
    assert paused_flags() == [False, False]
    r = gateway.generate("after the pause")
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 4
