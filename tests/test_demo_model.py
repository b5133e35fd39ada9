"""The embedded demo checkpoint: a tokenizer and a tiny Qwen3 that load with plain `transformers`."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.config import ModelConfig
from engine.demo_model import build_tokenizer, create_demo_model

TEXTS = [
    "Hello, world!",
    "  leading spaces, trailing tab\t and\nnew lines\n",
    "中文：你好，世界。日本語のテキスト。한국어",
    "emoji 😀🎉🚀 and a family 👨‍👩‍👧 and a flag 🇫🇷",
    "rare bytes \x00\x7f and ünïcödé and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return create_demo_model(str(tmp_path_factory.mktemp("demo")))


def test_tokenizer_loads_offline_and_round_trips(model_dir: str) -> None:
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert len(tok) == 512
    for text in TEXTS:
        ids = tok.encode(text)
        assert all(3 <= i < 512 for i in ids)
        assert tok.decode(ids) == text


def test_special_tokens(model_dir: str) -> None:
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 2)
    assert (tok.pad_token, tok.pad_token_id) == ("<|endoftext|>", 0)
    assert tok.bos_token_id is None
    ids = tok.encode("<|im_start|>user<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2 and tok.decode(ids[1:-1]) == "user"  # whole, never split
    ids = tok.encode("<|im_start|>hi<|im_end|><|endoftext|>")
    assert tok.decode(ids, skip_special_tokens=True) == "hi"
    assert tok.decode(ids) == "<|im_start|>hi<|im_end|><|endoftext|>"


def test_chat_template(model_dir: str) -> None:
    tok = AutoTokenizer.from_pretrained(model_dir)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi 😀"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
    ]
    want = (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi 😀<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n"
        "<|im_start|>user\nBye<|im_end|>\n"
    )
    assert tok.apply_chat_template(messages, tokenize=False) == want
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == want + "<|im_start|>assistant\n"


def test_tokenizer_is_deterministic_and_cached() -> None:
    assert build_tokenizer() is build_tokenizer()
    a = build_tokenizer.__wrapped__().backend_tokenizer.to_str()
    assert a == build_tokenizer.__wrapped__().backend_tokenizer.to_str()
    assert a == build_tokenizer().backend_tokenizer.to_str()


def test_config_matches_the_spec(model_dir: str) -> None:
    cfg = ModelConfig.from_hf(model_dir)
    assert cfg.architecture == "Qwen3ForCausalLM"
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers) == (
        512,
        64,
        128,
        2,
    )
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (4, 2, 16)
    assert cfg.tie_word_embeddings and cfg.max_position_embeddings == 2048
    assert cfg.eos_token_ids == (2,) and cfg.bos_token_id is None and cfg.torch_dtype == "float32"
    weights = load_file(os.path.join(model_dir, "model.safetensors"))
    assert all(w.dtype == torch.float32 for w in weights.values())


def test_model_loads_and_generates(model_dir: str) -> None:
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert model.dtype == torch.float32
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Hello"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )["input_ids"]
    out = model.generate(prompt, max_new_tokens=8, do_sample=False)
    assert (
        out.shape[1] > prompt.shape[1] and out[0, : prompt.shape[1]].tolist() == prompt[0].tolist()
    )
    assert model.generation_config.eos_token_id == 2


def test_seeded_and_idempotent(tmp_path: Path, model_dir: str) -> None:
    rng_before = torch.random.get_rng_state()
    again = create_demo_model(str(tmp_path / "a"), seed=0)
    assert torch.equal(torch.random.get_rng_state(), rng_before)  # the caller's RNG is untouched
    same = load_file(os.path.join(again, "model.safetensors"))
    first = load_file(os.path.join(model_dir, "model.safetensors"))
    assert same.keys() == first.keys() and all(torch.equal(same[k], first[k]) for k in same)
    other = load_file(
        os.path.join(create_demo_model(str(tmp_path / "b"), seed=1), "model.safetensors")
    )
    assert not torch.equal(other["model.embed_tokens.weight"], first["model.embed_tokens.weight"])

    stamp = os.path.getmtime(os.path.join(again, "model.safetensors"))
    assert create_demo_model(again, seed=1) == again  # already there: nothing is rewritten
    assert os.path.getmtime(os.path.join(again, "model.safetensors")) == stamp


def test_cli_writes_a_servable_demo_model(tmp_path) -> None:
    import subprocess
    import sys

    from engine import Engine, SamplingParams

    target = tmp_path / "cli-demo"
    done = subprocess.run(
        [sys.executable, "-m", "server.cli", "demo-model", str(target)], capture_output=True, text=True, check=True
    )
    assert str(target) in done.stdout
    with Engine(model=str(target), device="cpu") as llm:
        out = llm.generate("Hello", SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True))[0]
    assert len(out.output_ids) == 4 and out.finish_reason == "length"
