"""A colocated trainer's calls on a GPU (`pytest -m gpu` on the device machine), through the real
HTTP server. A resume while a trainer still holds the GPU: the trainer (another process) keeps part of the device, the server answers
503 naming what does not fit and stays alive and healthy, resumes what fits, and once the
trainer lets go a resume succeeds (at once, or by waiting with `wait_for_memory_s`) with outputs
identical to before. Without the check, torch_memory_saver's failed cuMemCreate exits the engine.
And slime's profiling calls, with GPU kernels and CUDA allocations in the trace.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import torch
from server_util import ServerProcess

from engine.memory.regions import RESUME_HEADROOM, RESUME_PROBE_BELOW

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

MIB = 1 << 20
PROMPTS = [[5, 17, 33, 60, 7], [9, 100, 200, 301]]
GREEDY = {"return_logprob": True, "sampling_params": {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}}
# float32 (ServerProcess's dtype), 2 layers x 2 KV heads x 16 dims: 8 KiB a block; 4 GiB of KV.
KV_BLOCKS = 524288

# A stand-in trainer: takes all but `leave` bytes of the device's free memory, says how much is
# free then, and holds it until told to let go (a line on stdin), then frees and exits.
HOLDER = """
import json, sys, torch
leave = int(sys.argv[1])
torch.zeros(1, device="cuda")
free = torch.cuda.mem_get_info()[0]
held = torch.empty(max(free - leave, 0), dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
print(json.dumps({"held": held.numel(), "free": torch.cuda.mem_get_info()[0]}), flush=True)
sys.stdin.readline()
del held
torch.cuda.empty_cache()
"""


class Holder:
    """The trainer process holding memory; `release()` makes it free everything and exit."""

    def __init__(self, leave: int) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(leave)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        assert line, "the memory holder failed to start"
        self.info = json.loads(line)

    def release(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write("go\n")
            self.proc.stdin.flush()
            self.proc.wait(60)

    def kill(self) -> None:
        """A trainer killed mid-step: the driver takes its memory back as the process ends."""
        self.proc.kill()
        self.proc.wait(60)


@pytest.fixture(scope="module")
def server(qwen3_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = str(tmp_path_factory.mktemp("logs") / "gpu_colocation.log")
    proc = ServerProcess(qwen3_dir, "--device", "cuda", "--num-kv-blocks", str(KV_BLOCKS), "--max-model-len", "512",
                         "--cuda-graph-max-bs", "16", log_path=log)
    yield proc
    proc.stop()


def _outputs(http: httpx.Client) -> list[tuple[list[int], list]]:
    """Greedy ids and logprobs, one prompt at a time after a cache flush (the same batch shapes
    every run, so equal lists mean bit-identical output)."""
    outs = []
    for prompt in PROMPTS:
        assert http.post("/flush_cache").status_code == 200
        r = http.post("/generate", json=GREEDY | {"input_ids": prompt})
        assert r.status_code == 200, r.text
        outs.append((r.json()["output_ids"], r.json()["meta_info"]["output_token_logprobs"]))
    return outs


def _sizes(http: httpx.Client) -> dict[str, int]:
    occ = http.get("/memory_occupation").json()
    assert occ["memory_saver"] is True, occ
    return {t: v["bytes"] for t, v in occ["tags"].items()}


def test_resume_while_a_trainer_holds_the_memory(server: ServerProcess) -> None:
    with server.client() as http:
        expected = _outputs(http)
        sizes = _sizes(http)
        assert http.post("/release_memory_occupation", json={}).status_code == 200

        # 1. The trainer holds nearly everything: no tag fits, nothing changes, the server lives.
        holder = Holder(leave=64 * MIB)
        try:
            r = http.post("/resume_memory_occupation", json={})
            assert r.status_code == 503, r.text
            body = r.json()
            assert body["error"]["type"] == "service_unavailable" and "not enough free device memory" in body["error"]["message"]
            assert set(body["refused"]) == {"weights", "kv_cache", "cuda_graph"} and body["changed"] == []
            for tag, ref in body["refused"].items():
                assert ref["bytes_needed"] == sizes[tag] and ref["bytes_free"] < sizes[tag] + RESUME_HEADROOM, (tag, ref)
            health = http.get("/health")
            assert health.status_code == 200 and health.json()["memory"] == "released"
            assert http.post("/generate", json=GREEDY | {"input_ids": PROMPTS[0]}).status_code == 503
            # Waiting a little does not help while the trainer holds on: 503 after the wait.
            t0 = time.monotonic()
            assert http.post("/resume_memory_occupation", json={"wait_for_memory_s": 0.5}).status_code == 503
            assert time.monotonic() - t0 >= 0.5
        finally:
            holder.release()

        # 2. Weights and graphs fit, the KV cache does not: a partial resume, reported per tag.
        leave = sizes["weights"] + sizes["cuda_graph"] + sizes["kv_cache"] // 2
        holder = Holder(leave=leave)
        try:
            r = http.post("/resume_memory_occupation", json={})
            assert r.status_code == 503, r.text
            body = r.json()
            assert body["changed"] == ["cuda_graph", "weights"] and list(body["refused"]) == ["kv_cache"], body
            assert body["tags"] == {"weights": "resident", "kv_cache": "released", "cuda_graph": "resident"}
            assert http.get("/health").json()["memory"] == "released"
            # 3. A resume that waits: the trainer is killed mid-step while it waits, and it succeeds.
            answers: list[httpx.Response] = []
            waiter = threading.Thread(target=lambda: answers.append(
                http.post("/resume_memory_occupation", json={"tags": ["kv_cache"], "wait_for_memory_s": 60})))
            waiter.start()
            time.sleep(1.0)
            assert http.get("/health").status_code == 200  # other calls are answered while it waits
            assert waiter.is_alive()
        finally:
            holder.kill()
        waiter.join(60)
        assert answers and answers[0].status_code == 200, answers
        assert answers[0].json()["changed"] == ["kv_cache"] and answers[0].json()["refused"] == {}
        assert http.get("/health").json()["memory"] == "resident"
        assert _outputs(http) == expected, "outputs changed after the refused and partial resumes"

        # 4. A tight fit (less than RESUME_PROBE_BELOW to spare) is probed, then resumed.
        assert http.post("/release_memory_occupation", json={"tags": ["kv_cache"]}).status_code == 200
        holder = Holder(leave=sizes["kv_cache"] + RESUME_HEADROOM + RESUME_PROBE_BELOW // 2)
        try:
            r = http.post("/resume_memory_occupation", json={"tags": ["kv_cache"]})
            assert r.status_code == 200 and r.json()["changed"] == ["kv_cache"], r.text
        finally:
            holder.release()
        assert _outputs(http) == expected


def test_profile_records_gpu_kernels_and_memory(server: ServerProcess, tmp_path) -> None:
    """slime's SGLangEngine.start_profile body (sglang_engine.py) with GPU and MEM activities."""
    body = {"output_dir": str(tmp_path), "start_step": None, "num_steps": 4, "activities": ["CPU", "GPU", "MEM"],
            "profile_by_stage": False, "with_stack": None, "record_shapes": None}
    with server.client() as http:
        started = http.post("/start_profile", json=body)
        assert started.status_code == 200, started.text
        for prompt in PROMPTS:
            assert http.post("/generate", json=GREEDY | {"input_ids": prompt}).status_code == 200
        stopped = http.post("/stop_profile")
        assert stopped.status_code == 200, stopped.text
    files = stopped.json()["files"]
    assert {os.path.dirname(f) for f in files} == {str(tmp_path)}
    trace = next(f for f in files if f.endswith(".trace.json.gz"))
    with gzip.open(trace, "rt") as f:
        events = json.load(f)["traceEvents"]
    assert any(e.get("cat") == "kernel" for e in events), "no GPU kernel in the trace"
    assert any(f.endswith(".pickle") for f in files), files  # the CUDA memory snapshot
