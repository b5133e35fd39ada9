"""Expert parallelism (`--enable-expert-parallel`): at tp_size 2 each rank holds half the experts
whole instead of half of every expert. On the CPU: the ranks' sums add up to the whole layer (the
torch reference, and fused_moe's kernels under Triton's interpreter with another rank's pairs as
the extra bucket); each rank loads its own experts from Hugging Face's per-expert names and
transformers 5's packed ones, and checks another rank's at their full shape; the engine at TP=2
over gloo gives transformers' greedy tokens and one rank's logprobs, takes updates by both
namings through every route, and returns transformers' router choices for routing replay; the
flag and SGLang's `--ep-size`. On a GPU: fused_moe with another rank's pairs, in bf16 (`pytest -m
gpu`; the engine at TP=2: tests/test_gpu_tensor_parallel.py)."""

from __future__ import annotations

import pytest
import torch
from interpreted import interpret
from oracle import hf_named_parameters
from test_moe import (
    EXPERTS,
    KNOBS,
    PROMPTS,
    _assert_logprobs_close,
    _distributed,
    _one_rank_logprobs,
    _outputs,
    expected,
)
from test_moe_kernels import moe_inputs, poison_unused, ref_align, ref_moe, rel_err, skewed_logits

from engine import Engine
from engine.config import ConfigError, EngineConfig, ModelConfig
from engine.errors import InvalidRequest
from engine.models import get_model_class
from engine.models.moe import reference_moe
from engine.parallel import TensorParallel
from engine.weights.loader import (
    WeightLoadError,
    iterate_checkpoint,
    load_checkpoint,
    load_named_tensors,
)
from engine.weights.targets import checkpoint_targets

RANKS = 2


def _shares(w13: torch.Tensor, w2: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Rank `rank`'s experts of RANKS: (w13, w2, the first one's id)."""
    local = w13.shape[0] // RANKS
    first = rank * local
    return w13[first : first + local].contiguous(), w2[first : first + local].contiguous(), first


def test_the_ranks_reference_sums_add_up_to_the_layer() -> None:
    T, E, k, H, inter = 13, 8, 2, 16, 12
    x, w13, w2 = moe_inputs(T, E, H, inter, torch.float64, seed=3)
    weights, ids = torch.sort(torch.softmax(torch.randn(T, E, dtype=torch.float64), -1), -1, descending=True)
    weights, ids = weights[:, :k], ids[:, :k]
    ids[0] = torch.tensor([0, E - 1])  # one token split over both ranks
    whole = reference_moe(x, w13, w2, weights, ids)
    parts = [reference_moe(x, a, b, weights, ids, first=f) for a, b, f in (_shares(w13, w2, r) for r in range(RANKS))]
    torch.testing.assert_close(parts[0] + parts[1], whole, rtol=1e-12, atol=1e-12)
    assert not torch.equal(parts[0], whole) and parts[1].abs().sum() > 0  # each rank holds a real share


def check_fused_moe_shares(device: str, cases: list[tuple[int, int, int, int, int]], dtype: torch.dtype, tol: float) -> None:
    """Each rank's fused_moe(first=) on its experts, with the model's ids: the ranks' outputs add
    up to the whole layer's reference; unused held experts are NaN."""
    from engine.kernels.fused_moe import fused_moe, topk_softmax

    for T, E, k, H, inter in cases:
        x, w13, w2 = moe_inputs(T, E, H, inter, dtype, seed=T + E + k, device=device)
        weights, ids = topk_softmax(skewed_logits(T, E, seed=T, device=device), k, True)
        total = torch.zeros((T, H), dtype=torch.float32, device=device)
        for rank in range(RANKS):
            a, b, first = _shares(w13, w2, rank)
            local = ids.long() - first
            poison_unused(a, b, local[(local >= 0) & (local < a.shape[0])])
            out = fused_moe(x, a, b, weights, ids, first=first)
            assert torch.isfinite(out).all(), (T, E, k, rank)
            total += out.float()
        err = rel_err(total, ref_moe(x, w13, w2, weights, ids))
        assert err <= tol, (T, E, k, err)


def check_align_shares(device: str, cases: list[tuple[int, int, int, int]]) -> None:
    """moe_align of the model's ids for each rank's half of E experts: the sort of the ids mapped
    to the rank's experts, another rank's to the last bucket (one program, and three launches)."""
    from engine.kernels.moe_align import moe_align

    for T, E, k, block_m in cases:
        ids = torch.sort(torch.softmax(skewed_logits(T, E, seed=T, device=device), -1), -1, descending=True)[1][:, :k]
        for rank in range(RANKS):
            first, held = rank * E // RANKS, E // RANKS
            local = ids - first
            slots, experts = ref_align(torch.where((local >= 0) & (local < held), local, held), held + 1, block_m)
            sorted_ids, expert_ids, num_padded = moe_align(ids.to(torch.int32), held + 1, block_m, first=first)
            n = num_padded.item()
            assert sorted_ids[:n].tolist() == slots and expert_ids[: n // block_m].tolist() == experts, (T, E, k, rank)


def test_align_shares_interpreted() -> None:
    # 9 buckets: 512 pairs a chunk, so 4,400 pairs take the three-launch path
    interpret("test_expert_parallel", "check_align_shares('cpu', [(7, 16, 4, 16), (1100, 16, 4, 64)])")


def test_fused_moe_shares_interpreted() -> None:
    # T=1: one tile a pair (another rank's pairs read expert E_r and write zeros); the rest sorted
    cases = "[(1, 16, 2, 64, 32), (7, 16, 4, 64, 32), (40, 16, 4, 32, 48)]"
    interpret("test_expert_parallel", f"check_fused_moe_shares('cpu', {cases}, torch.float32, 1e-5)")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fused_moe_shares_on_the_gpu() -> None:
    check_fused_moe_shares("cuda", [(1, 128, 8, 2048, 768), (3, 128, 8, 256, 128), (64, 128, 8, 256, 128),
                                    (513, 16, 2, 256, 128)], torch.bfloat16, 2e-2)


def test_the_flag_and_sglangs_ep_size(qwen3_moe_dir: str) -> None:
    from server.cli import build_parser, engine_config_from

    args = build_parser().parse_args(["serve", "--model", qwen3_moe_dir, "--tp-size", "2", "--ep-size", "2"])
    assert engine_config_from(args).enable_expert_parallel
    assert EngineConfig(model=qwen3_moe_dir, tp_size=2, enable_expert_parallel=True).ep_size == 2  # vLLM's form
    assert not EngineConfig(model=qwen3_moe_dir, tp_size=2).enable_expert_parallel
    with pytest.raises(ConfigError, match="ep_size must be 1 or tp_size"):
        EngineConfig(model=qwen3_moe_dir, tp_size=2, ep_size=4)


def _rank_model(path: str, rank: int, device: str = "cpu") -> torch.nn.Module:
    config = ModelConfig.from_hf(path)
    with torch.device(device):
        return get_model_class(config.architecture)(config, tp=TensorParallel(rank, RANKS, expert_parallel=True))


def test_each_rank_loads_its_own_experts_whole(qwen3_moe_dir: str) -> None:
    full = dict(iterate_checkpoint(qwen3_moe_dir))
    packed = hf_named_parameters(qwen3_moe_dir)
    for rank in range(RANKS):
        model = _rank_model(qwen3_moe_dir, rank)
        experts = model.model.layers[0].mlp.experts
        assert experts.gate_up_proj.shape == (4, 64, 64) and experts.down_proj.shape == (4, 64, 32)
        assert len(dict(iterate_checkpoint(qwen3_moe_dir, checkpoint_targets(_rank_model(qwen3_moe_dir, rank, "meta"))))) == len(full)
        load_checkpoint(model, qwen3_moe_dir)
        for i in range(4):
            e = 4 * rank + i
            assert torch.equal(experts.gate_up_proj[i, :32], full[f"{EXPERTS}.{e}.gate_proj.weight"])
            assert torch.equal(experts.gate_up_proj[i, 32:], full[f"{EXPERTS}.{e}.up_proj.weight"])
            assert torch.equal(experts.down_proj[i], full[f"{EXPERTS}.{e}.down_proj.weight"])
        loaded = {k: v.clone() for k, v in model.state_dict().items()}
        for p in model.parameters():
            p.data.zero_()
        load_named_tensors(model, packed, require_all=True)  # transformers 5's packed names: dim 0 sliced
        for k, v in model.state_dict().items():
            assert torch.equal(v, loaded[k]), k


def test_every_rank_checks_every_expert(qwen3_moe_dir: str) -> None:
    """Another rank's expert at a wrong shape is refused here too, before any byte lands; an
    expert the model does not have is refused by name."""
    good = list(iterate_checkpoint(qwen3_moe_dir))
    for rank in range(RANKS):
        model = _rank_model(qwen3_moe_dir, rank)
        load_checkpoint(model, qwen3_moe_dir)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        other = 7 - 4 * rank  # held by the other rank
        for name, bad, message in [(f"{EXPERTS}.{other}.up_proj.weight", torch.ones(31, 64), "shape"),
                                   (f"{EXPERTS}.{other}.down_proj.weight", torch.ones(64, 16), "shape"),
                                   (f"{EXPERTS}.8.up_proj.weight", torch.ones(32, 64), "unexpected")]:
            with pytest.raises(WeightLoadError, match=message):
                load_named_tensors(model, [*good, (name, bad)])
        for k, v in model.state_dict().items():
            assert torch.equal(v, before[k]), f"{k} changed by a refused load"


def _push(llm: Engine, pairs: list[tuple[str, torch.Tensor]]) -> dict:
    """update_weights_from_tensor of `pairs`: one payload both ranks read."""
    from engine.weights.payload import serialize_named_tensors

    return llm.update_weights_from_tensor([serialize_named_tensors(pairs)])


def test_two_ranks_of_whole_experts_equal_one_rank(qwen3_moe_dir: str, qwen3_moe_next_dir: str) -> None:
    """Tokens as transformers', logprobs as one rank's; updates by both namings per tensor, in a
    flattened bucket, by broadcast and from disk; a bad expert of either rank writes nothing; the
    weights survive a release and resume."""
    from engine.weights.payload import flatten_bucket, serialize_payload

    want = expected(qwen3_moe_dir, qwen3_moe_next_dir)
    per_expert = [(n, t.clone()) for n, t in iterate_checkpoint(qwen3_moe_next_dir)]
    packed = hf_named_parameters(qwen3_moe_next_dir)
    with Engine(model=qwen3_moe_dir, tp_size=2, enable_expert_parallel=True, **KNOBS) as llm:
        info = llm.get_server_info()
        assert info["tp_size"] == 2 and info["ep_size"] == 2
        ids, lps = _outputs(llm)
        assert ids == want["old"]
        _assert_logprobs_close(lps, _one_rank_logprobs(qwen3_moe_dir, PROMPTS, ids))
        for e in (1, 6):  # held by rank 0, by rank 1
            name = f"{EXPERTS}.{e}.down_proj.weight"
            with pytest.raises(InvalidRequest, match=name.replace(".", r"\.")):
                _push(llm, [*per_expert, (name, torch.ones(64, 31))])
        assert _outputs(llm)[0] == want["old"]
        assert _push(llm, per_expert)["success"]
        assert _outputs(llm)[0] == want["new"]
        llm.update_weights_from_disk(qwen3_moe_dir)
        assert _outputs(llm)[0] == want["old"]
        assert _push(llm, packed)["success"]
        assert _outputs(llm)[0] == want["new"]
        llm.update_weights_from_disk(qwen3_moe_dir)
        bucket = serialize_payload(flatten_bucket(packed))
        assert llm.update_weights_from_tensor([bucket], load_format="flattened_bucket")["success"]
        assert _outputs(llm)[0] == want["new"]
        llm.release_memory_occupation()
        llm.resume_memory_occupation()
        assert _outputs(llm)[0] == want["new"]
        assert _distributed(llm, hf_named_parameters(qwen3_moe_dir), None, RANKS)["success"]
        assert _outputs(llm)[0] == want["old"]
        assert _distributed(llm, per_expert, "flattened_bucket", RANKS)["success"]
        assert _outputs(llm)[0] == want["new"]


def test_routed_experts_are_the_global_choices(qwen3_moe_dir: str) -> None:
    """Routing replay at TP=2 with whole experts: every rank routes over all E experts, and the
    ids returned are transformers' router choices, not a rank's local indices."""
    from test_models import random_tokens
    from test_routed_experts import KNOBS as ROUTES
    from test_routed_experts import ask, rows, want

    prompt = random_tokens(30, seed=11)
    with Engine(model=qwen3_moe_dir, tp_size=2, enable_expert_parallel=True, **ROUTES) as llm:
        out = llm.generate(input_ids=[prompt], sampling_params=ask(6))[0]
    tokens = prompt + out.output_ids
    routed = rows(out.routed_experts)
    assert torch.equal(routed, want(qwen3_moe_dir, tokens[:-1]))
    assert (routed[:, 0] >= 4).any() and (routed[:, 0] < 4).any()  # experts of both ranks chosen


@pytest.mark.parametrize("family", ["qwen3_moe_dir", "qwen2_moe_dir", "mixtral_dir"])
@torch.no_grad()
def test_each_family_splits_its_experts_whole(family: str, request: pytest.FixtureRequest) -> None:
    """Qwen2-MoE (its shared expert stays sliced) and Mixtral (w1 / w3 / w2 names) too: each rank
    loads its experts from the checkpoint, and the ranks' sparse-layer outputs add up to one rank's."""
    path = request.getfixturevalue(family)
    config = ModelConfig.from_hf(path)
    whole = get_model_class(config.architecture)(config)
    load_checkpoint(whole, path)
    ranks = [_rank_model(path, r) for r in range(RANKS)]
    for model in ranks:
        load_checkpoint(model, path)
    layer = next(i for i, block in enumerate(whole.model.layers) if hasattr(block.mlp, "experts"))
    x = torch.randn(11, config.hidden_size, generator=torch.Generator().manual_seed(4))
    parts = [model.model.layers[layer].mlp(x) for model in ranks]
    torch.testing.assert_close(parts[0] + parts[1], whole.model.layers[layer].mlp(x), rtol=1e-5, atol=1e-5)
    held = whole.model.layers[layer].mlp.experts.gate_up_proj.shape[0] // RANKS
    for r, model in enumerate(ranks):
        mine = model.model.layers[layer].mlp.experts
        assert torch.equal(mine.gate_up_proj, whole.model.layers[layer].mlp.experts.gate_up_proj[r * held : (r + 1) * held])
        assert torch.equal(mine.down_proj, whole.model.layers[layer].mlp.experts.down_proj[r * held : (r + 1) * held])
