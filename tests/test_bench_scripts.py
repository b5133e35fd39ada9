"""The benchmark scripts run on the device machine only, so CI checks what it can of them: each
parses its arguments (`--help`) without a GPU, bench_memory.py without a GPU exits 2 with a JSON
file that says why, instead of a traceback, and bench_engine.py and bench_serving.py run every code
path of theirs in `--tiny` mode on the CPU (numbers meaningless, fields checked); so do
bench_flip.py, with every push mode a CPU has, and bench_replicas.py, where smg is installed.
compile_offline.py compiles the decode path's Triton kernels for Hopper without a GPU, and the
occupancy they are built on is checked here."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize(
    "script",
    [
        "bench_engine.py",
        "bench_memory.py",
        "bench_fused_ops.py",
        "probe_vmm_driver.py",
        "probe_ipc_open.py",
        "bench_serving.py",
        "bench_replicas.py",
        "bench_flip.py",
        "bench_allreduce.py",
        "bench_tp.py",
        "profile_decode.py",
        "ncu_decode.py",
        "probe_step_tail.py",
        "control_storm.py",
        "probe_resume_poison.py",
    ],
)
def test_benchmarks_parse_their_arguments_anywhere(script: str) -> None:
    p = _run(os.path.join("bench", script), "--help")
    assert p.returncode == 0, p.stderr
    assert "usage:" in p.stdout and "Traceback" not in p.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_bench_memory_without_a_gpu_says_why(tmp_path: str) -> None:
    out = os.path.join(tmp_path, "memory.json")
    p = _run(os.path.join("bench", "bench_memory.py"), "--out", out)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert "needs an NVIDIA GPU" in p.stdout
    with open(out) as f:
        assert "gpu" in json.load(f)["errors"]


def test_bench_engine_tiny_measures_the_shape_it_loads(tmp_path: str) -> None:
    out, ckpt = os.path.join(tmp_path, "engine.json"), os.path.join(tmp_path, "ckpt")
    p = _run(os.path.join("bench", "bench_engine.py"), "--tiny", "--model-dir", ckpt, "--skip", "hf", "--out", out)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    with open(out) as f:
        res = json.load(f)
    assert res["errors"] == {} and res["checkpoint"]["path"] == ckpt
    shape = res["meta"]["model_shape"]
    with open(os.path.join(ckpt, "config.json")) as f:
        assert shape["hidden_size"] == json.load(f)["hidden_size"]
    kv_per_token = 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * shape["head_dim"] * 2  # bf16
    assert res["decode"]["kv_bytes_per_token"] == kv_per_token
    assert [d["batch_size"] for d in res["decode"]["batches"]] == [1, 4, 8]
    assert res["throughput"]["output_tokens"] == res["throughput"]["expected_output_tokens"]
    # The mixed section: B decodes + one fresh C-token prompt in one step vs the two apart.
    mixed, args = res["mixed"], res["meta"]["args"]
    assert (mixed["batch_size"], mixed["chunk_tokens"], mixed["context"]) == (4, 32, args["decode_context"])
    a, b, c = mixed["decode_step_median_s"], mixed["chunk_step_median_s"], mixed["mixed_step_median_s"]
    assert min(a, b, c) > 0
    for key in ("decode_step_s", "chunk_step_s", "mixed_step_s"):
        assert len(mixed[key]) == mixed["reps"] == 3 and min(mixed[key]) > 0, key
    assert mixed["reference_s"] == pytest.approx(a + b) and mixed["ratio"] == pytest.approx(c / (a + b))
    # Host busy: inside core.step() less its waits for the device; on the CPU, the whole step or nearly.
    busy = mixed["host_busy_median_s"]
    assert set(busy) == {"chunk", "decode", "mixed"}
    for kind, step in (("chunk", b), ("decode", a), ("mixed", c)):
        assert 0.5 * step < busy[kind] <= step * 1.001, (kind, busy[kind], step)
    reps = mixed["warmup_reps"] + mixed["reps"]
    assert mixed["chunks_prefilled"] == 2 * reps * mixed["steps_per_rep"]  # (b) and (c), one per step
    # Every decode ran in every (a) and (c) step: one token more each.
    assert mixed["decode_context_end"] - mixed["decode_context_start"] == 2 * reps * mixed["steps_per_rep"]
    rows = {r["metric"]: r for r in res["table"]}
    row = rows["mixed step: 4 decodes + one 32-token chunk (ms); ref = decode step + chunk prefill alone"]
    assert row["measured"] == pytest.approx(c * 1e3) and row["reference"] == pytest.approx((a + b) * 1e3)
    assert row["ratio"] == pytest.approx(mixed["ratio"]) and row["target"] == "<= 1.30"
    assert rows["mixed: decode step bs=4 alone (ms)"]["measured"] == pytest.approx(a * 1e3)
    assert rows["mixed: one 32-token chunk prefill alone (ms)"]["measured"] == pytest.approx(b * 1e3)
    assert "| mixed step: 4 decodes + one 32-token chunk (ms)" in p.stdout


def test_bench_engine_keeps_the_names_other_scripts_import() -> None:
    """bench_memory.py, bench_fused_ops.py and bench_serving.py import these from bench_engine,
    whose sections now live in bench/engine_*.py."""
    names = ("FULL_DEFAULTS", "FULL_SHAPE", "TINY_SHAPE", "BUILT_MARKER", "make_checkpoint", "checkpoint",
             "shape_label", "copy_bandwidth", "say", "run_section", "write_json")
    code = f"import sys; sys.path.insert(0, 'bench'); import bench_engine as b; print([n for n in {names} if "
    code += "not hasattr(b, n)])"
    p = _run("-c", code)
    assert p.returncode == 0 and p.stdout.strip() == "[]", p.stdout + p.stderr


def test_bench_tokenizer_decodes_every_id_of_the_model(tmp_path: str) -> None:
    """bench_serving's tokenizer for a checkpoint of a wider vocabulary than the demo's 512: every
    id decodes to text (a random model samples them all), and text encodes as the demo's does."""
    code = (
        "import sys; sys.path.insert(0, 'bench'); import json\n"
        "from bench_serving import widen_tokenizer\n"
        "from engine.demo_model import build_tokenizer, save_tokenizer\n"
        "from transformers import AutoTokenizer\n"
        f"p = {str(tmp_path)!r}; save_tokenizer(p); widen_tokenizer(p, 2000)\n"
        "t = AutoTokenizer.from_pretrained(p)\n"
        "words = [t.decode([i]) for i in range(512, 2000)]\n"
        "text = 'Hello world, ça va? 日本語'\n"
        "print(json.dumps([len(t), len(set(words)), min(len(w) for w in words), words[:2],\n"
        "                  t(text)['input_ids'] == build_tokenizer()(text)['input_ids']]))\n"
    )
    p = _run("-c", code)
    assert p.returncode == 0, p.stdout + p.stderr
    size, distinct, shortest, first, same_encoding = json.loads(p.stdout.strip().splitlines()[-1])
    assert size == 2000 and distinct == 2000 - 512 and shortest >= 4  # " " and three letters at least
    assert all(w.startswith(" ") and w[1:].isalpha() for w in first) and same_encoding


def test_bench_serving_tiny_runs_every_section(tmp_path: str) -> None:
    out = os.path.join(tmp_path, "serving.json")
    server_args = "--device cpu --dtype float32 --kv-cache-memory-gb 0.05 --max-model-len 256 --api-server-count 2"
    args = ["--tiny", "--model-dir", os.path.join(tmp_path, "ckpt"), "--out", out, "--rounds", "3",
            "--server-args", server_args]
    p = _run(os.path.join("bench", "bench_serving.py"), *args, timeout=300)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-3000:]
    with open(out) as f:
        res = json.load(f)
    assert res["errors"] == {}
    assert res["checkpoint"]["shape"]["vocab_size"] == 512
    assert res["server"]["engine_pid"] > 0 and res["server"]["api_server"]["count"] == 2
    sections = res["rl"]["8"]
    assert set(sections) == {"engine", "batched", "singles", "streams", "n8"}
    requests = {"engine": 8, "batched": 1, "singles": 8, "streams": 8, "n8": 1}
    for mode, r in sections.items():
        assert r["requests"] == requests[mode] and r["ok"] == requests[mode] and r["failed"] == 0, (mode, r)
        assert r["output_tokens"] == r["expected_output_tokens"] == 8 * 8, (mode, r)
        assert r["tokens_per_s"] > 0 and r["wall_s"] > 0
        assert r["engine_cpu_pct"] is not None and r["client_cpu_pct_max"] >= 0
        rounds = sorted(r["rounds_tokens_per_s"])  # each mode ran 3 times; the median round is reported
        assert len(rounds) == 3 and r["tokens_per_s"] == rounds[1], (mode, r)
        if mode != "engine":
            assert r["server_cpu_pct"] is not None and len(r["client_cpu_pct"]) == 2
            assert 0 <= r["server_cpu_pct_max"] <= r["server_cpu_pct"]  # the busiest of the two API processes
    assert sections["streams"]["ttft_ms"]["p50"] > 0
    online = res["online"]
    assert online["requests"] == online["ok"] == 6 and online["failed"] == 0
    assert online["output_tokens"] == online["expected_output_tokens"] > 0
    assert online["ttft_ms"]["p99"] >= online["ttft_ms"]["p50"] > 0 and online["itl_ms"]["p50"] is not None
    metrics = [row["metric"] for row in res["table"]]
    assert any("batched" in m and "Engine" in m for m in metrics) and any("online" in m for m in metrics)
    assert "| N=8 one batched /generate" in p.stdout


def test_bench_replicas_tiny_runs_every_section(tmp_path: str) -> None:
    """Two CPU replicas alone and behind the real gateway (smg, which the GPU machine lacks): every
    request answered, both replicas served some, the flip fanned out to both left their greedy
    outputs unchanged under the new weight version."""
    pytest.importorskip("smg")
    out = os.path.join(tmp_path, "r.json")
    p = _run(os.path.join("bench", "bench_replicas.py"), "--tiny", "--model-dir", os.path.join(tmp_path, "ckpt"), "--out", out)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-3000:]
    with open(out) as f:
        res = json.load(f)
    assert res["errors"] == {} and res["skipped"] == []
    for name in ("one", "gateway"):
        sec = res[name]
        assert sec["requests"] == sec["ok"] == 16 and sec["failed"] == 0, (name, sec)
        assert sec["output_tokens"] == sec["expected_output_tokens"] == 16 * 8, (name, sec)
        assert sum(sec["requests_per_replica"]) == 16 and len(sec["engine_cpu_pct"]) == len(sec["requests_per_replica"])
    assert len(res["gateway"]["requests_per_replica"]) == 2 and min(res["gateway"]["requests_per_replica"]) > 0
    assert res["gateway"]["gateway_cpu_pct"] is not None and res["one"]["gateway_cpu_pct"] is None
    flip = res["flip"]
    assert flip["ok"] and flip["identical"] and flip["all_calls_ok"] and flip["versions_after"] == ["flip-1"]
    assert list(flip["phases"]) == ["release", "resume weights", "update from disk", "resume kv_cache + cuda_graph"]
    for phase in flip["phases"].values():
        assert phase["status"] == 200 and phase["succeeded"] == 2 and phase["wall_ms"] > 0
    assert all(len(b["output_ids"]) == 4 for b in flip["before"]) and len(flip["bytes_freed"]) == 2
    rows = {r["metric"]: r for r in res["table"]}
    assert rows["2 replicas via the gateway: output tok/s; ref = one replica"]["target"] == "n/a (cpu)"
    assert "| 2 replicas via the gateway: output tok/s" in p.stdout and "| flip: greedy outputs identical" in p.stdout


def test_bench_flip_tiny_runs_every_cpu_path(tmp_path: str) -> None:
    """Every push mode a CPU has (shared memory for bucket and tensor, gloo for both distributed
    ones), two timed flips each, and the bench's own proof that the server took the pushed weights."""
    out = os.path.join(tmp_path, "flip.json")
    args = ["--tiny", "--flips", "2", "--out", out, "--model-dir", os.path.join(tmp_path, "ckpt")]
    p = _run(os.path.join("bench", "bench_flip.py"), *args, "--push", "bucket,tensor,distributed,distributed_bucket")
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-3000:]
    with open(out) as f:
        res = json.load(f)
    assert res["errors"] == {} and res["skipped"] == []
    assert res["meta"]["model_bytes"] > 0 and res["meta"]["num_tensors"] > 0
    for mode in ("bucket", "tensor", "distributed", "distributed_bucket"):
        sec = res["push"][mode]
        assert len(sec["flips"]) == 2 and len(sec["warmup"]) == 1, mode
        for flip in sec["flips"]:
            for key in ("release_wall_s", "resume_weights_wall_s", "push_wall_s"):
                assert flip[key] > 0 and flip["resume_kv_wall_s"] > 0, (mode, key)
            total = flip["release_wall_s"] + flip["resume_weights_wall_s"] + flip["push_wall_s"]
            assert flip["flip_total_s"] == pytest.approx(total + flip["resume_kv_wall_s"])
            assert flip["push_answer"]["success"] and flip["push_s"] > 0
            assert flip["generated_tokens"] == 4 * 8 and flip["generate_wall_s"] > 0
            assert flip["version_ok"] and flip["verify"]["all_changed"], (mode, flip.get("verify"))
        summary = sec["summary"]
        assert summary["flips"] == 2 and summary["flip_total_s_median"] > 0
        assert summary["push_bandwidth_bytes_per_s"] > 0
    verify = res["verify"]
    assert verify["flips_checked"] == 12 and verify["restored_exactly"]
    for mode in ("distributed", "distributed_bucket"):  # the HTTP + dispatch floor, measured
        assert res["push"][mode]["control_round_trip_s"] > 0
    assert res["push"]["distributed_bucket"]["flips"][0]["push_answer"]["receive_route"] == "bucket via scratch"
    assert verify["pushed_weights_taken"] is True
    assert res["refs"]["d2d"]["bandwidth_bytes_per_s"] > 0
    assert res["refs"]["broadcast"]["best_bandwidth_bytes_per_s"] > 0
    metrics = [row["metric"] for row in res["table"]]
    assert any(m.startswith("bucket: push") for m in metrics)
    assert any("took the pushed" in m for m in metrics)
    assert "| tensor: flip total" in p.stdout


def test_bench_flip_tiny_at_tp_size_2(tmp_path: str) -> None:
    """The flip against a server of two tensor-parallel ranks: every push mode (the distributed
    group holds the trainer and both ranks), and the checksums of both ranks' shards say each flip
    changed every tensor and the checkpoint pushed back restored them bit for bit."""
    out = os.path.join(tmp_path, "flip.json")
    args = ["--tiny", "--tp-size", "2", "--flips", "1", "--out", out, "--model-dir", os.path.join(tmp_path, "ckpt")]
    p = _run(os.path.join("bench", "bench_flip.py"), *args, "--push", "bucket,tensor,distributed,distributed_bucket")
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-3000:]
    with open(out) as f:
        res = json.load(f)
    assert res["errors"] == {} and res["server"]["tp_size"] == 2
    assert res["push"]["distributed"]["group"]["body"]["world_size"] == 3
    assert res["verify"]["ranks"] == 2  # both ranks' shards checksummed, each flip and at the end
    for mode in ("bucket", "tensor", "distributed", "distributed_bucket"):
        flip = res["push"][mode]["flips"][0]
        assert flip["version_ok"] and flip["verify"]["all_changed"], (mode, flip.get("verify"))
    assert res["verify"]["restored_exactly"] and res["verify"]["pushed_weights_taken"] is True


def test_the_layers_attention_kernel_compiles_for_every_head_dim(tmp_path: str) -> None:
    """Every head dim the Triton backend takes (powers of two, 16..256), bf16 and fp32 caches; a
    compile error here is an engine that fails at its first decode step on a GPU."""
    pytest.importorskip("triton")
    out = os.path.join(tmp_path, "compile.json")
    p = _run(os.path.join("bench", "compile_offline.py"), "--decode-configs", "64x4x3", "--layers-head-dims",
             "16,32,64,128,256", "--json", out, timeout=600)  # fmt: skip
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    with open(out) as f:
        kernels = json.load(f)
    layers = {name: r for name, r in kernels.items() if name.startswith("layers attention")}
    assert len(layers) == 10
    assert all(min(r["per_sm_regs"], r["per_sm_shared"]) >= 1 for r in layers.values()), layers
    # The served shapes (bf16, head_dim <= 128) keep everything in registers.
    bf16 = {n: r["stack"] for n, r in layers.items() if n.endswith("bf16") and int(n.split()[2]) <= 128}
    assert bf16 == dict.fromkeys(bf16, 0), bf16


def test_decode_kernels_compile_for_hopper_at_the_occupancy_they_are_built_on(tmp_path: str) -> None:
    pytest.importorskip("triton")
    out = os.path.join(tmp_path, "compile.json")
    p = _run(os.path.join("bench", "compile_offline.py"), "--persistent", "--json", out, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    with open(out) as f:
        kernels = json.load(f)
    (decode,) = (r for name, r in kernels.items() if name.startswith("decode "))  # the engine's own config
    # Four split-KV programs per SM: the batch decode's 64 rows x 8 KV heads in one wave.
    assert min(decode["per_sm_regs"], decode["per_sm_shared"]) >= 4, decode
    assert decode["buffers"] >= 1, decode  # its K/V loads are software-pipelined
    # So does the batch decode's own attention kernel, with q/k norm, rope and the K/V store in it.
    # The same kernel on the qkv linear's bf16 output (the layers' decode steps) fits four too.
    for name in ("rope_decode_kernel", "rope_decode_kernel (layers)"):
        attention = kernels[name]
        assert min(attention["per_sm_regs"], attention["per_sm_shared"]) >= 4, (name, attention)
    # The batch decode's attention buffers two K/V tiles: one streams while the other computes.
    assert kernels["rope_decode_kernel"]["buffers"] >= 2, kernels["rope_decode_kernel"]
    # Two layer kernels per SM: a layer's programs, launched with PDL, start beside the layer before.
    layer = kernels["decoder_layer_kernel"]
    assert min(layer["per_sm_regs"], layer["per_sm_shared"]) >= 2, layer
    assert kernels["batch_layer_kernel"]["per_sm_shared"] >= 1
    # The decode graphs' logits run PROGRAMS_PER_SM programs an SM in one wave.
    from engine.models.logits_linear import PROGRAMS_PER_SM

    for rows in (16, 64):
        logits = kernels[f"_logits_kernel ({rows} rows)"]
        assert min(logits["per_sm_regs"], logits["per_sm_shared"]) >= PROGRAMS_PER_SM, (rows, logits)
    assert {name: r["stack"] for name, r in kernels.items()} == dict.fromkeys(kernels, 0)  # nothing spills


def test_probe_step_plan_times_both_slot_lists_on_the_cpu(tmp_path: str) -> None:
    out = os.path.join(tmp_path, "plan.json")
    p = _run(os.path.join("bench", "probe_step_plan.py"), "--number", "3", "--out", out)
    assert p.returncode == 0, p.stderr[-3000:]
    with open(out) as f:
        rows = json.load(f)["rows"]
    assert [r["tokens"] for r in rows] == [1, 64, 256, 576, 8192]
    for r in rows:
        assert r["per_token_us"] > 0 and r["slot_mapping_us"] > 0
        assert r["ratio"] == pytest.approx(r["slot_mapping_us"] / r["per_token_us"])
    assert "| one 8192-token chunk | 8192 |" in p.stdout


def test_ncu_decode_summarizes_an_exported_source_page(tmp_path: str) -> None:
    # The layout `ncu --page source --csv --print-source sass` writes: a kernel line, the header,
    # one row per SASS instruction (addresses 16 bytes apart; a second 4 KB region here).
    header = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed",
              "stall_long_sb", "stall_no_inst", "stall_barrier", "stall_long_sb (Not Issued)"]  # fmt: skip
    rows = [
        ["0x7f0000000000", "LDGSTS.E.BYPASS.128 [R1], [R2]", "5", "512", "4", "1", "0", "9"],
        ["0x7f0000000010", "HMMA.16816.F32.BF16 R4, R8, R12, R4", "2", "512", "0", "2", "0", "9"],
        ["0x7f0000001000", "CCTL.IVALL", "9", "4096", "9", "0", "0", "9"],
    ]
    path = os.path.join(tmp_path, "source.csv")
    with open(path, "w", newline="") as f:
        w = csv.writer(f, quoting=csv.QUOTE_ALL)
        w.writerow(["Kernel Name", "decoder_layer_kernel", ""])
        w.writerow(header)
        w.writerows(rows)
    p = _run(os.path.join("bench", "ncu_decode.py"), "--summarize", path, "--top", "2")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "### 3 instructions, 4.0 KB of code, 16 samples" in p.stdout
    assert "| long_sb | 13 | 81.2 % |" in p.stdout and "| no_inst | 3 | 18.8 % |" in p.stdout
    assert "| 0 | 1024 | 7 | 4 | 3 | 0 |" in p.stdout  # the first 4 KB: two instructions
    assert "| 4 | 4096 | 9 | 9 | 0 | 0 |" in p.stdout
    assert "| 4.0 | 9 | `CCTL.IVALL` | long_sb |" in p.stdout


def test_control_storm_tiny_runs_its_trials(tmp_path: str) -> None:
    """bench/control_storm.py on the CPU: a real server, two storms, every output the reference."""
    out = os.path.join(tmp_path, "storm.json")
    p = _run(os.path.join("bench", "control_storm.py"), "--tiny", "--trials", "2", "--model-dir",
             os.path.join(tmp_path, "ckpt"), "--out", out, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    with open(out) as f:
        res = json.load(f)
    assert res["trials_passed"] == 2 and res["memory_saver"] is False
    assert all(sum(n for k, n in t["statuses"].items() if k.startswith("release")) == 10 for t in res["trials"])
