"""vLLM's sleep levels and the weights' host copy, on a CPU: level 1 keeps the host copy and a
wake restores from it; level 2 frees it (the host RAM goes back to the trainer: the engine
process's RSS drops by the weights' bytes), and it is made again, from the device, only once an
update has written every checkpoint tensor; until then a wake of more than `weights` is a 400.

The store's rules are checked on a `WeightStore` alone; the server's on a real `siesta serve`
whose checkpoint is big enough (~60 MB) to see in the RSS, and at tp_size 2, where every rank
drops and remakes its own copy."""

from __future__ import annotations

import httpx
import pytest
import torch
from oracle import hf_greedy, hf_named_parameters
from server_util import ServerProcess
from test_weight_store import cpu_store
from transformers import Qwen3Config, Qwen3ForCausalLM

from engine.weights.loader import load_checkpoint, load_named_tensors
from engine.weights.payload import serialize_named_tensors
from engine.weights.store import WeightStore

PROMPT = [5, 9, 13, 200, 7, 31, 64]
N = 8
SERVE = ("--max-model-len", "256", "--max-num-batched-tokens", "256", "--max-num-seqs", "4", "--num-kv-blocks", "32")


@pytest.fixture(scope="module")
def big_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A Qwen3 of ~60 MB in float32 (hidden 512, 4 layers): more than glibc's largest mmap
    threshold, so a freed host copy goes back to the kernel at once."""
    from engine.demo_model import save_tokenizer

    config = Qwen3Config(
        vocab_size=512, hidden_size=512, intermediate_size=2048, head_dim=64, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
        initializer_range=0.1, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True,
    )
    torch.manual_seed(4)
    model = Qwen3ForCausalLM(config).to(torch.float32).eval()
    path = str(tmp_path_factory.mktemp("big_qwen3"))
    model.save_pretrained(path)
    save_tokenizer(path)
    return path


def _rss(pid: int) -> int:
    """Resident bytes of process `pid`."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def _generate(http: httpx.Client) -> httpx.Response:
    body = {"sampling_params": {"temperature": 0.0, "max_tokens": N, "ignore_eos": True}, "token_ids": PROMPT}
    return http.post("/inference/v1/generate", json=body)


def _tokens(http: httpx.Client) -> list[int]:
    r = _generate(http)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def _wake_refused(http: httpx.Client) -> None:
    r = http.post("/wake_up")
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "level-2" in message and "update the weights" in message, message


# ---- the store alone ------------------------------------------------------------------------------


def _release(store: WeightStore, drop_host: bool) -> None:
    store.released(drop_host=drop_host)
    store.flat.fill_(0xFF)  # what lost pages hold, as far as any reader may know: NaN


def _same(store: WeightStore, got: torch.Tensor, want: torch.Tensor) -> bool:
    """Every piece's bytes equal (the padding between them is no one's)."""
    return all(torch.equal(got[p.offset : p.offset + p.nbytes], want[p.offset : p.offset + p.nbytes]) for p in store.pieces)


def test_the_store_drops_its_host_copy_and_makes_it_again_once_all_is_written(qwen3_dir: str) -> None:
    store = cpu_store(qwen3_dir)
    want = store.flat.clone()
    checkpoint = [p.name for p in store.pieces if not p.computed]
    _release(store, drop_host=True)
    assert store.host is None and store.host_bytes == 0 and store.host_copy_kind == "discarded"
    assert store.missing() == len(checkpoint)

    hf = dict(hf_named_parameters(qwen3_dir))
    some = ["model.embed_tokens.weight", "model.layers.0.mlp.down_proj.weight"]
    store.written(load_named_tensors(store.model, [(n, hf[n]) for n in some]))
    store.refresh_host()
    assert store.host is None and store.missing() == len(checkpoint) - len(some)  # partial: still none
    _release(store, drop_host=False)  # a level-1 release after it: nothing can restore the weights
    assert store.host is None and store.missing() == len(checkpoint)
    with pytest.raises(RuntimeError, match="without a host copy"):
        store.ensure_current()

    store.written(load_checkpoint(store.model, qwen3_dir))
    assert store.host is None  # made by the refresh after the update's answer, not before
    store.refresh_host()
    assert store.host_copy_kind == "pageable" and store.host_bytes == store.nbytes
    assert _same(store, store.host, want)  # computed buffers recomputed before the copy
    _release(store, drop_host=False)
    store.ensure_current()
    assert _same(store, store.flat, want)


def test_without_a_kept_copy_a_level_2_release_drops_nothing(qwen3_dir: str) -> None:
    store = cpu_store(qwen3_dir, host_copy=False)  # --weights-backup none
    _release(store, drop_host=True)
    store.written(load_checkpoint(store.model, qwen3_dir))
    store.refresh_host()
    assert store.host is None and store.host_copy_kind == "none" and store.missing() == 0


# ---- a real server --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def big_server(big_dir: str, tmp_path_factory: pytest.TempPathFactory):
    proc = ServerProcess(big_dir, *SERVE, log_path=str(tmp_path_factory.mktemp("logs") / "sleep_levels.log"))
    yield proc
    proc.stop()


def test_level_2_frees_the_host_copy_and_an_update_brings_it_back(big_server: ServerProcess, big_dir: str) -> None:
    want = hf_greedy(big_dir, [PROMPT], N)[0]
    with big_server.client() as http:
        pid = http.get("/get_server_info").json()["engine_pid"]
        assert _tokens(http) == want
        before = http.get("/memory_occupation").json()
        nbytes = before["weights_host_copy_bytes"]
        assert before["weights_host_copy"] == "pageable" and nbytes > 50 << 20, before
        rss = _rss(pid)

        slept = http.post("/sleep", params={"level": "2"})
        assert slept.status_code == 200, slept.text
        reply = slept.json()
        assert reply["host_bytes_freed"] == nbytes and reply["weights_host_copy_bytes"] == 0, reply
        assert reply["weights_host_copy"] == "discarded" and reply["weights_valid"] is False, reply
        occupation = http.get("/memory_occupation").json()
        assert occupation["weights_host_copy_bytes"] == 0 and occupation["weights_host_copy"] == "discarded"
        assert occupation["weights_backup"] == "host" and occupation["weights_valid"] is False
        freed = rss - _rss(pid)
        assert freed > 0.8 * nbytes, (freed, nbytes)

        # A partial update: still discarded, no copy made; a level-1 sleep then cannot restore.
        assert http.post("/wake_up", params={"tags": "weights"}).status_code == 200
        some = [(n, t) for n, t in hf_named_parameters(big_dir) if ".layers.0." in n]
        partial = http.post("/update_weights_from_tensor", json={"serialized_named_tensors": [serialize_named_tensors(some)]})
        assert partial.status_code == 200 and partial.json()["weights_valid"] is False, partial.text
        assert http.get("/memory_occupation").json()["weights_host_copy_bytes"] == 0
        _wake_refused(http)
        assert http.post("/sleep", params={"level": "1"}).status_code == 200
        _wake_refused(http)
        assert _generate(http).status_code == 503

        # Every tensor written: the copy is made again from the device, and the wake succeeds.
        assert http.post("/wake_up", params={"tags": "weights"}).status_code == 200
        low = _rss(pid)
        updated = http.post("/update_weights", json={"weight_dir": big_dir})
        assert updated.status_code == 200, updated.text
        occupation = http.get("/memory_occupation").json()
        assert occupation["weights_host_copy"] == "pageable" and occupation["weights_host_copy_bytes"] == nbytes
        assert occupation["weights_valid"] is True
        assert _rss(pid) - low > 0.8 * nbytes
        assert http.post("/wake_up").status_code == 200
        assert _tokens(http) == want

        # Level 1 with no update: the remade copy restores the weights.
        slept = http.post("/sleep", params={"level": "1"}).json()
        assert slept["host_bytes_freed"] == 0 and slept["weights_host_copy_bytes"] == nbytes, slept
        assert http.post("/wake_up").status_code == 200
        assert _tokens(http) == want


def test_every_rank_drops_and_remakes_its_copy(qwen3_dir: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    """tp_size 2: the level-2 sleep frees each rank's host copy, the update makes each again."""
    want = hf_greedy(qwen3_dir, [PROMPT], N)[0]
    log = str(tmp_path_factory.mktemp("logs") / "sleep_levels_tp.log")
    server = ServerProcess(qwen3_dir, *SERVE, "--tp-size", "2", log_path=log)
    try:
        with server.client() as http:
            ranks = http.get("/memory_occupation").json()["ranks"]
            held = [r["weights_host_copy_bytes"] for r in ranks]
            assert len(held) == 2 and all(b > 0 for b in held)
            reply = http.post("/sleep", params={"level": "2"}).json()
            assert reply["host_bytes_freed"] == sum(held)
            assert [r["host_bytes_freed"] for r in reply["ranks"]] == held, reply
            ranks = http.get("/memory_occupation").json()["ranks"]
            assert [(r["weights_host_copy"], r["weights_host_copy_bytes"]) for r in ranks] == [("discarded", 0)] * 2
            _wake_refused(http)
            assert http.post("/wake_up", params={"tags": "weights"}).status_code == 200
            assert http.post("/update_weights", json={"weight_dir": qwen3_dir}).status_code == 200
            ranks = http.get("/memory_occupation").json()["ranks"]
            assert [r["weights_host_copy_bytes"] for r in ranks] == held
            assert http.post("/wake_up").status_code == 200
            assert _tokens(http) == want
            assert http.post("/sleep", params={"level": "1"}).status_code == 200
            assert http.post("/wake_up").status_code == 200
            assert _tokens(http) == want
    finally:
        server.stop()

