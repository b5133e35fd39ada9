"""A trainer's NCCL weight update into a tensor-parallel server, on three GPUs (`pytest -m gpu` on
nvidia-h200-x4): this process is the trainer on GPU 0, the engine's two ranks run on GPUs 1 and 2
(CUDA_VISIBLE_DEVICES while the engine starts), and all three make one NCCL group (SGLang's
`init_weights_update_group`, the ranks joining as rank_offset + tp_rank).

- `update_weights_from_distributed`, per tensor and as one `flattened_bucket`, lands on both
  ranks: each rank's checksums (`weights_checker`) equal those of the same weights loaded from
  disk, which is each rank's slice of the trainer's tensors; greedy tokens equal `transformers`.
- A bad tensor among good ones (a shape no rank can take, a name the model lacks) is refused
  before any byte moves: both ranks keep their old weights, checksum for checksum, and the group
  still carries the next push.

Dense Qwen3 and Qwen3-MoE (experts sliced by their intermediate dimension on each rank), fp32."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from oracle import greedy_of
from server_util import free_port

from engine import Engine, SamplingParams
from engine.errors import InvalidRequest
from engine.weights.groups import broadcast_from_trainer, trainer_group

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 3, reason="needs three GPUs: the trainer's and two ranks'"),
]

TRAINER = torch.device("cuda", 0)
SERVER_GPUS = "1,2"
KNOBS: dict[str, Any] = dict(device="cuda", dtype="float32", tp_size=2, max_model_len=256, max_num_seqs=8,
                             cuda_graph_max_bs=4)
PROMPTS = [[5, 9, 13, 200, 7], [7] * 12, [100, 200, 300, 44]]
N = 12
GREEDY = SamplingParams(max_new_tokens=N, temperature=0.0, ignore_eos=True)
FAMILIES = {"dense": ("qwen3_dir", "qwen3_next_dir"), "moe": ("qwen3_moe_dir", "qwen3_moe_next_dir")}


def _hf_pairs(model_dir: str) -> tuple[list[tuple[str, torch.Tensor]], list[list[int]]]:
    """The trainer's tensors on its GPU (named as its model names them) and their greedy tokens."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(TRAINER).eval()
    pairs = [(n, p.detach().clone()) for n, p in model.named_parameters()]
    return pairs, greedy_of(model, PROMPTS, N)


def _greedy(llm: Engine) -> list[list[int]]:
    llm.flush_cache()
    outs = llm.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert all(o.error is None for o in outs), [o.error for o in outs]
    return [o.output_ids for o in outs]


def _per_rank(llm: Engine) -> list[dict[str, str]]:
    ranks = llm.check_weights("checksum")["ranks"]
    assert [r["parallelism_info"]["tp_rank"] for r in ranks] == [0, 1]
    return [r["checksums"] for r in ranks]


def _meta(pairs: list[tuple[str, torch.Tensor]], load_format: str | None) -> dict[str, Any]:
    return dict(names=[n for n, _ in pairs], dtypes=["float32"] * len(pairs),
                shapes=[list(t.shape) for _, t in pairs], group_name="tp-push", load_format=load_format)


def _push(llm: Engine, handle: Any, pairs: list[tuple[str, torch.Tensor]], load_format: str | None) -> dict:
    answers: list[Any] = []
    updater = threading.Thread(target=lambda: answers.append(llm.update_weights_from_distributed(**_meta(pairs, load_format))))
    updater.start()
    broadcast_from_trainer(handle, pairs, load_format)
    updater.join(120)
    assert answers and answers[0]["success"], answers
    return answers[0]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_nccl_push_into_two_ranks_lands_each_slice_and_refuses_a_bad_tensor(
    family: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    old_dir, new_dir = (request.getfixturevalue(f) for f in FAMILIES[family])
    old, old_tokens = _hf_pairs(old_dir)  # CUDA is up in this process before the engine's GPUs are named
    new, new_tokens = _hf_pairs(new_dir)
    assert old_tokens != new_tokens
    with monkeypatch.context() as env:
        env.setenv("CUDA_VISIBLE_DEVICES", SERVER_GPUS)  # the engine's processes only
        llm = Engine(model=old_dir, **KNOBS)
    with llm:
        assert llm.get_server_info()["tp_size"] == 2
        assert _greedy(llm) == old_tokens
        sums_old = _per_rank(llm)
        # The oracle of each rank's slice: the same weights through the startup loader.
        llm.update_weights_from_disk(new_dir)
        sums_new = _per_rank(llm)
        assert all(a.keys() == b.keys() and a != b for a, b in zip(sums_old, sums_new, strict=True))
        llm.update_weights_from_disk(old_dir)
        assert _per_rank(llm) == sums_old

        group = dict(master_address="127.0.0.1", master_port=free_port(), rank_offset=1, world_size=3,
                     group_name="tp-push", backend="nccl")
        joined: list[Any] = []
        joiner = threading.Thread(target=lambda: joined.append(llm.init_weights_update_group(**group)))
        joiner.start()
        handle = trainer_group("127.0.0.1", group["master_port"], 3, "tp-push", "nccl", device=TRAINER, timeout_s=120)
        joiner.join(120)
        assert joined and joined[0]["success"] and "ranks 1..2" in joined[0]["message"], joined

        for pairs, load_format, sums, tokens in ((new, None, sums_new, new_tokens),
                                                 (old, "flattened_bucket", sums_old, old_tokens),
                                                 (new, "flattened_bucket", sums_new, new_tokens),
                                                 (old, None, sums_old, old_tokens)):
            _push(llm, handle, pairs, load_format)
            assert _per_rank(llm) == sums, (family, load_format)
            assert _greedy(llm) == tokens, (family, load_format)

        # Refused before any broadcast: the trainer sends nothing, both ranks keep the old weights.
        (name, tensor), rest = new[0], new[1:]
        bad_shape = [(name, tensor.reshape(-1)[: tensor.numel() - 1].contiguous()), *rest]
        unknown = [*new, ("model.layers.99.mlp.not_a_weight", torch.ones(4, device=TRAINER))]
        for bad, load_format in ((bad_shape, None), (bad_shape, "flattened_bucket"), (unknown, None)):
            with pytest.raises(InvalidRequest):
                llm.update_weights_from_distributed(**_meta(bad, load_format))
            assert _per_rank(llm) == sums_old, (family, load_format)
        assert _greedy(llm) == old_tokens
        _push(llm, handle, new, None)  # the group carries the next push: no broadcast was half-sent
        assert _per_rank(llm) == sums_new and _greedy(llm) == new_tokens
        assert llm.destroy_weights_update_group("tp-push")["success"]
