"""Memory release and resume on a GPU (`pytest -m gpu` on the device machine), through the real
engine process (`engine.Engine`): torch_memory_saver's preload hook only works in a process
started with its LD_PRELOAD, which `Engine` arranges for the core it spawns.

Device memory is read from this test process: `torch.cuda.mem_get_info` (device-wide, so it sees
the engine process), and per process from NVML (`pynvml`, else `nvidia-smi`) where the driver
reports the engine's pid, else device-wide against a baseline taken before the engine started.

One engine (tiny Qwen3, a 2 GiB KV cache so that its release is plain to see, graphs up to bs 16)
serves every test but the `weights_backup="none"` one, which starts its own; after each test every
tag is resident again.
"""

from __future__ import annotations

import gc
import json
import os
import random
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from engine import Engine, SamplingParams
from engine.config import ModelConfig
from engine.memory.kv_budget import kv_block_bytes
from engine.weights.payload import serialize_named_tensors

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

MIB = 1 << 20
GIB = 1 << 30
TAGS = ("weights", "kv_cache", "cuda_graph")
RELEASE_ORDER = ["kv_cache", "weights", "cuda_graph"]
RESUME_ORDER = ["cuda_graph", "weights", "kv_cache"]
KV_BYTES = 2 * GIB
BLOCK_SIZE = 16
KNOBS: dict[str, Any] = dict(
    device="cuda", dtype="bfloat16", block_size=BLOCK_SIZE, max_num_seqs=64, max_model_len=512,
    cuda_graph_max_bs=16,
)
GREEDY = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True, logprobs=True)
CYCLES = 100
DRIFT_BYTES = 4 * MIB
# The bytes an answer reports and the change seen from here may differ by this much.
ANSWER_SLACK = 8 * MIB
# What the stand-in trainer gets beyond the freed bytes: room for its own CUDA context.
TRAINER_HEADROOM = 1536 * MIB
RESIDUAL_OVER_IDLE = 256 * MIB


def _tolerance(region_bytes: int) -> float:
    """How far a measured release or resume may be from the region's size: 10 % or 32 MiB."""
    return max(0.10 * region_bytes, 32 * MIB)


def _prompts(seed: int = 0, lengths: tuple[int, ...] = (5, 17, 33, 60)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in lengths]


PROMPTS = _prompts()
BATCH_PROMPTS = _prompts(1, (5, 9, 17, 23, 33, 41, 60, 70))


def _generate(llm: Engine, prompts: list[list[int]] = PROMPTS) -> list[Any]:
    """One request at a time, each after a prefix-cache flush, so that every run schedules and
    computes exactly alike (a prefix hit would change the prefill's shape, and a different batch
    shape is a different bf16 rounding)."""
    outs = []
    for p in prompts:
        llm.flush_cache()
        outs += llm.generate(input_ids=[p], sampling_params=GREEDY)
    return outs


def _greedy(llm: Engine, batch: bool = False) -> list[tuple[list[int], list[tuple[float, int]]]]:
    """Token ids and logprobs of a greedy run; equal lists mean bit-identical output. One prompt at
    a time (`_generate`), or with `batch` eight prompts in one call, which the engine starts in one
    step (`AddRequests`): decode steps of eight rows (the batch decode, its attention's splits
    merged in the kernel with counters in the `cuda_graph` region)."""
    if batch:
        llm.flush_cache()
        outs = llm.generate(input_ids=BATCH_PROMPTS, sampling_params=GREEDY)
    else:
        outs = _generate(llm)
    for o in outs:
        assert o.finish_reason == "length" and o.error is None, (o.finish_reason, o.error)
        assert len(o.output_ids) == GREEDY.max_new_tokens
    return [(o.output_ids, o.output_token_logprobs) for o in outs]


def _device_used() -> int:
    """Device-wide used bytes (total - free), as the driver counts them: every process's."""
    free, total = torch.cuda.mem_get_info()
    return total - free


def _wait_device_used_at_most(limit: int, timeout_s: float = 30.0) -> int:
    """A process that exited gives its memory back as the driver tears it down: wait for that."""
    deadline = time.monotonic() + timeout_s
    used = _device_used()
    while used > limit and time.monotonic() < deadline:
        time.sleep(0.1)
        used = _device_used()
    return used


def _gpu_index() -> int:
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
    return int(first) if first.isdigit() else 0


def _process_used(pid: int) -> int | None:
    """Device memory of one process as NVML reports it (pynvml, else nvidia-smi); None when the
    driver does not list the pid (a container's pid namespace, say) or gives no number."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(_gpu_index())
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if p.pid == pid:
                    used = p.usedGpuMemory
                    return int(used) if isinstance(used, int) else None
            return None
        finally:
            pynvml.nvmlShutdown()
    except ImportError:
        pass
    except Exception:
        return None
    if shutil.which("nvidia-smi") is None:
        return None
    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
        capture_output=True, text=True, timeout=30,
    ).stdout
    for line in out.splitlines():
        parts = [s.strip() for s in line.split(",")]
        if len(parts) == 2 and parts[0] == str(pid) and parts[1].isdigit():
            return int(parts[1]) * MIB
    return None


IDLE_CODE = (
    "import sys, torch; torch.zeros(1, device='cuda'); torch.cuda.synchronize(); "
    "print('ready', flush=True); sys.stdin.read()"
)


def _idle_footprint() -> dict[str, int | None]:
    """An idle CUDA process (context + one tiny tensor): its own usage (NVML) and the device-wide
    difference it makes."""
    before = _device_used()
    proc = subprocess.Popen([sys.executable, "-c", IDLE_CODE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready", "the idle CUDA process failed"
        time.sleep(0.5)
        per_pid = _process_used(proc.pid)
        device = _device_used() - before
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(timeout=60)
    _wait_device_used_at_most(before + 4 * MIB)
    return {"per_pid": per_pid, "device": device}


@dataclass
class Served:
    llm: Engine
    baseline_used: int  # device used before the engine started (this process's context included)
    sizes: dict[str, int]  # region bytes, as memory_occupation reports them
    expected: list[Any] = field(default_factory=list)  # greedy output before any release
    expected_batch: list[Any] = field(default_factory=list)  # _greedy(batch=True)'s, before any release
    startup_released: dict[str, int | None] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.llm._core.process.pid

    def engine_used(self) -> dict[str, int | None]:
        return {"per_pid": _process_used(self.pid), "device": _device_used() - self.baseline_used}


def _released_footprint(served: Served) -> dict[str, int | None]:
    """Release every tag, read the engine's device memory, take every tag back."""
    answer = served.llm.release_memory_occupation()
    assert set(answer["tags"].values()) == {"released"}
    used = served.engine_used()
    served.llm.resume_memory_occupation()
    return used


def _kv_blocks(model_dir: str) -> int:
    return KV_BYTES // kv_block_bytes(ModelConfig.from_hf(model_dir), BLOCK_SIZE, torch.bfloat16)


@pytest.fixture(scope="module")
def served(qwen3_dir: str):
    gc.collect()  # in-process engines of other test files hold memory until collected
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    baseline = _device_used()
    llm = Engine(model=qwen3_dir, num_kv_blocks=_kv_blocks(qwen3_dir), **KNOBS)
    try:
        occ = llm.memory_occupation()
        s = Served(llm, baseline, {t: occ["tags"][t]["bytes"] for t in TAGS})
        s.expected = _greedy(llm)  # the reference: before any release
        s.expected_batch = _greedy(llm, batch=True)
        s.startup_released = _released_footprint(s)
        yield s
    finally:
        llm.shutdown()


@pytest.fixture
def llm(served: Served):
    yield served.llm
    served.llm.resume_memory_occupation()  # leave every tag resident for the next test


def _assert_near(measured: int, expected: int, tol: float, what: str) -> None:
    assert abs(measured - expected) <= tol, (
        f"{what}: measured {measured / MIB:.1f} MiB, expected {expected / MIB:.1f} MiB (+- {tol / MIB:.1f} MiB)"
    )


# ---- a. each tag alone -----------------------------------------------------------------------


def test_release_and_resume_each_tag_frees_and_restores_its_region(served: Served, llm: Engine) -> None:
    occ = llm.memory_occupation()
    assert occ["memory_saver"] is True and occ["hook_mode"] == "preload", occ
    assert occ["weights_backup"] == "host" and occ["weights_valid"] is True
    assert occ["weights_host_copy_bytes"] > 0 and llm.info["weights_bytes"] > 0
    sizes = served.sizes
    assert all(sizes[t] > 0 for t in TAGS), sizes
    _assert_near(sizes["kv_cache"], llm.info["kv_cache_bytes"], _tolerance(llm.info["kv_cache_bytes"]), "kv_cache region")
    assert llm.info["cuda_graph_bytes"] > 0
    expected = served.expected
    assert _greedy(llm) == expected, "output changed after the release and resume of every tag at startup"

    for tag in TAGS:
        tol = _tolerance(sizes[tag])
        used0 = _device_used()
        rel = llm.release_memory_occupation(tags=[tag])
        used1 = _device_used()
        assert rel["changed"] == [tag] and rel["memory_saver"] is True, rel
        assert rel["tags"] == {t: "released" if t == tag else "resident" for t in TAGS}, rel
        assert llm.memory_occupation()["tags"][tag]["state"] == "released"
        _assert_near(used0 - used1, sizes[tag], tol, f"device memory freed by releasing {tag}")
        _assert_near(rel["bytes_freed"], used0 - used1, ANSWER_SLACK, f"bytes_freed of {tag} vs seen from here")
        assert list(rel["seconds_by_tag"]) == [tag] and 0 < rel["seconds_by_tag"][tag] <= rel["seconds"], rel

        res = llm.resume_memory_occupation(tags=[tag])
        used2 = _device_used()
        assert res["changed"] == [tag] and set(res["tags"].values()) == {"resident"}, res
        _assert_near(used2 - used1, sizes[tag], tol, f"device memory taken back by resuming {tag}")
        _assert_near(res["bytes_restored"], used2 - used1, ANSWER_SLACK, f"bytes_restored of {tag} vs seen from here")
        assert list(res["seconds_by_tag"]) == [tag] and 0 < res["seconds_by_tag"][tag] <= res["seconds"], res
        _assert_near(used2, used0, tol, f"device memory after the {tag} cycle vs before it")
        if tag == "weights":  # pages only: the first forward copies the host copy back
            assert res["weights_stale_bytes"] > 0.99 * llm.info["weights_bytes"], res
        assert _greedy(llm) == expected, f"output changed after releasing and resuming {tag}"
        assert llm.memory_occupation()["weights_stale_bytes"] == 0


# ---- e. idempotence and errors (before the long tests: cheap and telling) ---------------------


def test_release_and_resume_are_idempotent_and_unknown_tags_raise(served: Served, llm: Engine) -> None:
    assert llm.resume_memory_occupation(tags=["weights"])["changed"] == []  # resident already

    assert llm.release_memory_occupation(tags=["kv_cache"])["changed"] == ["kv_cache"]
    again = llm.release_memory_occupation(tags=["kv_cache"])
    assert again["changed"] == [] and again["tags"]["kv_cache"] == "released"
    assert again["bytes_freed"] <= ANSWER_SLACK, again

    refused = _generate(llm)
    assert all(o.finish_reason == "abort" and o.output_ids == [] for o in refused)
    assert all(o.error and "kv_cache" in o.error for o in refused), [o.error for o in refused]

    with pytest.raises((RuntimeError, ValueError), match="unknown memory tag"):
        llm.release_memory_occupation(tags=["bogus"])
    with pytest.raises((RuntimeError, ValueError), match="unknown memory tag"):
        llm.resume_memory_occupation(tags=["kv_cache", "bogus"])  # refused whole: kv_cache stays out
    with pytest.raises((RuntimeError, ValueError), match="release mode"):
        llm.release_memory_occupation(tags=["weights"], mode="bogus")
    occ = llm.memory_occupation()
    assert {t: v["state"] for t, v in occ["tags"].items()} == {
        "weights": "resident", "kv_cache": "released", "cuda_graph": "resident"}

    assert llm.resume_memory_occupation(tags=["kv_cache"])["changed"] == ["kv_cache"]
    assert llm.resume_memory_occupation(tags=["kv_cache"])["changed"] == []
    assert llm.resume_memory_occupation()["changed"] == []
    assert _greedy(llm) == served.expected


# ---- c. a stand-in trainer uses the released memory ------------------------------------------

TRAINER_CODE = """
import json, sys, torch
n = int(sys.argv[1])
x = torch.empty(n, dtype=torch.uint8, device="cuda")
x.fill_(7)
torch.cuda.synchronize()
ok = int(x[0].item()) == 7 and int(x[-1].item()) == 7
free, total = torch.cuda.mem_get_info()
del x
torch.cuda.empty_cache()
print(json.dumps({"ok": ok, "bytes": n, "free_while_holding": free}), flush=True)
"""


def test_trainer_process_uses_released_memory_then_engine_serves(served: Served, llm: Engine) -> None:
    """With this process holding a ballast so that the device has only the freed bytes plus
    room for a CUDA context free, a separate process allocates and fills 95 % of what the release
    freed (more than was free before the release); after it exits, resume and serve."""
    expected = served.expected
    rel = llm.release_memory_occupation()
    assert rel["changed"] == RELEASE_ORDER, rel
    freed = rel["bytes_freed"]
    assert freed >= KV_BYTES, rel
    need = int(0.95 * freed)
    assert need > TRAINER_HEADROOM  # so the trainer could not fit in what was free before
    ballast = None
    try:
        free_now = torch.cuda.mem_get_info()[0]
        ballast_bytes = free_now - freed - TRAINER_HEADROOM
        if ballast_bytes > 0:
            ballast = torch.empty(ballast_bytes, dtype=torch.uint8, device="cuda")
        used_before_trainer = _device_used()
        proc = subprocess.run([sys.executable, "-c", TRAINER_CODE, str(need)], capture_output=True, text=True, timeout=180)
        assert proc.returncode == 0, f"the trainer failed:\n{proc.stderr[-3000:]}"
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        assert result["ok"] and result["bytes"] == need, result
        _wait_device_used_at_most(used_before_trainer + 4 * MIB)
        res = llm.resume_memory_occupation()
        assert res["changed"] == RESUME_ORDER and res["weights_valid"] is True, res
        assert _greedy(llm) == expected, "output changed after another process used the released memory"
        assert _greedy(llm, batch=True) == served.expected_batch, "batched output changed after the release"
    finally:
        del ballast
        torch.cuda.empty_cache()


# ---- b. 100 cycles with traffic between ------------------------------------------------------


def test_hundred_cycles_keep_output_and_memory(served: Served, llm: Engine) -> None:
    expected = served.expected
    released: list[int] = []
    resumed: list[int] = []
    t0 = time.perf_counter()
    for i in range(CYCLES):
        rel = llm.release_memory_occupation()
        assert rel["changed"] == RELEASE_ORDER, (i, rel)
        released.append(_device_used())
        res = llm.resume_memory_occupation()
        assert res["changed"] == RESUME_ORDER, (i, res)
        resumed.append(_device_used())
        assert _greedy(llm) == expected, f"output changed at cycle {i}"
    spread = {name: (max(v) - min(v)) / MIB for name, v in (("released", released), ("resumed", resumed))}
    print(f"{CYCLES} cycles in {time.perf_counter() - t0:.1f} s; spread of device used (MiB): {spread}")
    for name, values in (("released", released), ("resumed", resumed)):
        drift = values[-1] - values[0]
        assert abs(drift) <= DRIFT_BYTES, (
            f"device used while {name} drifted by {drift / MIB:.1f} MiB over {CYCLES} cycles "
            f"(first {values[0] / MIB:.1f} MiB, last {values[-1] / MIB:.1f} MiB)"
        )


# ---- f. nothing long-lived outside the regions -----------------------------------------------


def test_nothing_long_lived_outside_regions(served: Served, llm: Engine) -> None:
    """With every tag released, the engine holds about what an idle CUDA process holds (context,
    cuBLAS workspace): after startup (and the fixture's reference run: 4 prompts x 16 tokens,
    graph decode at bs 1) and after more traffic (batched prefill, sampling, larger graphs)."""
    _greedy(llm)
    llm.generate(input_ids=_prompts(1, (100, 200, 300, 7, 9, 11, 13, 15)),
                 sampling_params=SamplingParams(max_new_tokens=40, temperature=0.8, ignore_eos=True))
    after_traffic = _released_footprint(served)
    idle = _idle_footprint()
    # Per process where the driver lists both pids, else device-wide for both.
    per_pid = all(x["per_pid"] is not None for x in (served.startup_released, after_traffic, idle))
    how = "per_pid" if per_pid else "device"
    report = {
        "method": how,
        "idle_MiB": idle[how] / MIB,
        "released_after_startup_MiB": served.startup_released[how] / MIB,
        "released_after_traffic_MiB": after_traffic[how] / MIB,
        "regions_MiB": {t: b / MIB for t, b in served.sizes.items()},
    }
    print(f"engine footprint with every tag released: {report}")
    for when, used in (("after startup", served.startup_released[how]), ("after traffic", after_traffic[how])):
        residual = used - idle[how]
        assert residual <= RESIDUAL_OVER_IDLE, (
            f"{when}: with every tag released the engine holds {used / MIB:.0f} MiB, "
            f"{residual / MIB:.0f} MiB over an idle CUDA process ({idle[how] / MIB:.0f} MiB); {report}"
        )


# ---- d. weights_backup="none" ----------------------------------------------------------------


def test_weights_backup_none_refuses_to_generate_after_weights_come_back(qwen3_dir: str) -> None:
    with Engine(model=qwen3_dir, num_kv_blocks=2048, weights_backup="none", **KNOBS) as llm:
        occ = llm.memory_occupation()
        assert occ["memory_saver"] is True and occ["weights_backup"] == "none", occ
        assert occ["weights_host_copy_bytes"] == 0 and occ["weights_valid"] is True
        expected = _greedy(llm)

        # Releasing the KV cache alone leaves the weights good.
        assert llm.release_memory_occupation(tags=["kv_cache"])["weights_valid"] is True
        assert llm.resume_memory_occupation(tags=["kv_cache"])["weights_valid"] is True
        assert _greedy(llm) == expected

        rel = llm.release_memory_occupation(tags=["weights"])
        assert rel["changed"] == ["weights"] and rel["weights_valid"] is False, rel
        res = llm.resume_memory_occupation(tags=["weights"])
        assert res["changed"] == ["weights"] and res["weights_valid"] is False, res
        assert res["weights_stale_bytes"] > 0 and llm.memory_occupation()["weights_host_copy_bytes"] == 0, res
        assert set(res["tags"].values()) == {"resident"}

        def assert_refused() -> None:
            outs = _generate(llm)
            assert all(o.finish_reason == "abort" and o.output_ids == [] for o in outs), [o.finish_reason for o in outs]
            assert all(o.error and "weights" in o.error for o in outs), [o.error for o in outs]
            assert llm.memory_occupation()["weights_valid"] is False

        assert_refused()
        # Pausing and continuing generation brings no weights back.
        llm.pause_generation("abort")
        llm.continue_generation()
        assert_refused()
        # A partial update is not enough: the tensors it did not write are still lost.
        from safetensors.torch import load_file

        first = next(iter(load_file(os.path.join(qwen3_dir, "model.safetensors"), device="cpu").items()))
        assert llm.update_weights_from_tensor([serialize_named_tensors([first])])["success"]
        assert_refused()
        # A full update brings the model back, the recomputed rotary table with it.
        assert llm.update_weights_from_disk(qwen3_dir)["success"]
        assert llm.memory_occupation()["weights_valid"] is True
        assert _greedy(llm) == expected
