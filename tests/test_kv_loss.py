"""Nothing is computed from lost KV (issue 72). On a CPU a release poisons what a GPU release
loses (engine/memory/poison.py), so a stale read shows here as wrong tokens. Checked: a release
sets back the requests holding KV and they end with the reference tokens; an update under an
in_place pause leaves no old KV in the prefix cache; calls take effect in the order they arrive
(a resume sent after a release finds it done); the storm of concurrent control calls."""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest
import torch
from server_util import BackgroundStream, ServerProcess, logged_server

from engine.memory.regions import MemoryRegions

N = 24
# Two prompts of three full KV blocks and some: a prefix hit would cover most of each.
_rng = random.Random(72)
PROMPTS = [[_rng.randrange(3, 500) for _ in range(50)] for _ in range(2)]
GREEDY = {"max_new_tokens": N, "temperature": 0, "ignore_eos": True}


def test_a_cpu_release_poisons_what_its_tags_hold() -> None:
    regions = MemoryRegions(torch.device("cpu"), enabled=True)
    kv, graph, counts = torch.zeros(4, 8), torch.ones(3), torch.zeros(2, dtype=torch.int32)
    regions.holds("kv_cache", lambda: [kv])
    regions.holds("cuda_graph", lambda: [graph, counts])
    assert regions.poison_at == "release"
    regions.release(["kv_cache"])
    assert kv.isnan().all() and (graph == 1).all()
    regions.resume(["kv_cache"])
    regions.release(["cuda_graph"])
    assert graph.isnan().all() and (counts == -1).all()


@pytest.fixture(scope="module")
def server(qwen3_dir: str, tmp_path_factory: pytest.TempPathFactory):
    proc = logged_server(qwen3_dir, str(tmp_path_factory.mktemp("logs")), "kv_loss_server")
    yield proc
    proc.stop()


def _generate(http: httpx.Client, prompts: list[list[int]] = PROMPTS, **params: object) -> list[list[int]]:
    r = http.post("/generate", json={"input_ids": prompts, "sampling_params": GREEDY | params})
    assert r.status_code == 200, r.text
    return [o["output_ids"] for o in r.json()]


def test_a_request_held_across_a_release_recomputes_and_ends_as_the_reference(server: ServerProcess, expected) -> None:
    """A paused request is set back when the KV cache goes; after resume and continue it
    recomputes from its tokens (prompt plus output so far) and ends with the reference, its
    seeded sampling state carried on."""
    seeded = {"input_ids": PROMPTS[1], "sampling_params": GREEDY | {"temperature": 0.9, "seed": 5, "max_new_tokens": 400}}
    with server.client() as http:
        undisturbed = http.post("/generate", json=seeded).json()["output_ids"]
        for body in ({"input_ids": PROMPTS[0], "sampling_params": GREEDY | {"max_new_tokens": 400}}, seeded):
            stream = BackgroundStream(server.url, body)
            assert stream.started()
            for mode in ("in_place", "retract"):
                paused = http.post("/pause_generation", json={"mode": mode}).json()
                assert paused["num_running"] + paused["num_waiting"] == 1, f"the request ended before the pause: {paused}"
                assert http.post("/release_memory_occupation", json={"tags": ["kv_cache"]}).status_code == 200
                assert http.post("/resume_memory_occupation", json={"tags": ["kv_cache"]}).status_code == 200
                assert http.post("/continue_generation").status_code == 200
            out = stream.wait()[-1]["output_ids"]
            if body is seeded:
                assert out == undisturbed
            else:
                assert len(out) == 400 and out[:N] == expected["old"][0]
        assert _generate(http) == expected["old"]


def test_an_update_under_an_in_place_pause_leaves_no_old_kv_to_share(server: ServerProcess, qwen3_dir: str,
                                                                       qwen3_next_dir: str, expected) -> None:
    """The paused request keeps its KV on purpose (SGLang's in_place), but a new request with the
    same prompt must not read it: it gets the new weights' tokens."""
    with server.client() as http:
        stream = BackgroundStream(server.url, {"input_ids": PROMPTS[0], "sampling_params": GREEDY | {"max_new_tokens": 300}})
        assert stream.started()
        assert http.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
        assert http.post("/update_weights_from_disk", json={"model_path": qwen3_next_dir}).status_code == 200
        assert http.post("/continue_generation").status_code == 200
        assert _generate(http) == expected["new"]
        stream.wait()
        assert http.post("/update_weights_from_disk", json={"model_path": qwen3_dir}).status_code == 200
        assert _generate(http) == expected["old"]


def test_calls_take_effect_in_the_order_they_arrive(server: ServerProcess) -> None:
    """A release that waits for a request holds the calls sent after it: the resume sent next
    finds the memory released and brings it back."""
    long = {"input_ids": PROMPTS[0], "sampling_params": GREEDY | {"max_new_tokens": 300}}
    stream = BackgroundStream(server.url, long)
    assert stream.started()

    async def release_then_resume() -> tuple[dict, dict]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
            release = asyncio.create_task(http.post("/release_memory_occupation", json={}))
            await asyncio.sleep(0.3)  # the release is waiting for the stream
            resume = await http.post("/resume_memory_occupation", json={})
            return (await release).json(), resume.json()

    released, resumed = asyncio.run(release_then_resume())
    assert stream.join()["completion_tokens"] == 300  # the release waited for it
    assert released["changed"] == ["kv_cache", "weights", "cuda_graph"]
    assert resumed["changed"] == ["cuda_graph", "weights", "kv_cache"], resumed
    with server.client() as http:
        assert set(http.get("/memory_occupation").json()["tags"][t]["state"] for t in released["tags"]) == {"resident"}


def test_a_storm_of_control_calls_leaves_every_output_right(server: ServerProcess, expected) -> None:
    """Issue 72's storm: 10 releases, 10 resumes, 10 generates and 10 flushes at once. Every
    answer is 200, or 503 for a generate that met released memory, or 400 for a flush that met
    requests; every generate answered equals the reference, and so does everything after."""

    async def storm(http: httpx.AsyncClient) -> list[httpx.Response]:
        calls = [http.post("/release_memory_occupation", json={}) for _ in range(10)]
        calls += [http.post("/resume_memory_occupation", json={}) for _ in range(10)]
        calls += [http.post("/generate", json={"input_ids": PROMPTS, "sampling_params": GREEDY}) for _ in range(10)]
        calls += [http.post("/flush_cache") for _ in range(10)]
        return await asyncio.gather(*calls)

    async def trials() -> list[list[httpx.Response]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
            return [await storm(http) for _ in range(2)]

    with server.client() as http:
        assert _generate(http) == expected["old"]
        for answers in asyncio.run(trials()):
            assert all(r.status_code == 200 for r in answers[:20]), [r.text for r in answers[:20] if r.status_code != 200]
            for r in answers[20:30]:
                assert r.status_code in (200, 503), r.text
                if r.status_code == 200:
                    assert [o["output_ids"] for o in r.json()] == expected["old"]
            assert all(r.status_code in (200, 400) for r in answers[30:])
            http.post("/resume_memory_occupation", json={})
            assert _generate(http) == expected["old"]


def test_a_release_while_a_tag_is_out_does_not_wait_for_requests_that_cannot_run(server: ServerProcess, expected) -> None:
    """A request queued while `weights` is released cannot run; a later release of `kv_cache`
    (mode wait) must not wait for it, or every call behind it would wait too. The request stays
    queued and, once everything is back, ends as the reference."""
    stream = BackgroundStream(server.url, {"input_ids": PROMPTS[0], "sampling_params": GREEDY | {"max_new_tokens": 400}})
    assert stream.started()
    with server.client() as http:
        assert http.post("/pause_generation", json={"mode": "retract"}).status_code == 200
        assert http.post("/release_memory_occupation", json={"tags": ["weights"]}).status_code == 200
        assert http.post("/continue_generation").status_code == 200
        r = http.post("/release_memory_occupation", json={"tags": ["kv_cache"]}, timeout=30)
        assert r.status_code == 200 and r.json()["changed"] == ["kv_cache"], r.text
        assert http.post("/resume_memory_occupation", json={}).status_code == 200
    out = stream.wait()[-1]["output_ids"]
    assert len(out) == 400 and out[:N] == expected["old"][0]
