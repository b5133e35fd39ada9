"""Speculative decoding with a draft model (`--speculative-algorithm draft`,
engine/runner/draft_model.py) on a CPU, tiny random checkpoints: the tokens are plain decoding's
whatever the draft proposes.

- The target as its own draft: greedy tokens equal plain decoding's (logprobs within 1e-4),
  nearly every draft is accepted and a step yields several tokens; a one-layer draft of other
  weights (the same vocabulary), and one whose context (48) is shorter than the requests: still
  plain decoding's tokens.
- `--deterministic`, seeded sampled requests: bitwise plain decoding's tokens and logprobs.
- Drafts proposed twice before a step verifies them: the same drafts (the catch-up reruns
  position n, which the draft KV already holds), then plain decoding's tokens.
- Weights: the draft's ride as `draft.`-named tensors. An update of them through the
  update-from-tensors call changes what is drafted (a target-weight draft accepts almost all, a
  one-layer draft's weights pushed over it fewer), never the tokens; a full update of the target
  from disk needs no draft tensors; a release and resume keeps both.
- Config: SGLang's STANDALONE and vLLM's draft_model name it; the algorithm without a path, or
  at tp_size > 1, is refused.
"""

from __future__ import annotations

import pytest
import torch
from conftest import TINY, _randomized, _save
from test_models import random_tokens
from test_speculative import KNOBS, greedy, run, sampled
from transformers import Qwen3Config, Qwen3ForCausalLM

from engine import Engine
from engine.config import ConfigError, EngineConfig
from engine.weights.targets import OPTIONAL_PREFIX

PROMPTS = [random_tokens(23, seed=1), random_tokens(9, seed=2), random_tokens(40, seed=4)]


def _one_layer_draft(path: str, **shape: int) -> str:
    """One layer of other random weights, the tiny Qwen3's vocabulary (`shape`: TINY's changes)."""
    config = Qwen3Config(**(TINY | shape), num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         tie_word_embeddings=True)  # fmt: skip
    return _save(_randomized(Qwen3ForCausalLM, config, seed=9), path)


@pytest.fixture(scope="module")
def small_draft_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return _one_layer_draft(str(tmp_path_factory.mktemp("draft")))


@pytest.fixture(scope="module")
def short_draft_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A 48-token context: shorter than the requests below."""
    return _one_layer_draft(str(tmp_path_factory.mktemp("short_draft")), max_position_embeddings=48)


def spec_knobs(draft: str, **kw: object) -> dict:
    return dict(KNOBS, speculative_algorithm="draft", speculative_draft_model_path=draft, **kw)


def drafted(llm: Engine) -> tuple[int, int, int]:
    info = llm.get_server_info()
    return info["spec_draft_tokens"], info["spec_accepted_tokens"], info["num_steps"]


def same(got: list, want: list) -> None:
    for (ids, lps), (want_ids, want_lps) in zip(got, want, strict=True):
        assert ids == want_ids
        assert max(abs(a - b) for a, b in zip(lps, want_lps, strict=True)) < 1e-4


def test_greedy_tokens_are_plain_decodings_whatever_the_draft(qwen3_dir: str, small_draft_dir: str, short_draft_dir: str) -> None:
    params = [greedy(), greedy(30), greedy(45)]
    with Engine(model=qwen3_dir, dtype="float32", **KNOBS) as llm:
        plain = run(llm, PROMPTS, params)
        [run(llm, [p], [sp]) for p, sp in zip(PROMPTS, params, strict=True)]
        plain_steps = drafted(llm)[2]
    with Engine(model=qwen3_dir, dtype="float32", **spec_knobs(qwen3_dir)) as llm:
        together = run(llm, PROMPTS, params)
        alone = [run(llm, [p], [sp])[0] for p, sp in zip(PROMPTS, params, strict=True)]
        proposed, kept, steps = drafted(llm)
    same(together, plain)
    same(alone, plain)
    assert proposed >= 100 and kept >= 0.9 * proposed, (proposed, kept)
    assert steps < 0.4 * plain_steps, (steps, plain_steps)  # several tokens a step
    for draft in (small_draft_dir, short_draft_dir):  # the short one drafts up to its 48 positions only
        with Engine(model=qwen3_dir, dtype="float32", **spec_knobs(draft)) as llm:
            other = run(llm, PROMPTS, params)
            assert drafted(llm)[0] > 0
        same(other, plain)


def test_deterministic_sampled_tokens_and_logprobs_are_bitwise_plain_decodings(qwen3_dir: str) -> None:
    params = [sampled(1), sampled(2), sampled(3)]
    knobs = dict(KNOBS, deterministic=True)
    with Engine(model=qwen3_dir, dtype="float32", **knobs) as llm:
        plain = [run(llm, [p], [sp])[0] for p, sp in zip(PROMPTS, params, strict=True)]
    with Engine(model=qwen3_dir, dtype="float32", **spec_knobs(qwen3_dir, deterministic=True)) as llm:
        spec = [run(llm, [p], [sp])[0] for p, sp in zip(PROMPTS, params, strict=True)]
        proposed, kept, _ = drafted(llm)
    assert spec == plain
    assert proposed > 0 and kept > 0


def test_draft_weights_update_by_name_release_resume_and_target_updates(qwen3_dir: str, qwen3_next_dir: str) -> None:
    from safetensors.torch import load_file

    from engine.errors import InvalidRequest
    from engine.weights.payload import serialize_named_tensors

    params = [greedy(40)]
    with Engine(model=qwen3_next_dir, dtype="float32", **KNOBS) as llm:
        want_next = run(llm, PROMPTS[:1], params)
    with Engine(model=qwen3_dir, dtype="float32", **KNOBS) as llm:
        want = run(llm, PROMPTS[:1], params)
    with Engine(model=qwen3_dir, dtype="float32", **spec_knobs(qwen3_dir)) as llm:
        same(run(llm, PROMPTS[:1], params), want)
        p0, k0, _ = drafted(llm)
        # Other weights of the draft's shapes, by their `draft.` names: the draft no longer is the target.
        other = load_file(f"{qwen3_next_dir}/model.safetensors")
        named = [(OPTIONAL_PREFIX + name, t) for name, t in other.items()]
        assert llm.update_weights_from_tensor([serialize_named_tensors(named)])["success"]
        same(run(llm, PROMPTS[:1], params), want)  # the target is untouched
        p1, k1, _ = drafted(llm)
        assert p1 > p0 and (k1 - k0) / (p1 - p0) < 0.9 * k0 / p0, ((p0, k0), (p1, k1))  # worse drafts now
        with pytest.raises(InvalidRequest, match="draft.model.nothing.weight"):
            llm.update_weights_from_tensor([serialize_named_tensors([("draft.model.nothing.weight", torch.zeros(1))])])
        llm.release_memory_occupation()
        llm.resume_memory_occupation()
        same(run(llm, PROMPTS[:1], params), want)
        assert llm.update_weights_from_disk(qwen3_next_dir)["success"]  # a target checkpoint: no draft tensors
        same(run(llm, PROMPTS[:1], params), want_next)


def test_names_of_both_dialects_and_refusals(qwen3_dir: str) -> None:
    vllm = EngineConfig(model=qwen3_dir, speculative_config=f'{{"method": "draft_model", "model": "{qwen3_dir}", "num_speculative_tokens": 3}}')
    assert (vllm.speculative_algorithm, vllm.speculative_draft_model_path, vllm.speculative_num_draft_tokens) == ("draft", qwen3_dir, 3)
    assert EngineConfig(model=qwen3_dir, speculative_algorithm="STANDALONE", speculative_draft_model_path=qwen3_dir).speculative_algorithm == "draft"
    with pytest.raises(ConfigError, match="come together"):
        EngineConfig(model=qwen3_dir, speculative_algorithm="draft")
    with pytest.raises(ConfigError, match="one GPU"):
        EngineConfig(model=qwen3_dir, speculative_algorithm="draft", speculative_draft_model_path=qwen3_dir, tp_size=2)


def test_without_a_host_copy_a_release_loses_the_draft_not_the_engine(qwen3_dir: str, qwen3_next_dir: str) -> None:
    """`--weights-backup none`: after a release only an update brings weights back. A full target
    update (no draft tensors) serves again at once, drafting nothing; `draft.` tensors bring the
    drafts back (engine/weights/store.py `lost`)."""
    from safetensors.torch import load_file

    from engine.weights.payload import serialize_named_tensors

    params = [greedy(40)]
    with Engine(model=qwen3_next_dir, dtype="float32", **KNOBS) as llm:
        want_next = run(llm, PROMPTS[:1], params)
    with Engine(model=qwen3_dir, dtype="float32", weights_backup="none", **spec_knobs(qwen3_dir)) as llm:
        llm.release_memory_occupation()
        llm.resume_memory_occupation()
        assert llm.update_weights_from_disk(qwen3_next_dir)["success"]
        p0, _, _ = drafted(llm)
        same(run(llm, PROMPTS[:1], params), want_next)
        assert drafted(llm)[0] == p0  # the draft is lost: nothing proposed
        draft = load_file(f"{qwen3_next_dir}/model.safetensors")
        assert llm.update_weights_from_tensor([serialize_named_tensors([("draft." + n, t) for n, t in draft.items()])])["success"]
        same(run(llm, PROMPTS[:1], params), want_next)
        p1, k1, _ = drafted(llm)
        assert p1 > p0 and k1 > 0.9 * (p1 - p0)  # the draft is the target again: its drafts stand


def test_a_proposal_again_before_any_verify_drafts_the_same(qwen3_dir: str) -> None:
    """Drafts proposed, then proposed again before a step verified them (no new token): the draft
    KV already holds position n, and the catch-up runs it again (a catch-up never starts past n),
    so the same drafts come back; then the request runs on to plain decoding's tokens."""
    from engine.core.engine_core import EngineCore
    from engine.core.protocol import AddRequest

    params = greedy(20)
    with Engine(model=qwen3_dir, dtype="float32", **KNOBS) as llm:
        (want, _), = run(llm, PROMPTS[:1], [params])
    core = EngineCore(EngineConfig(model=qwen3_dir, dtype="float32", device="cpu", **spec_knobs(qwen3_dir)))
    assert core.add_request(AddRequest(request_id="a", prompt_token_ids=PROMPTS[0], sampling_params=params)) is None
    for _ in range(3):
        core.step()
    core.drain()
    (req,) = core.scheduler.running
    core.drafter.propose([req])
    first = list(req.draft_token_ids)
    core.drafter.propose([req])
    assert len(first) == 4 and req.draft_token_ids == first
    for _ in range(200):
        if not core.has_work():
            break
        core.step()
    assert not core.has_work() and req.output_token_ids == want
