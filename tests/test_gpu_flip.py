"""The RL flip on a GPU with real releases (torch_memory_saver), float32 so that every output is
compared with `transformers` token for token: resuming `weights` maps pages and copies nothing;
the first forward restores what no update wrote since (engine/weights/store.py).

- resume, then generate: the old weights, bit for bit (weights_checker compare), all restored;
- resume, full push, generate: the pushed weights (equal to transformers on them), and only the
  computed rotary table restored: not one checkpoint byte copied back from the host;
- resume, partial push, generate: the pushed tensors and the old ones beside them (equal to
  transformers on that mix), and the host copy took the push (another release keeps it);
- a refused per-tensor push (one bad shape among good tensors) and an accepted one: both
  leave nothing of the sender's memory held once it drops its tensors.

Pushes are CUDA IPC handles from this process (the trainer) to the engine process, as verl and
slime send them; both routes (per-tensor and one flattened bucket)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from oracle import greedy_of

from engine import Engine, SamplingParams
from engine.config import ModelConfig
from engine.weights.payload import flatten_bucket, serialize_named_tensors, serialize_payload

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

KNOBS: dict[str, Any] = dict(device="cuda", dtype="float32", num_kv_blocks=1024, max_num_seqs=16,
                             max_model_len=256, cuda_graph_max_bs=8)
PROMPTS = [[5, 9, 13, 200, 7], [7] * 12, [100, 200, 300, 44]]
N = 12
GREEDY = SamplingParams(max_new_tokens=N, temperature=0.0, ignore_eos=True)


def _hf(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()


def _hf_greedy(model) -> list[list[int]]:
    return greedy_of(model, PROMPTS, N)


def _greedy(llm: Engine) -> list[list[int]]:
    outs = llm.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert all(o.error is None and len(o.output_ids) == N for o in outs), [o.error for o in outs]
    return [o.output_ids for o in outs]


@torch.no_grad()
def _perturb(model, names: list[str], seed: int) -> list[tuple[str, torch.Tensor]]:
    """New values for `names` in the HF model (in place), returned as (name, CUDA tensor) pairs."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    params = dict(model.named_parameters())
    for name in names:
        p = params[name]
        p.add_(torch.randn(p.shape, generator=gen, device="cuda") * 0.05)
    return [(n, params[n].detach().clone()) for n in names]


def _cycle_to_weights(llm: Engine) -> None:
    """The flip's first half: release everything, take the weights back (pages only)."""
    assert llm.release_memory_occupation()["changed"] == ["kv_cache", "weights", "cuda_graph"]
    res = llm.resume_memory_occupation(tags=["weights"])
    assert res["changed"] == ["weights"] and res["weights_valid"] is True, res
    assert res["weights_stale_bytes"] > 0.99 * llm.info["weights_bytes"], res


def test_resume_then_generate_restores_the_old_weights_bit_for_bit(qwen3_dir: str) -> None:
    with Engine(model=qwen3_dir, **KNOBS) as llm:
        expected = _greedy(llm)
        assert expected == _hf_greedy(_hf(qwen3_dir))
        assert llm.check_weights("snapshot")["success"]
        _cycle_to_weights(llm)
        llm.resume_memory_occupation()
        stale = llm.memory_occupation()["weights_stale_bytes"]
        assert _greedy(llm) == expected
        occ = llm.memory_occupation()
        assert occ["weights_stale_bytes"] == 0 and occ["last_weights_restore"]["bytes"] == stale, occ
        assert llm.check_weights("compare")["success"]


@pytest.mark.parametrize("route", ["tensor", "bucket"])
def test_full_push_after_resume_restores_nothing_and_equals_transformers(qwen3_dir: str, route: str) -> None:
    hf = _hf(qwen3_dir)
    with Engine(model=qwen3_dir, **KNOBS) as llm:
        _greedy(llm)  # graphs warm, prefix cache filled: the push must flush it
        _cycle_to_weights(llm)
        pairs = _perturb(hf, [n for n, _ in hf.named_parameters()], seed=11)
        if route == "bucket":
            answer = llm.update_weights_from_tensor([serialize_payload(flatten_bucket(pairs))],
                                                    load_format="flattened_bucket")
        else:
            answer = llm.update_weights_from_tensor([serialize_named_tensors(pairs)])
        assert answer["success"], answer
        del pairs
        assert llm.resume_memory_occupation()["tags"] == dict.fromkeys(("weights", "kv_cache", "cuda_graph"), "resident")
        stale = llm.memory_occupation()["weights_stale_bytes"]
        mc = ModelConfig.from_hf(qwen3_dir)
        assert stale == mc.max_position_embeddings * mc.head_dim * 4  # the float32 rotary table only
        assert _greedy(llm) == _hf_greedy(hf)
        assert llm.memory_occupation()["last_weights_restore"]["bytes"] == stale


def test_partial_push_keeps_the_other_weights_and_the_host_copy_takes_it(qwen3_dir: str) -> None:
    hf = _hf(qwen3_dir)
    with Engine(model=qwen3_dir, **KNOBS) as llm:
        _greedy(llm)
        _cycle_to_weights(llm)
        layer0 = [n for n, _ in hf.named_parameters() if n.startswith("model.layers.0.")]
        pairs = _perturb(hf, layer0 + ["model.layers.1.self_attn.k_proj.weight"], seed=12)
        assert llm.update_weights_from_tensor([serialize_named_tensors(pairs)])["success"]
        del pairs
        llm.resume_memory_occupation()
        mixed = _hf_greedy(hf)
        assert _greedy(llm) == mixed
        # The pushed tensors reached the host copy in the background: a plain release and resume
        # (no push) brings the mix back, not the checkpoint.
        llm.release_memory_occupation()
        llm.resume_memory_occupation()
        assert _greedy(llm) == mixed


def _sender_frees(before: int, timeout_s: float = 10.0) -> bool:
    """Whether this process's CUDA memory returns to `before` once the engine has let go of the
    tensors it sent (torch keeps a sent block in limbo until the receiver's reference is back)."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        torch.cuda.ipc_collect()
        if torch.cuda.memory_allocated() <= before:
            return True
        time.sleep(0.05)
    return False


def test_refused_and_accepted_pushes_leave_none_of_the_senders_memory_held(qwen3_dir: str) -> None:
    from engine.errors import InvalidRequest

    hf = _hf(qwen3_dir)
    with Engine(model=qwen3_dir, **KNOBS) as llm:
        expected = _greedy(llm)
        names = [n for n, _ in hf.named_parameters() if n.startswith("model.layers.0.")]
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        pairs = _perturb(hf, names, seed=13)
        bad = [*pairs[:-1], (pairs[-1][0], pairs[-1][1][:-1].clone())]  # the last one a row short
        with pytest.raises(InvalidRequest, match=bad[-1][0]):
            llm.update_weights_from_tensor([serialize_named_tensors(bad)])
        assert _greedy(llm) == expected  # the old weights in use
        del pairs, bad
        assert _sender_frees(before), torch.cuda.memory_allocated() - before
        pairs = _perturb(hf, names, seed=14)
        assert llm.update_weights_from_tensor([serialize_named_tensors(pairs)])["success"]
        del pairs
        assert _sender_frees(before), torch.cuda.memory_allocated() - before
        assert _greedy(llm) == _hf_greedy(hf)


def _join_group(llm: Engine, answers: list[Any]) -> Any:
    """The engine joins a two-rank NCCL group as rank 1; this process (the trainer) is rank 0 on GPU 1."""
    import threading

    from server_util import free_port

    from engine.weights.groups import trainer_group

    group = dict(master_address="127.0.0.1", master_port=free_port(), rank_offset=1, world_size=2,
                 group_name="flip", backend="nccl")
    joiner = threading.Thread(target=lambda: answers.append(llm.init_weights_update_group(**group)))
    joiner.start()
    handle = trainer_group("127.0.0.1", group["master_port"], 2, "flip", "nccl", device="cuda:1", timeout_s=60)
    joiner.join(60)
    assert answers and answers[-1]["success"], answers
    return handle


def _push_over_nccl(llm: Engine, handle: Any, pairs: list[tuple[str, torch.Tensor]], load_format: str | None) -> dict:
    import threading

    from engine.weights.groups import broadcast_from_trainer

    meta = dict(names=[n for n, _ in pairs], dtypes=["float32"] * len(pairs),
                shapes=[list(t.shape) for _, t in pairs], group_name="flip", load_format=load_format)
    answers: list[Any] = []
    updater = threading.Thread(target=lambda: answers.append(llm.update_weights_from_distributed(**meta)))
    updater.start()
    broadcast_from_trainer(handle, pairs, load_format)
    updater.join(60)
    assert answers and answers[0]["success"], answers
    return answers[0]


TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs: NCCL refuses two ranks on one")


@TWO_GPUS
def test_nccl_push_lands_in_the_parameters_and_equals_transformers(qwen3_dir: str) -> None:
    """A trainer on GPU 1 broadcasts (update_weights_from_distributed) into the engine on GPU 0:
    received straight into the parameters, nothing restored but the rotary table."""
    hf = _hf(qwen3_dir)
    with Engine(model=qwen3_dir, **KNOBS) as llm:
        _greedy(llm)
        _cycle_to_weights(llm)
        pairs = [(n, t.to("cuda:1")) for n, t in _perturb(hf, [n for n, _ in hf.named_parameters()], seed=13)]
        answer = _push_over_nccl(llm, _join_group(llm, []), pairs, None)
        assert answer["receive_route"] == f"per tensor, {len(pairs)} of {len(pairs)} in place", answer
        llm.resume_memory_occupation()
        mc = ModelConfig.from_hf(qwen3_dir)
        assert llm.memory_occupation()["weights_stale_bytes"] == mc.max_position_embeddings * mc.head_dim * 4
        assert _greedy(llm) == _hf_greedy(hf)


@TWO_GPUS
def test_nccl_bucket_in_model_order_lands_in_place_and_equals_transformers(qwen3_aligned_dir: str) -> None:
    """SGLang's flattened bucket over NCCL, the tensors in the model's own order (as a trainer's
    named_parameters gives them): one broadcast straight into the weights. In another order it
    goes through scratch, with the same result."""
    hf = _hf(qwen3_aligned_dir)
    names = [n for n, _ in hf.named_parameters()]
    with Engine(model=qwen3_aligned_dir, **KNOBS) as llm:
        _greedy(llm)
        handle = _join_group(llm, [])
        for seed, order, route in [(21, names, "bucket in place"), (22, names[::-1], "bucket via scratch")]:
            _cycle_to_weights(llm)
            pairs = [(n, t.to("cuda:1")) for n, t in _perturb(hf, order, seed=seed)]
            answer = _push_over_nccl(llm, handle, pairs, "flattened_bucket")
            assert answer["receive_route"] == route, answer
            llm.resume_memory_occupation()
            mc = ModelConfig.from_hf(qwen3_aligned_dir)
            assert llm.memory_occupation()["weights_stale_bytes"] == mc.max_position_embeddings * mc.head_dim * 4
            assert _greedy(llm) == _hf_greedy(hf)
