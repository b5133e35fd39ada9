"""Qwen3-MoE on the CPU against transformers on a tiny random checkpoint (float32; 8 experts, top-2
renormalised, a dense layer between two sparse ones): logits, router choices, greedy tokens and
logprobs through the engine; tensor parallelism over gloo; updates by Hugging Face's per-expert
names and transformers 5's packed ones through every route (test_moe_weights.py: the loader and
the weights region alone)."""

from __future__ import annotations

import functools

import pytest
import torch
from oracle import hf_greedy, hf_named_parameters
from test_models import PagedRunner, assert_close, build, hf_logits, hf_model, random_tokens

from engine import Engine, SamplingParams
from engine.config import ModelConfig
from engine.errors import InvalidRequest
from engine.models import get_model_class
from engine.models.moe import SparseMoE
from engine.weights.loader import iterate_checkpoint

PROMPTS = [[5, 9, 13, 200, 7], [7] * 20, list(range(30, 70))]
N = 12
GREEDY = SamplingParams(max_new_tokens=N, temperature=0.0, ignore_eos=True, logprobs=True)
KNOBS = dict(device="cpu", dtype="float32", max_model_len=512)
EXPERTS = "model.layers.0.mlp.experts"


@torch.no_grad()
def hf_router_ids(path: str, tokens: list[int]) -> list[torch.Tensor]:
    """transformers' top-k expert ids of each sparse layer, [len(tokens), k] each, best first."""
    model = hf_model(path)
    out = model(torch.tensor([tokens]), output_router_logits=True)
    k = model.config.num_experts_per_tok
    return [torch.topk(torch.softmax(logits.float(), dim=-1), k, dim=-1).indices for logits in out.router_logits]


@functools.cache
def expected(old: str, new: str) -> dict[str, list[list[int]]]:
    return {"old": hf_greedy(old, PROMPTS, N), "new": hf_greedy(new, PROMPTS, N)}


def _outputs(llm: Engine) -> tuple[list[list[int]], list[list[float]]]:
    outs = llm.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    return [o.output_ids for o in outs], [[lp for lp, _ in o.output_token_logprobs] for o in outs]


# ---- the model -------------------------------------------------------------------------------


def test_model_config_reads_the_moe_fields(qwen3_moe_dir: str, qwen3_dir: str) -> None:
    moe = ModelConfig.from_hf(qwen3_moe_dir)
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size) == (8, 2, 32)
    assert moe.norm_topk_prob and moe.decoder_sparse_step == 1 and moe.mlp_only_layers == (1,)
    dense = ModelConfig.from_hf(qwen3_dir)
    assert (dense.num_experts, dense.num_experts_per_tok, dense.moe_intermediate_size, dense.mlp_only_layers) == (0, 0, 0, ())
    model = build(qwen3_moe_dir)
    assert [isinstance(layer.mlp, SparseMoE) for layer in model.model.layers] == [True, False, True]


@pytest.mark.parametrize("block_size", [16, 8])
def test_prefill_then_decode_matches_transformers(qwen3_moe_dir: str, block_size: int) -> None:
    runner = PagedRunner(build(qwen3_moe_dir), block_size)
    prompts = {i: random_tokens(n, seed=i) for i, n in enumerate([45, 7, 16, 1])}
    decode = {i: random_tokens(3, seed=100 + i) for i in prompts}
    ours = runner.step(prompts)
    refs = {i: hf_logits(qwen3_moe_dir, prompts[i] + decode[i]) for i in prompts}
    for i in prompts:
        assert_close(ours[i], refs[i][: len(prompts[i])])
    for step in range(3):
        out = runner.step({i: [decode[i][step]] for i in prompts}, pad=2)
        for i in prompts:
            assert_close(out[i][0], refs[i][len(prompts[i]) + step])


def test_chunked_prefill_and_padded_pieces_as_for_dense_models(qwen3_moe_dir: str) -> None:
    """The dense models' tests of a chunked prefill (test_models.py) and of a step padded to a
    piecewise-graph size (test_piecewise_graph.py), on the MoE checkpoint."""
    import test_models
    import test_piecewise_graph

    test_models.test_chunked_prefill_matches_transformers(qwen3_moe_dir)
    for num_tokens in (5, 23):
        test_piecewise_graph.test_padded_pieces_equal_the_plain_forward(qwen3_moe_dir, num_tokens)


def test_router_choices_equal_transformers(qwen3_moe_dir: str) -> None:
    """The capture holds, per token of the step, each sparse layer's top-k ids as transformers
    chooses them (best first); the dense layer's column stays 0; a step overwrites its rows."""
    model = build(qwen3_moe_dir)
    routed = model.capture_routed_experts(max_tokens=64)
    assert model.routed_experts is routed and routed.buffer.shape == (64, 3, 2) and routed.buffer.dtype == torch.int32
    runner = PagedRunner(model, block_size=8)
    a, b = random_tokens(21, seed=1), random_tokens(9, seed=2)
    runner.step({0: a, 1: b})  # ragged: a's tokens, then b's
    step = routed.last(len(a) + len(b)).clone()
    for tokens, rows in ((a, step[: len(a)]), (b, step[len(a) :])):
        ref = hf_router_ids(qwen3_moe_dir, tokens)
        assert torch.equal(rows[:, 0].long(), ref[0]) and torch.equal(rows[:, 2].long(), ref[1])
        assert not rows[:, 1].any()
    extra = random_tokens(2, seed=3)
    runner.step({0: extra[:1], 1: extra[1:]})  # a decode step of both: rows 0 and 1
    for seq, (tokens, new) in enumerate(((a, extra[0]), (b, extra[1]))):
        ref = hf_router_ids(qwen3_moe_dir, tokens + [new])
        assert torch.equal(routed.last(2)[seq, 0].long(), ref[0][-1])
        assert torch.equal(routed.last(2)[seq, 2].long(), ref[1][-1])
    with pytest.raises(ValueError, match="no mixture-of-experts"):
        get_model_class("Qwen3ForCausalLM")(ModelConfig.from_hf(qwen3_moe_dir)).capture_routed_experts(8)


# ---- through the engine --------------------------------------------------------------------------


def _hf_logprobs(path: str, prompts: list[list[int]], outputs: list[list[int]]) -> list[list[float]]:
    """transformers' logprob of each output token given everything before it."""
    refs = []
    for prompt, out in zip(prompts, outputs, strict=True):
        logits = hf_logits(path, prompt + out[:-1])[len(prompt) - 1 :]
        refs.append(torch.log_softmax(logits, dim=-1)[torch.arange(len(out)), out].tolist())
    return refs


def _assert_logprobs_close(got: list[list[float]], want: list[list[float]]) -> None:
    for a, b in zip(got, want, strict=True):
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-4


def _distributed(llm: Engine, pairs: list[tuple[str, torch.Tensor]], load_format: str | None, ranks: int = 1) -> dict:
    """One update_weights_from_distributed into the engine's `ranks` ranks, the test as the trainer
    (rank 0 of a gloo group of 1 + ranks)."""
    import threading

    from server_util import free_port

    from engine.weights.groups import broadcast_from_trainer, trainer_group

    port, answers = free_port(), []
    group = dict(master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=1 + ranks,
                 group_name="moe", backend="gloo")  # fmt: skip
    joiner = threading.Thread(target=lambda: answers.append(llm.init_weights_update_group(**group)))
    joiner.start()
    handle = trainer_group("127.0.0.1", port, 1 + ranks, "moe", "gloo", timeout_s=60)
    joiner.join(60)
    meta = dict(names=[n for n, _ in pairs], dtypes=["float32"] * len(pairs),
                shapes=[list(t.shape) for _, t in pairs], group_name="moe", load_format=load_format)  # fmt: skip
    updater = threading.Thread(target=lambda: answers.append(llm.update_weights_from_distributed(**meta)))
    updater.start()
    broadcast_from_trainer(handle, pairs, load_format)
    updater.join(60)
    llm.destroy_weights_update_group("moe")
    return answers[-1]


def test_engine_matches_transformers_and_takes_every_update(qwen3_moe_dir: str, qwen3_moe_next_dir: str) -> None:
    """Greedy tokens and logprobs as transformers'; updates by per-expert names and by packed
    ones, per tensor, in a flattened bucket, by broadcast, from disk; bad pushes write nothing;
    the updated weights survive a release and resume."""
    from engine.weights.payload import flatten_bucket, serialize_named_tensors, serialize_payload

    want = expected(qwen3_moe_dir, qwen3_moe_next_dir)
    assert want["old"] != want["new"]
    per_expert = [(n, t.clone()) for n, t in iterate_checkpoint(qwen3_moe_next_dir)]  # as on disk
    packed = hf_named_parameters(qwen3_moe_next_dir)  # as transformers 5 names them
    with Engine(model=qwen3_moe_dir, **KNOBS) as llm:
        ids, lps = _outputs(llm)
        assert ids == want["old"]
        _assert_logprobs_close(lps, _hf_logprobs(qwen3_moe_dir, PROMPTS, ids))
        for name, bad in ((f"{EXPERTS}.8.gate_proj.weight", torch.ones(32, 64)),
                          (f"{EXPERTS}.1.down_proj.weight", torch.ones(64, 31))):  # fmt: skip
            with pytest.raises(InvalidRequest, match=name.replace(".", r"\.")):
                llm.update_weights_from_tensor([serialize_named_tensors([*per_expert, (name, bad)])])
        assert _outputs(llm)[0] == want["old"]

        assert llm.update_weights_from_tensor([serialize_named_tensors(per_expert)])["success"]
        assert _outputs(llm)[0] == want["new"]
        llm.update_weights_from_disk(qwen3_moe_dir)
        assert _outputs(llm)[0] == want["old"]
        bucket = serialize_payload(flatten_bucket(packed))
        assert llm.update_weights_from_tensor([bucket], load_format="flattened_bucket")["success"]
        ids, lps = _outputs(llm)
        assert ids == want["new"]
        _assert_logprobs_close(lps, _hf_logprobs(qwen3_moe_next_dir, PROMPTS, ids))
        llm.release_memory_occupation()
        llm.resume_memory_occupation()
        assert _outputs(llm)[0] == want["new"]

        assert _distributed(llm, hf_named_parameters(qwen3_moe_dir), None)["success"]  # packed, in place
        assert _outputs(llm)[0] == want["old"]
        assert _distributed(llm, per_expert, "flattened_bucket")["success"]
        assert _outputs(llm)[0] == want["new"]


@torch.inference_mode()
def _one_rank_logprobs(path: str, prompts: list[list[int]], outputs: list[list[int]]) -> list[list[float]]:
    """`_hf_logprobs` computed by this engine's model on one rank (no engine process)."""
    runner = PagedRunner(build(path), block_size=16)
    seqs = {i: p + o[:-1] for i, (p, o) in enumerate(zip(prompts, outputs, strict=True))}
    logits = runner.step(seqs)
    return [
        torch.log_softmax(logits[i][len(p) - 1 :].float(), dim=-1)[torch.arange(len(o)), o].tolist()
        for i, (p, o) in enumerate(zip(prompts, outputs, strict=True))
    ]


def test_two_ranks_equal_one_rank(qwen3_moe_dir: str, qwen3_moe_next_dir: str) -> None:
    """TP=2 over gloo: the tokens and logprobs of one rank; updates by either naming land in each
    rank's slices."""
    from engine.weights.payload import serialize_named_tensors

    want = expected(qwen3_moe_dir, qwen3_moe_next_dir)
    with Engine(model=qwen3_moe_dir, tp_size=2, **KNOBS) as llm:
        assert llm.get_server_info()["tp_size"] == 2
        ids, lps = _outputs(llm)
        assert ids == want["old"]
        _assert_logprobs_close(lps, _one_rank_logprobs(qwen3_moe_dir, PROMPTS, ids))
        per_expert = [(n, t.clone()) for n, t in iterate_checkpoint(qwen3_moe_next_dir)]
        assert llm.update_weights_from_tensor([serialize_named_tensors(per_expert)])["success"]
        assert _outputs(llm)[0] == want["new"]
        llm.update_weights_from_disk(qwen3_moe_dir)
        assert _outputs(llm)[0] == want["old"]
        packed = hf_named_parameters(qwen3_moe_next_dir)
        assert llm.update_weights_from_tensor([serialize_named_tensors(packed)])["success"]
        assert _outputs(llm)[0] == want["new"]


# ---- Qwen2-MoE: the shared expert ------------------------------------------------------------


def test_qwen2_moe_matches_transformers(qwen2_moe_dir: str) -> None:
    """Qwen2-MoE (q/k/v bias, a gated shared expert, routing weights not renormalised): prefill
    and decode logits, router choices, and the engine's greedy tokens and logprobs, at TP=1 and
    at TP=2 over gloo (each rank a slice of the shared expert as of every expert)."""
    model = build(qwen2_moe_dir)
    assert model.model.layers[0].mlp.shared_expert is not None and not model.model.layers[0].mlp.renormalize
    routed = model.capture_routed_experts(max_tokens=64)
    runner = PagedRunner(model, block_size=8)
    prompt, more = random_tokens(23, seed=4), random_tokens(2, seed=5)
    ref = hf_logits(qwen2_moe_dir, prompt + more)
    assert_close(runner.step({0: prompt})[0], ref[: len(prompt)])
    sparse = hf_router_ids(qwen2_moe_dir, prompt)
    assert torch.equal(routed.last(len(prompt))[:, 0].long(), sparse[0])
    assert torch.equal(routed.last(len(prompt))[:, 2].long(), sparse[1])
    for i, token in enumerate(more):
        assert_close(runner.step({0: [token]})[0][0], ref[len(prompt) + i])
    want = hf_greedy(qwen2_moe_dir, PROMPTS, N)
    for tp in (1, 2):
        with Engine(model=qwen2_moe_dir, tp_size=tp, **KNOBS) as llm:
            ids, lps = _outputs(llm)
            assert ids == want, tp
            _assert_logprobs_close(lps, _hf_logprobs(qwen2_moe_dir, PROMPTS, ids))


# ---- Mixtral: every layer sparse, its own checkpoint names ----------------------------------------


def test_mixtral_matches_transformers_and_takes_both_namings(mixtral_dir: str, mixtral_next_dir: str) -> None:
    """Mixtral's checkpoint names (`block_sparse_moe.experts.{e}.w1`) load, as do transformers 5's
    (`mlp.experts.gate_up_proj`, what a trainer sends): logits, greedy tokens and logprobs as
    transformers'; an update by either naming gives the updated model's tokens."""
    from engine.weights.payload import serialize_named_tensors

    names = [n for n, _ in iterate_checkpoint(mixtral_dir)]
    assert any(".block_sparse_moe.experts.3.w2." in n for n in names)
    runner = PagedRunner(build(mixtral_dir), block_size=8)
    prompt = random_tokens(19, seed=6)
    assert_close(runner.step({0: prompt})[0], hf_logits(mixtral_dir, prompt))
    want = {"old": hf_greedy(mixtral_dir, PROMPTS, N), "new": hf_greedy(mixtral_next_dir, PROMPTS, N)}
    assert want["old"] != want["new"]
    with Engine(model=mixtral_dir, **KNOBS) as llm:
        ids, lps = _outputs(llm)
        assert ids == want["old"]
        _assert_logprobs_close(lps, _hf_logprobs(mixtral_dir, PROMPTS, ids))
        on_disk = [(n, t.clone()) for n, t in iterate_checkpoint(mixtral_next_dir)]
        assert llm.update_weights_from_tensor([serialize_named_tensors(on_disk)])["success"]
        assert _outputs(llm)[0] == want["new"]
        packed = hf_named_parameters(mixtral_dir)
        assert any(n.endswith("mlp.experts.gate_up_proj") for n, _ in packed)
        assert llm.update_weights_from_tensor([serialize_named_tensors(packed)])["success"]
        assert _outputs(llm)[0] == want["old"]
