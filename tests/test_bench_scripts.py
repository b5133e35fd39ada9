"""The benchmark scripts run on the device machine only, so CI runs what it can of them
(test_bench_suite.py checks the suite's shape): bench_memory.py without a GPU exits 2 with a JSON
file that says why; bench_engine.py, bench_serving.py, bench_flip.py (every push mode a CPU has),
bench_replicas.py (where smg is installed), control_storm.py, bench_speculative.py,
bench_deterministic.py and probes/grammar_fill.py run every code path of theirs in `--tiny` mode
on the CPU (numbers meaningless, fields checked); kernels/occupancy.py's compiles are
test_occupancy.py's."""

from __future__ import annotations

import json
import os

import pytest
import torch
from bench_util import run_script


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_bench_memory_without_a_gpu_says_why(tmp_path: str) -> None:
    out = os.path.join(tmp_path, "memory.json")
    p = run_script(os.path.join("bench", "bench_memory.py"), "--out", out)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert "needs an NVIDIA GPU" in p.stdout
    with open(out) as f:
        assert "gpu" in json.load(f)["errors"]


def test_bench_engine_tiny_measures_the_shape_it_loads(tmp_path: str) -> None:
    out, ckpt = os.path.join(tmp_path, "engine.json"), os.path.join(tmp_path, "ckpt")
    p = run_script(os.path.join("bench", "bench_engine.py"), "--tiny", "--model-dir", ckpt, "--skip", "hf", "--out", out)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    with open(out) as f:
        res = json.load(f)
    assert res["errors"] == {} and res["checkpoint"]["path"] == ckpt
    shape = res["meta"]["model_shape"]
    with open(os.path.join(ckpt, "config.json")) as f:
        assert shape["hidden_size"] == json.load(f)["hidden_size"]
    kv_per_token = 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * shape["head_dim"] * 2  # bf16
    assert res["decode"]["kv_bytes_per_token"] == kv_per_token
    # Every batch size at every context (the tiny run's 32 and 128 tokens), in that order.
    assert [(d["context"], d["batch_size"]) for d in res["decode"]["batches"]] == [(c, b) for c in (32, 128) for b in (1, 4, 8)]
    assert res["throughput"]["output_tokens"] == res["throughput"]["expected_output_tokens"]
    # The mixed section: B decodes + one fresh C-token prompt in one step vs the two apart.
    mixed, args = res["mixed"], res["meta"]["args"]
    assert (mixed["batch_size"], mixed["chunk_tokens"], mixed["context"]) == (4, 32, int(args["decode_contexts"].split(",")[0]))
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


def test_bench_tokenizer_decodes_every_id_of_the_model(tmp_path: str) -> None:
    """The serving checkpoint's tokenizer for a vocabulary wider than the demo's 512: every id
    decodes to text (a random model samples them all), and text encodes as the demo's does."""
    code = (
        "import sys; sys.path.insert(0, 'bench'); import json\n"
        "from serving_checkpoint import widen_tokenizer\n"
        "from engine.demo_model import build_tokenizer, save_tokenizer\n"
        "from transformers import AutoTokenizer\n"
        f"p = {str(tmp_path)!r}; save_tokenizer(p); widen_tokenizer(p, 2000)\n"
        "t = AutoTokenizer.from_pretrained(p)\n"
        "words = [t.decode([i]) for i in range(512, 2000)]\n"
        "text = 'Hello world, ça va? 日本語'\n"
        "print(json.dumps([len(t), len(set(words)), min(len(w) for w in words), words[:2],\n"
        "                  t(text)['input_ids'] == build_tokenizer()(text)['input_ids']]))\n"
    )
    p = run_script("-c", code)
    assert p.returncode == 0, p.stdout + p.stderr
    size, distinct, shortest, first, same_encoding = json.loads(p.stdout.strip().splitlines()[-1])
    assert size == 2000 and distinct == 2000 - 512 and shortest >= 4  # " " and three letters at least
    assert all(w.startswith(" ") and w[1:].isalpha() for w in first) and same_encoding


def test_bench_serving_compares_a_second_servers_flags(tmp_path: str) -> None:
    """`--compare-server-args --deterministic`: a second server, started with the flag (its
    attention backend is the mode's), runs batched, singles and n8 again; a row per mode against
    the same mode without, with --compare-target."""
    out = os.path.join(tmp_path, "compare.json")
    p = run_script(os.path.join("bench", "bench_serving.py"), "--tiny", "--model-dir", os.path.join(tmp_path, "ckpt"),
             "--out", out, "--skip", "engine,streams,online,longtail", "--compare-server-args=--deterministic",
             "--compare-target", "0.5")  # fmt: skip
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-3000:]
    with open(out) as f:
        res = json.load(f)
    assert res["errors"] == {}
    assert res["server"]["attention_backend"] == "sdpa" and res["server_compare"]["attention_backend"] == "sdpa_rows"
    assert set(res["rl_compare"]["8"]) == {"batched", "singles", "n8"}
    assert all(r["failed"] == 0 and r["output_tokens"] == 64 for r in res["rl_compare"]["8"].values())
    rows = [r for r in res["table"] if "with --deterministic" in r["metric"]]
    assert len(rows) == 3 and all(r["target"] == ">= 0.5" and r["ratio"] > 0 for r in rows), rows


def test_bench_serving_tiny_runs_every_section(tmp_path: str) -> None:
    out = os.path.join(tmp_path, "serving.json")
    server_args = "--device cpu --dtype float32 --kv-cache-memory-gb 0.05 --max-model-len 256 --api-server-count 2"
    args = ["--tiny", "--model-dir", os.path.join(tmp_path, "ckpt"), "--out", out, "--rounds", "3",
            "--server-args", server_args, "--deadline-s", "400"]  # every section, however busy the machine
    p = run_script(os.path.join("bench", "bench_serving.py"), *args)
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
    longtail = res["longtail"]  # the tiny run's 2 x 64-token prompts, 16 new tokens each
    assert (longtail["sequences"], longtail["prompt_tokens"], longtail["output_tokens_each"]) == (2, 64, 16)
    assert longtail["ok"] == longtail["requests"] == 2 and longtail["output_tokens"] == longtail["expected_output_tokens"] == 32
    assert longtail["tokens_per_s_per_sequence"] == pytest.approx(longtail["tokens_per_s"] / 2) and longtail["mean_step_ms"] > 0
    metrics = [row["metric"] for row in res["table"]]
    assert any("batched" in m and "Engine" in m for m in metrics) and any("online" in m for m in metrics)
    assert any(m.startswith("long tail 2 x 64-token prompts") for m in metrics)
    assert "| N=8 one batched /generate" in p.stdout


def test_bench_replicas_tiny_runs_every_section(tmp_path: str) -> None:
    """Two CPU replicas alone and behind the real gateway (smg, which the GPU machine lacks): every
    request answered, both replicas served some, the flip fanned out to both left their greedy
    outputs unchanged under the new weight version."""
    pytest.importorskip("smg")
    out = os.path.join(tmp_path, "r.json")
    p = run_script(os.path.join("bench", "bench_replicas.py"), "--tiny", "--model-dir", os.path.join(tmp_path, "ckpt"), "--out", out,
             "--deadline-s", "400", "--startup-timeout-s", "300")  # every section, however busy the machine
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
    ones and for vLLM's dialect, whose CUDA-IPC update becomes vLLM's broadcast backend), two timed
    flips each (tensor twice: a second round pools its flips with the first's), and the bench's own
    proof that the server took the pushed weights."""
    out = os.path.join(tmp_path, "flip.json")
    args = ["--tiny", "--flips", "2", "--out", out, "--model-dir", os.path.join(tmp_path, "ckpt")]
    p = run_script(os.path.join("bench", "bench_flip.py"), *args, "--push", "bucket,tensor,distributed,distributed_bucket,vllm_ipc,tensor")
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-3000:]
    with open(out) as f:
        res = json.load(f)
    assert res["errors"] == {} and res["skipped"] == []
    assert res["meta"]["model_bytes"] > 0 and res["meta"]["num_tensors"] > 0
    for mode in ("bucket", "tensor", "distributed", "distributed_bucket", "vllm_ipc"):
        sec = res["push"][mode]
        rounds = 2 if mode == "tensor" else 1
        assert sec["rounds"] == rounds and [f["round"] for f in sec["flips"]] == [r + 1 for r in range(rounds) for _ in "ab"]
        assert len(sec["flips"]) == 2 * rounds and len(sec["warmup"]) == rounds, mode
        for flip in sec["flips"]:
            for key in ("release_wall_s", "resume_weights_wall_s", "push_wall_s"):
                assert flip[key] > 0 and flip["resume_kv_wall_s"] > 0, (mode, key)
            total = flip["release_wall_s"] + flip["resume_weights_wall_s"] + flip["push_wall_s"]
            assert flip["flip_total_s"] == pytest.approx(total + flip["resume_kv_wall_s"])
            assert flip["push_answer"]["success"] and flip["push_s"] > 0
            assert flip["generated_tokens"] == 4 * 8 and flip["generate_wall_s"] > 0
            assert flip["version_ok"] and flip["verify"]["all_changed"], (mode, flip.get("verify"))
        summary = sec["summary"]
        assert summary["flips"] == 2 * rounds and summary["flip_total_s_median"] > 0
        assert summary["push_bandwidth_bytes_per_s"] > 0
    verify = res["verify"]
    assert verify["flips_checked"] == 18 and verify["restored_exactly"]
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
    # vLLM's dialect on the same server: /sleep (level 1, the SGLang flip's tags), /wake_up weights,
    # /update_weights (no version named: the engine keeps the last SGLang flip's), /wake_up kv_cache.
    vllm = res["push"]["vllm_ipc"]
    assert vllm["transport"].startswith("gloo") and vllm["group"]["answer"]["success"] and vllm["destroy_answer"]["success"]
    for flip in vllm["warmup"] + vllm["flips"]:
        assert flip["release_answer"]["status"] == "sleeping" and flip["release_answer"]["level"] == 1
        assert sorted(flip["release_answer"]["changed"]) == ["kv_cache", "weights"]
        assert flip["resume_weights_answer"]["changed"] == ["weights"] and flip["resume_kv_answer"]["changed"] == ["kv_cache"]
        assert "'vllm_weight_transfer'" in flip["push_answer"]["message"] and flip["weight_version"] == "distributed_bucket-2"
    dialects = next(r for r in res["table"] if r["metric"].startswith("vLLM dialect / SGLang dialect"))
    assert dialects["ratio"] > 0 and "/ tensor" in dialects["metric"] and dialects["ok"] is None and "CPU" in dialects["note"]


def test_bench_flip_tiny_at_tp_size_2(tmp_path: str) -> None:
    """The flip against a server of two tensor-parallel ranks: a payload per rank (bucket) and a
    group of the trainer and both ranks (distributed; the per-tensor and flat variants of each run
    at one rank above), and the checksums of both ranks' shards say each flip changed every tensor
    and the checkpoint pushed back restored them bit for bit."""
    out = os.path.join(tmp_path, "flip.json")
    args = ["--tiny", "--tp-size", "2", "--flips", "1", "--out", out, "--model-dir", os.path.join(tmp_path, "ckpt")]
    p = run_script(os.path.join("bench", "bench_flip.py"), *args, "--push", "bucket,distributed")
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-3000:]
    with open(out) as f:
        res = json.load(f)
    assert res["errors"] == {} and res["server"]["tp_size"] == 2
    assert res["push"]["distributed"]["group"]["body"]["world_size"] == 3
    assert res["refs"]["broadcast"]["world_size"] == 3  # the plain broadcast reaches both ranks too
    assert res["verify"]["ranks"] == 2  # both ranks' shards checksummed, each flip and at the end
    for mode in ("bucket", "distributed"):
        flip = res["push"][mode]["flips"][0]
        assert flip["version_ok"] and flip["verify"]["all_changed"], (mode, flip.get("verify"))
    assert res["verify"]["restored_exactly"] and res["verify"]["pushed_weights_taken"] is True


def test_bench_tp_tiny_moe_measures_every_mode_in_one_run(tmp_path: str) -> None:
    """TP=1, TP=2 with sliced experts and TP=2 with whole experts, one engine each (each in a
    process of its own: two tensor-parallel engines cannot share one process's default group),
    every batch size measured in each, and the table compares them."""
    out = os.path.join(tmp_path, "tp.json")
    p = run_script(os.path.join("bench", "bench_tp.py"), "--shape", "tiny-moe", "--model-dir", os.path.join(tmp_path, "ckpt"),
                   "--device", "cpu", "--batch-sizes", "1,2", "--decode-steps", "2", "--decode-warmup", "1",
                   "--max-model-len", "256", "--decode-context", "64", "--expert-parallel", "--out", out)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-3000:]
    with open(out) as f:
        res = json.load(f)
    assert {bs: sorted(by_mode) for bs, by_mode in res["steps_s"].items()} == {"1": ["1", "2", "2 ep"], "2": ["1", "2", "2 ep"]}
    assert all(s > 0 for by_mode in res["steps_s"].values() for s in by_mode.values())
    assert [r["metric"] for r in res["table"]] == [
        "decode step bs=1: TP=2 (ms); ref = TP=1", "decode step bs=1: TP=2 whole experts (ms); ref = TP=2 sliced",
        "decode step bs=2: TP=2 (ms); ref = TP=1", "decode step bs=2: TP=2 whole experts (ms); ref = TP=2 sliced",
    ]


def test_control_storm_tiny_runs_its_trials(tmp_path: str) -> None:
    """bench/control_storm.py on the CPU: a real server, two storms, every output the reference."""
    out = os.path.join(tmp_path, "storm.json")
    p = run_script(os.path.join("bench", "control_storm.py"), "--tiny", "--trials", "2", "--model-dir",
             os.path.join(tmp_path, "ckpt"), "--out", out, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    with open(out) as f:
        res = json.load(f)
    assert res["trials_passed"] == 2 and res["memory_saver"] is False
    assert all(sum(n for k, n in t["statuses"].items() if k.startswith("release")) == 10 for t in res["trials"])


def test_bench_speculative_tiny_gives_plain_decodings_outputs(tmp_path: str) -> None:
    """bench/bench_speculative.py on the CPU: both engines run every workload; the outputs with
    drafts are plain decoding's, and the second rollout's drafts are accepted."""
    out = os.path.join(tmp_path, "spec.json")
    p = run_script(os.path.join("bench", "bench_speculative.py"), "--tiny", "--batch-sizes", "1,2", "--output-len", "24",
             "--model-dir", os.path.join(tmp_path, "ckpt"), "--out", out, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    with open(out) as f:
        res = json.load(f)
    assert [row[0] for row in res["table"]] == [f"{w}, B={b}: tok/s per sequence" for b in (1, 2)
                                                for w in ("second rollout", "fresh")]
    assert all(row[-1] is True for row in res["table"])
    drafted, kept = res["modes"]["ngram"]["drafted"]
    assert kept >= 0.9 * drafted and kept >= 20


def test_bench_deterministic_tiny_measures_both_modes(tmp_path: str) -> None:
    """bench/bench_deterministic.py on the CPU: the default engine and the deterministic ones
    (`--ab-batch-decode`: a second, without the mode's batch decode, which a CPU never attaches) each run every decode
    batch and the RL rollouts; a row per batch and one for the rollouts, per mode."""
    out = os.path.join(tmp_path, "det.json")
    p = run_script(os.path.join("bench", "bench_deterministic.py"), "--tiny", "--model-dir", os.path.join(tmp_path, "ckpt"),
             "--out", out, "--ab-batch-decode", timeout=300)  # fmt: skip
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    with open(out) as f:
        res = json.load(f)
    modes = res["modes"]
    assert modes["default"]["attention_backend"] == "sdpa" and modes["deterministic (auto)"]["attention_backend"] == "sdpa_rows"
    for mode in modes.values():
        assert sorted(mode["decode"]) == ["1", "4"] and all(d["steps"] == 30 for d in mode["decode"].values())
        assert mode["rl"]["tokens"] == 4 * 16 and len(mode["rl"]["rounds_tok_s"]) == 3 and mode["rl"]["warmup_tok_s"] > 0
        assert mode["rl"]["tokens_per_s"] == sorted(mode["rl"]["rounds_tok_s"])[1]  # the median round
    assert [row[0] for row in res["table"]] == [
        row for name in ("deterministic (auto)", "deterministic (auto, no batch decode)")
        for row in [f"{name}: decode step, bs={b}" for b in (1, 4)] + [f"{name}: RL rollouts (engine), tok/s"]
    ]  # fmt: skip


def test_grammar_fill_tiny_measures_both_backends(tmp_path: str) -> None:
    """bench/probes/grammar_fill.py on a ~2k-token BPE it trains: every backend compiles every
    grammar, every mask it fills allows the document's next token, and the one table prints."""
    out = os.path.join(tmp_path, "fill.json")
    p = run_script(os.path.join("bench", "probes", "grammar_fill.py"), "--tiny", "--batch", "8", "--max-steps", "16",
             "--cache-dir", os.path.join(tmp_path, "cache"), "--out", out)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    with open(out) as f:
        res = json.load(f)
    assert res["tokenizer"]["vocab"] == 2048 and res["tokenizer"]["trained"]
    assert set(res["backends"]) == {"xgrammar", "llguidance"}
    for name, backend in res["backends"].items():
        assert backend["tokenizer_info_s"] > 0 and set(backend["grammars"]) == {"json_schema", "json_object", "regex", "regex_words"}
        for kind, g in backend["grammars"].items():
            assert g["compile_s"] > 0 and g["batch1"]["tokens"] > 10 and g["batch1"]["fill_s_p50"] > 0, (name, kind)
            assert g["sequential"]["steps"] == g["parallel"]["steps"] == 16, (name, kind)
            assert g["batch1"]["refused"] == g["sequential"]["refused"] == g["parallel"]["refused"] == 0, (name, kind)
    assert len(res["table"]) == 8 and "## grammar mask fill, 2048-token BPE" in p.stdout
