"""What a colocated trainer does to the server, on real servers over loopback (CPU): the engine
process dies, a trainer dies in the middle of a weight push, control calls pile up while
requests run, a resume is asked to wait for memory. Nothing may hang, answer 500, or change the
outputs. The device-memory half (a resume while a trainer holds the GPU) is
tests/test_gpu_memory.py::test_resume_while_a_trainer_holds_the_memory."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import httpx
import pytest
from server_util import BackgroundStream, ServerProcess, free_port

from engine.memory.regions import RESUME_HEADROOM, resume_plan

GREEDY = {"input_ids": [5, 9, 13, 200], "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}}
LONG = {"input_ids": [3, 4, 5], "sampling_params": {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True}}
GIB = 1 << 30


# ---- the engine process dies --------------------------------------------------------------------

CALLS_AFTER_DEATH = [
    ("GET", "/health", None),
    ("GET", "/get_server_info", None),
    ("GET", "/get_model_info", None),
    ("GET", "/memory_occupation", None),
    ("GET", "/metrics", None),
    ("POST", "/generate", GREEDY),
    ("POST", "/generate", GREEDY | {"stream": True}),
    ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2, "stream": True}),
    ("POST", "/release_memory_occupation", {"tags": None}),
    ("POST", "/resume_memory_occupation", {}),
    ("POST", "/flush_cache", {}),
    ("POST", "/abort_request", {"rid": "nobody"}),
    ("POST", "/pause_generation", {"mode": "in_place"}),
]


def test_dead_engine_every_call_is_503_within_a_second(demo_dir: str) -> None:
    server = ServerProcess(demo_dir, "--max-model-len", "512")
    try:
        pid = httpx.get(f"{server.url}/get_server_info").json()["engine_pid"]
        stream = BackgroundStream(server.url, LONG)
        assert stream.started()
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        with httpx.Client(base_url=server.url, timeout=2.0) as http:
            for method, path, body in CALLS_AFTER_DEATH:
                t0 = time.monotonic()
                r = http.request(method, path, json=body)
                took = time.monotonic() - t0
                assert r.status_code == 503, (path, r.status_code, r.text)
                assert took < 1.0, (path, took)
                assert r.json()["error"]["type"] == "service_unavailable", path
        # The request that was running when the engine died ends with an error event, not a hang.
        stream._thread.join(5)
        assert not stream._thread.is_alive()
        # Then the server exits non-zero so that a supervisor restarts it.
        server.proc.wait(timeout=10 - (time.monotonic() - killed))
        assert server.proc.returncode not in (0, None)
    finally:
        server.stop()


def test_dead_engine_blocking_api_raises_at_once(demo_dir: str) -> None:
    from engine import Engine, EngineDeadError

    with Engine(model=demo_dir, device="cpu", dtype="float32") as llm:
        os.kill(llm._core.process.pid, signal.SIGKILL)
        llm._core.process.join(5)
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError):
            llm.resume_memory_occupation()
        with pytest.raises(EngineDeadError):
            llm.generate(input_ids=[[1, 2, 3]])
        assert time.monotonic() - t0 < 1.0


# ---- many control calls while requests run --------------------------------------------------------


@pytest.fixture(scope="module")
def server(demo_dir: str, tmp_path_factory: pytest.TempPathFactory):
    log = str(tmp_path_factory.mktemp("logs") / "faults_server.log")
    proc = ServerProcess(demo_dir, "--max-model-len", "512", log_path=log)
    yield proc
    proc.stop()


CONTROL_MIX = [
    ("/release_memory_occupation", {"tags": ["kv_cache"]}),
    ("/resume_memory_occupation", {"tags": ["kv_cache"]}),
    ("/release_memory_occupation", {"tags": None, "mode": "abort"}),
    ("/resume_memory_occupation", {}),
    ("/pause_generation", {"mode": "retract"}),
    ("/continue_generation", {}),
    ("/pause_generation", {"mode": "in_place"}),
    ("/continue_generation", {}),
    ("/flush_cache", {}),
    ("/abort_request", {"rid": "nobody"}),
]


def test_forty_control_calls_mixed_with_generates(server: ServerProcess) -> None:
    """40 control calls from 8 threads with 24 generates in between: every answer is one of the
    expected codes (never 500), every generate ends, and once the dust settles the outputs are
    those from before."""
    with server.client() as http:
        before = http.post("/generate", json=GREEDY).json()["output_ids"]
    calls = [CONTROL_MIX[i % len(CONTROL_MIX)] for i in range(40)]
    gens = [GREEDY if i % 2 else LONG for i in range(24)]

    # A release waits for the requests it accepted: on a loaded 2-core machine a call can take minutes.
    def control(call: tuple[str, dict]) -> int:
        with httpx.Client(base_url=server.url, timeout=300) as http:
            return http.post(call[0], json=call[1]).status_code

    def generate(body: dict) -> tuple[int, dict]:
        with httpx.Client(base_url=server.url, timeout=300) as http:
            r = http.post("/generate", json=body)
            return r.status_code, r.json()

    try:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            gen_futures = [pool.submit(generate, g) for g in gens]
            control_codes = list(pool.map(control, calls))
            gen_results = [f.result(timeout=600) for f in gen_futures]
    finally:  # the module's server goes back to its state for the tests after this one, whatever happened
        with httpx.Client(base_url=server.url, timeout=300) as http:
            http.post("/continue_generation")
            http.post("/resume_memory_occupation", json={})
    assert set(control_codes) <= {200, 400}, control_codes  # 400: flush refused while requests run
    for code, body in gen_results:
        assert code in (200, 503), (code, body)  # 503: refused while memory was released
        if code == 200:
            assert body["meta_info"]["finish_reason"]["type"] in ("length", "abort")
    with server.client() as http:
        http.post("/continue_generation")
        http.post("/resume_memory_occupation", json={})
        assert http.get("/health").json()["memory"] == "resident"
        assert http.post("/generate", json=GREEDY).json()["output_ids"] == before
        info = http.get("/get_server_info").json()
        assert info["num_running"] == 0 and info["kv_blocks_free"] == info["kv_blocks_total"]


# ---- a trainer that dies in the middle of a weight push ------------------------------------------

DYING_TRAINER = textwrap.dedent("""
    import os, signal, sys
    from safetensors.torch import load_file
    from engine.weights.groups import broadcast_from_trainer, trainer_group
    port, path, send = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    pairs = [(n, t + 0.5) for n, t in sorted(load_file(path).items())]  # new weights
    handle = trainer_group("127.0.0.1", port, 2, "dying", "gloo", timeout_s=60)
    print("joined", flush=True)
    sys.stdin.readline()  # the engine is receiving now
    broadcast_from_trainer(handle, pairs[:send])
    os.kill(os.getpid(), signal.SIGKILL)  # killed mid-step: half the tensors sent
""")


def test_trainer_killed_mid_push_leaves_the_old_weights(server: ServerProcess, demo_dir: str) -> None:
    from safetensors.torch import load_file

    with server.client() as http:
        before = http.post("/generate", json=GREEDY).json()["output_ids"]
        version = http.get("/get_model_info").json()["weight_version"]
    # The demo model's own tensors, shifted: a push that would change the outputs.
    path = os.path.join(demo_dir, "model.safetensors")
    pairs = sorted(load_file(path).items())
    port = free_port()
    group = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
             "group_name": "dying", "backend": "gloo"}
    trainer = subprocess.Popen([sys.executable, "-c", DYING_TRAINER, str(port), path, str(len(pairs) // 2)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        with httpx.Client(base_url=server.url, timeout=120) as http:
            joined: list[httpx.Response] = []
            joiner = threading.Thread(target=lambda: joined.append(http.post("/init_weights_update_group", json=group)))
            joiner.start()
            assert trainer.stdout.readline().strip() == "joined"
            joiner.join(60)
            assert joined[0].status_code == 200, joined[0].text
            meta = {"names": [n for n, _ in pairs], "dtypes": [str(t.dtype).replace("torch.", "") for _, t in pairs],
                    "shapes": [list(t.shape) for _, t in pairs], "group_name": "dying", "weight_version": "never"}
            answers: list[httpx.Response] = []
            updater = threading.Thread(target=lambda: answers.append(http.post("/update_weights_from_distributed", json=meta)))
            updater.start()
            time.sleep(0.5)
            trainer.stdin.write("go\n")
            trainer.stdin.flush()
            trainer.wait(30)
            updater.join(90)
            assert not updater.is_alive(), "the update hung after the trainer died"
            assert answers[0].status_code == 400, answers[0].text
            assert http.get("/health").status_code == 200
            assert http.get("/get_model_info").json()["weight_version"] == version
            assert http.post("/generate", json=GREEDY).json()["output_ids"] == before
            assert http.post("/destroy_weights_update_group", json={"group_name": "dying"}).status_code == 200
    finally:
        trainer.kill()
        trainer.wait()


# ---- resume and free device memory ---------------------------------------------------------------


def test_resume_plan_takes_what_fits_in_resume_order() -> None:
    needed = {"weights": 2 * GIB, "kv_cache": 10 * GIB, "cuda_graph": GIB}
    fits, refused = resume_plan(needed, 20 * GIB)
    assert fits == ["cuda_graph", "weights", "kv_cache"] and refused == {}
    # Weights fit, the KV cache does not: weights resume, the KV cache is reported.
    fits, refused = resume_plan(needed, 5 * GIB)
    assert fits == ["cuda_graph", "weights"]
    assert refused == {"kv_cache": {"bytes_needed": 10 * GIB, "bytes_free": 2 * GIB}}
    # The headroom counts: exactly the bytes free is not enough.
    fits, refused = resume_plan({"weights": GIB}, GIB)
    assert fits == [] and refused["weights"]["bytes_needed"] == GIB
    assert resume_plan({"weights": GIB}, GIB + RESUME_HEADROOM)[0] == ["weights"]
    # A large tag that does not fit does not stop a smaller one after it.
    fits, refused = resume_plan({"weights": 8 * GIB, "kv_cache": GIB}, 4 * GIB)
    assert fits == ["kv_cache"] and list(refused) == ["weights"]


def test_resume_wait_for_memory_is_validated_and_answers(server: ServerProcess) -> None:
    with server.client() as http:
        for bad in (-1, 601, "soon"):
            r = http.post("/resume_memory_occupation", json={"wait_for_memory_s": bad})
            assert r.status_code == 400 and "wait_for_memory_s" in r.json()["error"]["message"], r.text
        assert http.post("/release_memory_occupation", json={"tags": ["kv_cache"]}).status_code == 200
        # On a CPU every tag fits at once: the wait ends immediately.
        t0 = time.monotonic()
        r = http.post("/resume_memory_occupation", json={"tags": ["kv_cache"], "wait_for_memory_s": 30})
        assert r.status_code == 200 and r.json()["refused"] == {} and r.json()["success"] is True
        assert time.monotonic() - t0 < 5
        assert http.get("/health").json()["memory"] == "resident"
