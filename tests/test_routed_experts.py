"""Routed experts for RL routing replay (SGLang's `--enable-return-routed-experts` and the request's
`return_routed_experts`) on the CPU: for every position of prompt + output but the last, each MoE
layer's top-k experts are transformers' router choices on the tiny Qwen3-MoE checkpoint (float32),
through chunked prefill, prefix-cache hits, stops and aborts; over HTTP they arrive as slime
reads them (THUDM/slime `slime/rollout/sglang_rollout.py`, `generate`: base64 of int32, reshaped
to (len(tokens) - 1, num_layers, moe_router_topk)); in uint16 or uint8 with `--routed-experts-dtype`
(SGLang's SGLANG_ROUTED_EXPERTS_DTYPE), named in meta_info as SGLang's reader takes them."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from server_util import ServerProcess
from test_models import random_tokens
from test_moe import hf_router_ids

from engine import Engine, SamplingParams
from engine.client.output import Base64Stream
from engine.errors import EngineDeadError

LAYERS, TOP_K = 3, 2  # the tiny checkpoint: sparse, dense, sparse; top-2 of 8
KNOBS = dict(device="cpu", dtype="float32", max_model_len=512, block_size=8, max_num_batched_tokens=32,
             enable_return_routed_experts=True)  # fmt: skip


def ask(max_new_tokens: int, **kw: object) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True, return_routed_experts=True, **kw)


def rows(data: bytes | bytearray, dtype: str = "int32") -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(bytes(data), dtype=dtype).reshape(-1, LAYERS, TOP_K).astype(np.int32))


def want(path: str, tokens: list[int]) -> torch.Tensor:
    """transformers' choices per position of `tokens`: [len, LAYERS, TOP_K], the dense layer 0."""
    sparse = hf_router_ids(path, tokens)
    out = torch.zeros(len(tokens), LAYERS, TOP_K, dtype=torch.int32)
    out[:, 0], out[:, 2] = sparse[0], sparse[1]
    return out


def test_every_position_routes_as_transformers(qwen3_moe_dir: str) -> None:
    base = random_tokens(40, seed=5)
    with Engine(model=qwen3_moe_dir, **KNOBS) as llm:
        first = llm.generate(input_ids=[base], sampling_params=ask(6))[0]
        assert torch.equal(rows(first.routed_experts), want(qwen3_moe_dir, base + first.output_ids[:-1]))
        # One batch: a prompt extending `base` (its blocks come from the prefix cache, written by
        # the request above), a fresh one chunked over several steps, `base` stopped by a stop
        # token, a prefill-only scoring request, and one that does not ask.
        stop = first.output_ids[2]
        prompts = [base + random_tokens(9, seed=6), random_tokens(70, seed=7), base, base[:21], base[:17]]
        params = [ask(8), ask(5), ask(6, stop_token_ids=(stop,)), ask(0),
                  SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)]  # fmt: skip
        outs = llm.generate(input_ids=prompts, sampling_params=params)
        assert outs[0].cached_tokens >= 32 and outs[2].cached_tokens >= 32
        assert outs[2].finish_reason == "stop" and len(outs[2].output_ids) == first.output_ids.index(stop) + 1
        for prompt, out in zip(prompts[:4], outs[:4], strict=True):
            tokens = prompt + out.output_ids
            assert torch.equal(rows(out.routed_experts), want(qwen3_moe_dir, tokens[:-1])), out.request_id
        assert outs[4].routed_experts is None
        # A release poisons what it frees (on a CPU always): the dense layer's column is 0 again.
        llm.release_memory_occupation()
        llm.resume_memory_occupation()
        again = llm.generate(input_ids=[base], sampling_params=ask(6))[0]
        assert again.output_ids == first.output_ids and again.routed_experts == first.routed_experts


def test_refused_without_the_flag_and_on_a_dense_model(qwen3_moe_dir: str, qwen3_dir: str) -> None:
    with Engine(model=qwen3_moe_dir, **{**KNOBS, "enable_return_routed_experts": False}) as llm:
        (out,) = llm.generate(input_ids=[[1, 2, 3]], sampling_params=ask(2))
        assert out.refused and "--enable-return-routed-experts" in out.error and out.output_ids == []
    with pytest.raises(EngineDeadError, match="no mixture-of-experts layers"):
        Engine(model=qwen3_dir, **KNOBS)


def test_an_aborted_request_gets_the_positions_it_knows(qwen3_moe_dir: str) -> None:
    """Deltas carry each step's new positions; an abort's final delta the rest of the known ones
    (slime resubmits an aborted sample with its tokens so far and reads len(tokens) - 1 rows)."""
    from engine.config import EngineConfig
    from engine.core.engine_core import EngineCore
    from engine.core.protocol import AddRequest

    core = EngineCore(EngineConfig(model=qwen3_moe_dir, num_kv_blocks=64, **KNOBS))
    prompt = random_tokens(45, seed=9)
    assert core.add_request(AddRequest(request_id="a", prompt_token_ids=prompt, sampling_params=ask(50))) is None
    ids, routes = [], bytearray()
    while len(ids) < 5:
        for d in core.step():
            ids += d.new_token_ids
            routes += d.routed_experts or b""
    (final,) = core.abort(["a"])  # with a step in flight: its position is not known yet
    routes += final.routed_experts
    tokens = prompt + ids
    assert final.finish_reason == "abort" and torch.equal(rows(routes), want(qwen3_moe_dir, tokens[:-1]))
    core.close()


def _slime_routes(output: dict, tokens: list[int]) -> np.ndarray:
    """slime's reader, as in its generate()."""
    return np.frombuffer(base64.b64decode(output["meta_info"]["routed_experts"].encode("ascii")), dtype=np.int32).reshape(
        len(tokens) - 1, LAYERS, TOP_K
    )


def test_over_http_as_slime_reads_them(qwen3_moe_dir: str) -> None:
    server = ServerProcess(qwen3_moe_dir, "--max-model-len", "512", "--block-size", "8", "--enable-return-routed-experts")
    try:
        with server.client() as http:
            assert http.get("/server_info").json()["enable_return_routed_experts"] is True
            prompt = random_tokens(30, seed=8)
            body = {"input_ids": prompt, "return_logprob": True, "return_routed_experts": True,
                    "sampling_params": {"max_new_tokens": 7, "temperature": 0.0, "ignore_eos": True}}  # fmt: skip
            output = http.post("/generate", json=body).json()
            tokens = prompt + [t for _, t, _ in output["meta_info"]["output_token_logprobs"]]
            assert torch.equal(torch.from_numpy(_slime_routes(output, tokens).copy()), want(qwen3_moe_dir, tokens[:-1]))
            assert output["meta_info"]["routed_experts_dtype"] == "int32"
            # A batch: each answer its own rows (the answers joined into one array).
            other = random_tokens(9, seed=9)
            both = http.post("/generate", json={**body, "input_ids": [prompt, other]}).json()
            assert both[0]["meta_info"]["routed_experts"] == output["meta_info"]["routed_experts"]
            ids = [t for _, t, _ in both[1]["meta_info"]["output_token_logprobs"]]
            assert torch.equal(torch.from_numpy(_slime_routes(both[1], other + ids).copy()), want(qwen3_moe_dir, (other + ids)[:-1]))
            # Streamed: the last event carries them.
            with http.stream("POST", "/generate", json={**body, "stream": True}) as r:
                events = [line[6:] for line in r.iter_lines() if line.startswith("data: {")]
            last = httpx.Response(200, content=events[-1]).json()
            assert last["output_ids"] == tokens[len(prompt) :]
            assert _slime_routes(last, tokens).tobytes() == _slime_routes(output, tokens).tobytes()
    finally:
        server.stop()


def test_smaller_integers_carry_the_same_experts(qwen3_moe_dir: str) -> None:
    """--routed-experts-dtype uint16 / uint8 (SGLang's SGLANG_ROUTED_EXPERTS_DTYPE): the same ids in
    a half or a quarter of the bytes, the output naming its dtype."""
    prompt = random_tokens(30, seed=11)
    for dtype, size in (("uint16", 2), ("uint8", 1)):
        with Engine(model=qwen3_moe_dir, routed_experts_dtype=dtype, **KNOBS) as llm:
            (out,) = llm.generate(input_ids=[prompt], sampling_params=ask(5))
        tokens = prompt + out.output_ids
        assert out.routed_experts_dtype == dtype and len(out.routed_experts) == (len(tokens) - 1) * LAYERS * TOP_K * size
        assert torch.equal(rows(out.routed_experts, dtype), want(qwen3_moe_dir, tokens[:-1])), dtype


def test_the_wire_dtype_is_the_flag_else_sglangs_variable_else_int32(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.config import ConfigError, EngineConfig
    from engine.models.routed_experts import RoutedExperts
    from engine.runner.route_log import RouteLog

    monkeypatch.delenv("SGLANG_ROUTED_EXPERTS_DTYPE", raising=False)
    assert EngineConfig(model="m").routed_experts_dtype == "int32"
    monkeypatch.setenv("SGLANG_ROUTED_EXPERTS_DTYPE", " UINT8 ")
    assert EngineConfig(model="m").routed_experts_dtype == "uint8"
    assert EngineConfig(model="m", routed_experts_dtype="uint16").routed_experts_dtype == "uint16"
    with pytest.raises(ConfigError, match="int32, uint16, uint8"):
        EngineConfig(model="m", routed_experts_dtype="int8")
    # ids must fit: 256 experts in uint8, not 257
    routed = RoutedExperts(num_layers=2, top_k=2, max_tokens=4)
    assert RouteLog(routed, 16, 8, 256, "uint8").table.dtype == np.uint8
    with pytest.raises(ConfigError, match="ids up to 255, the model has 257 experts"):
        RouteLog(routed, 16, 8, 257, "uint8")


def _sglang_reader(output: dict, tokens: list[int]) -> np.ndarray:
    """SGLang's own reader (sgl-project/sglang python/sglang/srt/state_capturer/routed_experts_wire.py
    `extract_routed_experts_from_meta_info`): the sender's meta_info.routed_experts_dtype, else int32."""
    meta = output["meta_info"]
    dtype = meta.get("routed_experts_dtype", "int32")
    return np.frombuffer(base64.b64decode(meta["routed_experts"].encode("utf-8")), dtype=dtype).reshape(len(tokens) - 1, -1)


def test_over_http_in_uint8_as_sglangs_reader_takes_them(qwen3_moe_dir: str) -> None:
    """SGLang's variable set on the server: answers name uint8 in meta_info, a quarter of int32's bytes."""
    server = ServerProcess(qwen3_moe_dir, "--max-model-len", "512", "--block-size", "8", "--enable-return-routed-experts",
                           env={"SGLANG_ROUTED_EXPERTS_DTYPE": "uint8"})  # fmt: skip
    try:
        with server.client() as http:
            prompt = random_tokens(30, seed=8)
            body = {"input_ids": prompt, "return_logprob": True, "return_routed_experts": True,
                    "sampling_params": {"max_new_tokens": 7, "temperature": 0.0, "ignore_eos": True}}  # fmt: skip
            output = http.post("/generate", json=body).json()
            tokens = prompt + [t for _, t, _ in output["meta_info"]["output_token_logprobs"]]
            assert output["meta_info"]["routed_experts_dtype"] == "uint8"
            got = _sglang_reader(output, tokens).reshape(-1, LAYERS, TOP_K).astype(np.int32)
            assert torch.equal(torch.from_numpy(got), want(qwen3_moe_dir, tokens[:-1]))
            assert len(base64.b64decode(output["meta_info"]["routed_experts"])) == (len(tokens) - 1) * LAYERS * TOP_K
    finally:
        server.stop()


@settings(deadline=None)  # a busy CI machine may stall one example; the property has no clock in it
@given(st.lists(st.binary(max_size=40), max_size=8))
def test_base64_as_the_rows_arrive_is_the_base64_of_them_all(pieces: list[bytes]) -> None:
    stream = Base64Stream()
    for piece in pieces:
        stream.add(piece)
    assert stream.value() == b"".join(stream.pieces()) == base64.b64encode(b"".join(pieces))
