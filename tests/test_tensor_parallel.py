"""Tensor parallelism on the CPU: two ranks (two processes joined by gloo) against one rank and
transformers, for every architecture (tied and untied embeddings, q/k/v biases, one KV head
replicated across ranks, a vocabulary the ranks split unevenly); the loader reading only each
rank's slice; release/resume and every weight update on both ranks over HTTP, all or nothing;
a killed rank, which leaves no socket behind."""

from __future__ import annotations

import glob
import os
import shutil
import signal
import tempfile
import threading
import time

import httpx
import pytest
import torch
from oracle import hf_greedy, hf_named_parameters
from server_util import BackgroundStream, ServerProcess, free_port, logged_server
from transformers import Qwen2Config, Qwen2ForCausalLM

from engine import Engine, EngineDeadError, SamplingParams
from engine.config import ModelConfig
from engine.models import get_model_class
from engine.parallel import TensorParallel
from engine.weights.loader import iterate_checkpoint
from engine.weights.targets import checkpoint_targets

PROMPTS = [[5, 9, 13, 200, 7], [7] * 20, list(range(30, 70))]
N = 16
GREEDY = SamplingParams(max_new_tokens=N, temperature=0.0, ignore_eos=True, logprobs=True)
# Also the prompt's logprobs and top alternatives: scored from the vocabulary-parallel logits.
SCORED = SamplingParams(max_new_tokens=N, temperature=0.0, ignore_eos=True, logprobs=True,
                        logprob_start_len=0, top_logprobs_num=3)
KNOBS = dict(device="cpu", dtype="float32", max_model_len=512)


@pytest.fixture
def private_tmp(monkeypatch: pytest.MonkeyPatch):
    """A temporary directory of this test's own for every process it starts (TMPDIR, and this
    process's tempfile): another suite on the machine makes its ranks' socket directories
    elsewhere, so they never count as this server's. Short: a socket path has ~107 bytes."""
    path = tempfile.mkdtemp(prefix="st-")
    monkeypatch.setenv("TMPDIR", path)
    monkeypatch.setattr(tempfile, "tempdir", path)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _rank_socket_dirs() -> set[str]:
    """The ranks' socket directories (engine/core/ranks.py): in a client's socket directory, or
    (without one) in the temporary directory itself."""
    tmp = tempfile.gettempdir()
    return {*glob.glob(os.path.join(tmp, "siesta-tp-*")), *glob.glob(os.path.join(tmp, "siesta-*", "siesta-tp-*"))}


@pytest.fixture(scope="module")
def odd_vocab_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Qwen2-shaped, untied, with a vocabulary of 509: rank 1 of 2 holds 254 rows and a pad row."""
    from engine.demo_model import save_tokenizer

    torch.manual_seed(5)
    config = Qwen2Config(vocab_size=509, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    model = Qwen2ForCausalLM(config).to(torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    path = str(tmp_path_factory.mktemp("odd_vocab"))
    model.save_pretrained(path)
    save_tokenizer(path)
    return path


def _run(model_dir: str, tp: int) -> tuple[list[list[int]], list[list[float]], list[list]]:
    """Greedy ids, their logprobs, and per prompt position (logprob, top alternatives)."""
    with Engine(model=model_dir, tp_size=tp, **KNOBS) as llm:
        outs = llm.generate(input_ids=PROMPTS, sampling_params=SCORED)
        info = llm.get_server_info()
        assert info["tp_size"] == tp and len(info["tp_worker_pids"]) == tp - 1
        assert info["kv_blocks_free"] == info["kv_blocks_total"]
    prompt = [[(lp, top) for (lp, _), top in zip(o.input_token_logprobs, o.input_top_logprobs, strict=True)] for o in outs]
    return [o.output_ids for o in outs], [[lp for lp, _ in o.output_token_logprobs] for o in outs], prompt


@pytest.mark.parametrize("which", ["llama", "qwen2", "qwen3", "mistral", "odd_vocab"])
def test_two_ranks_equal_one_rank_and_transformers(which: str, request: pytest.FixtureRequest) -> None:
    model_dir = request.getfixturevalue(f"{which}_dir")
    expected = hf_greedy(model_dir, PROMPTS, N)
    one_ids, one_lps, one_prompt = _run(model_dir, 1)
    two_ids, two_lps, two_prompt = _run(model_dir, 2)
    assert one_ids == expected
    assert two_ids == expected
    for a, b in zip(one_lps, two_lps, strict=True):
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-4
    for a, b in zip(one_prompt, two_prompt, strict=True):
        assert a[0] == b[0] == (None, None)  # prompt token 0: nothing predicts it
        for (lp1, top1), (lp2, top2) in zip(a[1:], b[1:], strict=True):
            assert abs(lp1 - lp2) < 1e-4 and [t for t, _ in top1] == [t for t, _ in top2]
            assert max(abs(v1 - v2) for (_, v1), (_, v2) in zip(top1, top2, strict=True)) < 1e-4


def test_each_rank_reads_only_its_slice(odd_vocab_dir: str) -> None:
    """The loader hands each rank its part of a sharded tensor, read as a slice of the file."""
    config = ModelConfig.from_hf(odd_vocab_dir)
    full = dict(iterate_checkpoint(odd_vocab_dir))
    for rank in (0, 1):
        with torch.device("meta"):
            model = get_model_class(config.architecture)(config, tp=TensorParallel(rank, 2))
        targets = checkpoint_targets(model)
        got = dict(iterate_checkpoint(odd_vocab_dir, targets))
        q = "model.layers.0.self_attn.q_proj.weight"  # 64 rows of 16-dim heads: 32 per rank
        assert torch.equal(got[q], full[q][rank * 32 : (rank + 1) * 32])
        o = "model.layers.0.self_attn.o_proj.weight"  # row-parallel: input columns split
        assert torch.equal(got[o], full[o][:, rank * 32 : (rank + 1) * 32])
        lm = "lm_head.weight"  # 509 rows: 255 on rank 0, 254 (and a pad row) on rank 1
        assert got[lm].shape[0] == (255, 254)[rank] and torch.equal(got[lm], full[lm][rank * 255 : rank * 255 + got[lm].shape[0]])
        assert targets[lm].view.shape[0] == 255 and targets[lm].shape == tuple(full[lm].shape)
        norm = "model.norm.weight"  # replicated
        assert torch.equal(got[norm], full[norm])


# ---- over HTTP: release/resume and weight updates on both ranks -----------------------------------


@pytest.fixture(scope="module")
def server(qwen3_dir: str, tmp_path_factory: pytest.TempPathFactory):
    proc = logged_server(qwen3_dir, str(tmp_path_factory.mktemp("logs")), "tp_server", "--tp-size", "2")
    yield proc
    proc.stop()


def _generate(http: httpx.Client) -> list[list[int]]:
    body = {"input_ids": PROMPTS, "sampling_params": {"max_new_tokens": N, "temperature": 0, "ignore_eos": True}}
    r = http.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return [o["output_ids"] for o in r.json()]


def test_release_and_resume_on_both_ranks(server: ServerProcess, expected) -> None:
    with server.client() as http:
        assert _generate(http) == expected["old"]
        occupation = http.get("/memory_occupation").json()
        assert [r["tp_rank"] for r in occupation["ranks"]] == [0, 1]
        released = http.post("/release_memory_occupation", json={"tags": ["kv_cache", "weights"]}).json()
        assert released["changed"] == ["kv_cache", "weights"]
        assert [r["changed"] for r in released["ranks"]] == [["kv_cache", "weights"]] * 2
        refused = http.post("/generate", json={"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 2}})
        assert refused.status_code == 503 and "weights" in refused.json()["error"]["message"]
        occupation = http.get("/memory_occupation").json()
        assert all(r["tags"]["weights"]["state"] == "released" for r in occupation["ranks"])
        resumed = http.post("/resume_memory_occupation", json={}).json()
        assert resumed["success"] is True and resumed["changed"] == ["weights", "kv_cache"]
        assert [r["changed"] for r in resumed["ranks"]] == [["weights", "kv_cache"]] * 2
        assert _generate(http) == expected["old"]
        # A release that waits for a running request, then a resume: the request finished first.
        stream = BackgroundStream(server.url, {"input_ids": PROMPTS[1], "stream": True,
                                               "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}})
        assert stream.started()
        assert http.post("/release_memory_occupation", json={}).status_code == 200
        assert stream.join()["finish_reason"]["type"] == "length"
        assert http.post("/resume_memory_occupation", json={}).json()["success"] is True
        assert _generate(http) == expected["old"]


def test_updates_from_disk_and_tensor_on_both_ranks(server: ServerProcess, qwen3_dir: str, qwen3_next_dir: str, expected) -> None:
    from engine.weights.payload import serialize_named_tensors

    pairs = hf_named_parameters(qwen3_next_dir)
    with server.client() as http:
        r = http.post("/update_weights_from_disk", json={"model_path": qwen3_next_dir})
        assert r.status_code == 200, r.text
        assert _generate(http) == expected["new"]
        http.post("/update_weights_from_disk", json={"model_path": qwen3_dir})
        assert _generate(http) == expected["old"]
        # One payload per rank, rank 1's with one bad tensor: refused, and neither rank wrote a byte.
        name, tensor = pairs[3]
        bad = [(n, t[:-1] if n == name else t) for n, t in pairs]
        r = http.post("/update_weights_from_tensor",
                      json={"serialized_named_tensors": [serialize_named_tensors(pairs), serialize_named_tensors(bad)]})
        assert r.status_code == 400 and "rank 1" in r.json()["error"]["message"] and name in r.json()["error"]["message"]
        assert _generate(http) == expected["old"]
        three = http.post("/update_weights_from_tensor", json={"serialized_named_tensors": ["x", "y", "z"]})
        assert three.status_code == 400 and "one per tensor-parallel rank" in three.json()["error"]["message"]
        # One payload per rank, then one that both ranks read: each rank keeps its slice.
        per_rank = [serialize_named_tensors(pairs), serialize_named_tensors(pairs)]
        assert http.post("/update_weights_from_tensor", json={"serialized_named_tensors": per_rank}).status_code == 200
        assert _generate(http) == expected["new"]
        http.post("/update_weights_from_disk", json={"model_path": qwen3_dir})
        shared = [serialize_named_tensors(pairs)]
        assert http.post("/update_weights_from_tensor", json={"serialized_named_tensors": shared}).status_code == 200
        assert _generate(http) == expected["new"]
        # Released and resumed: both ranks bring back the new weights from their host copies.
        http.post("/release_memory_occupation", json={})
        http.post("/resume_memory_occupation", json={})
        assert _generate(http) == expected["new"]
        http.post("/update_weights_from_disk", json={"model_path": qwen3_dir})
        assert _generate(http) == expected["old"]
        # The same tensors pushed again, as a trainer pushes its parameters every step: two ranks
        # read each shared-memory payload, and the tensors stay readable for the next one.
        again = [serialize_named_tensors(pairs)]
        assert http.post("/update_weights_from_tensor", json={"serialized_named_tensors": again}).status_code == 200
        assert _generate(http) == expected["new"]
        http.post("/update_weights_from_disk", json={"model_path": qwen3_dir})
        assert _generate(http) == expected["old"]


def test_update_from_distributed_joins_every_rank(server: ServerProcess, qwen3_dir: str, qwen3_next_dir: str, expected) -> None:
    """The trainer is rank 0 of a group of 1 + 2: the engine's ranks join as rank_offset + tp_rank."""
    from engine.weights.groups import broadcast_from_trainer, trainer_group

    pairs = hf_named_parameters(qwen3_next_dir)
    port = free_port()
    group = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 3,
             "group_name": "tp-group", "backend": "gloo"}
    with server.client() as http:
        answers: list = []
        joiner = threading.Thread(target=lambda: answers.append(http.post("/init_weights_update_group", json=group)))
        joiner.start()
        handle = trainer_group("127.0.0.1", port, 3, "tp-group", "gloo", timeout_s=60)
        joiner.join(60)
        assert answers[0].status_code == 200 and "ranks 1..2" in answers[0].json()["message"], answers[0].text
        meta = {"names": [n for n, _ in pairs], "dtypes": ["float32"] * len(pairs),
                "shapes": [list(t.shape) for _, t in pairs], "group_name": "tp-group", "weight_version": "tp-1"}
        for load_format, weights in ((None, pairs), ("flattened_bucket", hf_named_parameters(qwen3_dir))):
            updater = threading.Thread(target=lambda f=load_format: answers.append(
                http.post("/update_weights_from_distributed", json=meta | {"load_format": f})))
            updater.start()
            broadcast_from_trainer(handle, weights, load_format)
            updater.join(60)
            assert answers[-1].status_code == 200, answers[-1].text
            if load_format is None:  # a rank keeps a slice of most tensors: those arrive in scratch slots
                assert "through two scratch slots" in answers[-1].json()["receive_route"], answers[-1].text
            assert _generate(http) == (expected["new"] if weights is pairs else expected["old"])
        assert http.post("/destroy_weights_update_group", json={"group_name": "tp-group"}).status_code == 200


def test_weights_checker_checks_every_rank(server: ServerProcess, qwen3_dir: str, qwen3_next_dir: str, expected) -> None:
    """slime's --check-weight-update-equal at tp_size 2: every rank snapshots, resets and compares
    its own shards; checksums come per rank, as SGLang's."""
    with server.client() as http:
        info = http.get("/server_info").json()
        assert info["tp_size"] == 2 and info["tp_worker_pids"]

        def check(action: str) -> httpx.Response:
            return http.post("/weights_checker", json={"action": action})

        first = check("checksum").json()
        assert [r["parallelism_info"]["tp_rank"] for r in first["ranks"]] == [0, 1]
        assert {r["parallelism_info"]["tp_size"] for r in first["ranks"]} == {2}
        sums = [r["checksums"] for r in first["ranks"]]
        assert sums[0].keys() == sums[1].keys()  # the same names, each rank's own shards
        assert sums[0]["model.layers.0.self_attn.qkv_proj.weight"] != sums[1]["model.layers.0.self_attn.qkv_proj.weight"]
        assert sums[0]["model.norm.weight"] == sums[1]["model.norm.weight"]  # replicated
        assert "2 ranks" in check("snapshot").json()["message"]
        assert check("reset_tensors").status_code == 200
        assert _generate(http) != expected["old"]
        bad = check("compare")
        assert bad.status_code == 400 and "differ from the snapshot" in bad.json()["error"]["message"]
        assert http.post("/update_weights_from_disk", json={"model_path": qwen3_dir}).status_code == 200
        assert check("compare").status_code == 200
        assert check("checksum").json()["per_engine_checksum"] == first["per_engine_checksum"]
        assert _generate(http) == expected["old"]
        assert http.post("/update_weights_from_disk", json={"model_path": qwen3_next_dir}).status_code == 200
        moved = check("checksum").json()["ranks"]
        assert all(m["per_gpu_checksum"] != f["per_gpu_checksum"] for m, f in zip(moved, first["ranks"], strict=True))
        assert http.post("/update_weights_from_disk", json={"model_path": qwen3_dir}).status_code == 200


def test_a_killed_rank_takes_the_engine_down(qwen3_dir: str, private_tmp: str) -> None:
    before = _rank_socket_dirs()
    server = ServerProcess(qwen3_dir, "--max-model-len", "512", "--tp-size", "2")
    try:
        ours = _rank_socket_dirs() - before  # the ranks' sockets exist while they run
        assert ours
        info = httpx.get(f"{server.url}/get_server_info").json()
        worker, engine = info["tp_worker_pids"][0], info["engine_pid"]
        stream = BackgroundStream(server.url, {"input_ids": PROMPTS[1], "stream": True,
                                               "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}})
        assert stream.started()
        os.kill(worker, signal.SIGKILL)
        # The running request ends with an error, not a hang; health says 503; nothing is left over.
        stream._thread.join(10)
        assert not stream._thread.is_alive()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
            time.sleep(0.05)
        health = httpx.get(f"{server.url}/health", timeout=2)
        assert health.status_code == 503 and "rank 1" in health.text, health.text
        server.proc.wait(timeout=15)
        assert server.proc.returncode not in (0, None)
        assert not os.path.exists(f"/proc/{engine}") or "Z" in open(f"/proc/{engine}/stat").read().split()[2]
        # Rank 0 died without closing its sockets: the server removed them with its own (only
        # this server's are judged: its TMPDIR is the test's own).
        assert not ours & _rank_socket_dirs(), ours & _rank_socket_dirs()
    finally:
        server.stop()


def test_engine_api_raises_when_a_rank_dies(qwen3_dir: str, private_tmp: str) -> None:
    before = _rank_socket_dirs()
    with Engine(model=qwen3_dir, tp_size=2, **KNOBS) as llm:
        ours = _rank_socket_dirs() - before
        assert ours
        os.kill(llm.get_server_info()["tp_worker_pids"][0], signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError, match="rank 1"):
            for _ in range(100):
                llm.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        assert time.monotonic() - t0 < 15
    assert not ours & _rank_socket_dirs(), ours & _rank_socket_dirs()
