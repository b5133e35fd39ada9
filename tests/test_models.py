"""The forward pass against Hugging Face `transformers` on tiny random checkpoints (float32, CPU),
through the paged KV cache and the SDPA backend; weight loading; ModelConfig.from_hf."""

from __future__ import annotations

import functools
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from engine.attention import AttentionMetadata, ForwardContext
from engine.attention.sdpa import SdpaBackend
from engine.config import ModelConfig, RopeScaling
from engine.models import get_model_class
from engine.models.rotary import rope_inv_freq
from engine.weights.loader import (
    WeightLoadError,
    iterate_checkpoint,
    load_checkpoint,
    load_named_tensors,
)

RTOL = 1e-4


def build(path: str) -> torch.nn.Module:
    config = ModelConfig.from_hf(path)
    with torch.device("cpu"):
        model = get_model_class(config.architecture)(config)
    load_checkpoint(model, path)
    return model


@functools.cache
def hf_model(path: str) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


@torch.no_grad()
def hf_logits(path: str, tokens: list[int]) -> torch.Tensor:  # [len(tokens), vocab]
    return hf_model(path)(torch.tensor([tokens])).logits[0].float()


def assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    err = (ours - ref).abs().max() / ref.abs().max()
    assert err < RTOL, f"max relative error {err:.2e}"


class PagedRunner:
    """Just enough of a model runner: hands out KV blocks in shuffled order, builds the ragged
    batch and its AttentionMetadata, runs the model and returns each sequence's logits."""

    def __init__(self, model: torch.nn.Module, block_size: int, num_blocks: int = 64) -> None:
        cfg = model.config
        self.model = model
        self.block_size = block_size
        weight = model.model.embed_tokens.weight
        self.device = weight.device
        self.kv_cache = torch.zeros(
            cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim,
            dtype=weight.dtype, device=self.device,
        )
        self.backend = SdpaBackend(
            self.kv_cache, scale=cfg.head_dim**-0.5, num_heads=cfg.num_heads, max_num_seqs=8,
            max_model_len=num_blocks * block_size,
        )
        self.free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0)).tolist()
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    @torch.inference_mode()
    def step(self, chunks: dict[int, list[int]], pad: int = 0) -> dict[int, torch.Tensor]:
        """Run new tokens of several sequences (seq id -> tokens) as one batch; `pad` extra rows
        with slot -1 follow, as CUDA-graph padding would. Returns seq id -> logits [n, vocab]."""
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        qsl = [0]
        seq_lens: list[int] = []
        for seq, tokens in chunks.items():
            start = self.lens.get(seq, 0)
            end = start + len(tokens)
            table = self.tables.setdefault(seq, [])
            while len(table) * bs < end:
                table.append(self.free.pop())
            ids += tokens
            positions += range(start, end)
            slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            qsl.append(qsl[-1] + len(tokens))
            seq_lens.append(end)
            self.lens[seq] = end
        ids += [0] * pad
        positions += [0] * pad
        slots += [-1] * pad
        width = max(len(self.tables[s]) for s in chunks)
        tables = [self.tables[s] + [0] * (width - len(self.tables[s])) for s in chunks]
        dev = functools.partial(torch.tensor, device=self.device)
        meta = AttentionMetadata(
            query_start_loc=dev(qsl, dtype=torch.int32),
            seq_lens=dev(seq_lens, dtype=torch.int32),
            block_tables=dev(tables, dtype=torch.int32),
            slot_mapping=dev(slots, dtype=torch.int64),
            query_start_loc_cpu=qsl,
            seq_lens_cpu=seq_lens,
            max_query_len=max(len(t) for t in chunks.values()),
            max_seq_len=max(seq_lens),
        )
        ctx = ForwardContext(self.backend, meta)
        hidden = self.model(dev(ids), dev(positions), ctx)
        logits = self.model.compute_logits(hidden)
        return {seq: logits[qsl[i] : qsl[i + 1]] for i, seq in enumerate(chunks)}


def random_tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# ---- the forward pass --------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [16, 8])
def test_prefill_then_decode_matches_transformers(arch_dir: str, block_size: int) -> None:
    model = build(arch_dir)
    runner = PagedRunner(model, block_size)
    # Mixed lengths; 45 is past the llama fixture's original rope context of 32.
    prompts = {i: random_tokens(n, seed=i) for i, n in enumerate([45, 7, 16, 1])}
    decode = {i: random_tokens(3, seed=100 + i) for i in prompts}
    ours = runner.step(prompts)
    for i in prompts:
        ref = hf_logits(arch_dir, prompts[i] + decode[i])
        assert_close(ours[i], ref[: len(prompts[i])])
    for step in range(3):
        out = runner.step({i: [decode[i][step]] for i in prompts}, pad=2)
        for i in prompts:
            ref = hf_logits(arch_dir, prompts[i] + decode[i])
            assert_close(out[i][0], ref[len(prompts[i]) + step])


def test_chunked_prefill_matches_transformers(arch_dir: str) -> None:
    model = build(arch_dir)
    runner = PagedRunner(model, block_size=8)
    long, short = random_tokens(40, seed=7), random_tokens(5, seed=8)
    extra = random_tokens(1, seed=9)
    # Step 1: first chunk of the long prompt beside a whole short one. Step 2: the second chunk
    # (attending to the cached first) beside a decode step of the short one.
    first = runner.step({0: long[:23], 1: short})
    second = runner.step({0: long[23:], 1: extra})
    ref_long = hf_logits(arch_dir, long)
    ref_short = hf_logits(arch_dir, short + extra)
    assert_close(torch.cat([first[0], second[0]]), ref_long)
    assert_close(torch.cat([first[1], second[1]]), ref_short)


@pytest.mark.parametrize(
    "scaling",
    [
        {"rope_type": "linear", "factor": 4.0},
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 32},
    ],
)
def test_rope_inv_freq_matches_transformers(scaling: dict) -> None:
    hf_config = AutoConfig.for_model(
        "llama", hidden_size=64, num_attention_heads=4, head_dim=16,
        rope_scaling={**scaling, "rope_theta": 10000.0},
    )
    ref, _ = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf_config, "cpu")
    ours = rope_inv_freq(16, 10000.0, RopeScaling(type=scaling["rope_type"], **{
        k: v for k, v in scaling.items() if k != "rope_type"
    }))
    torch.testing.assert_close(ours, ref, rtol=0, atol=0)


def test_meta_build_then_materialise_matches(qwen3_dir: str) -> None:
    """The engine's start-up path: build on meta, allocate, compute buffers, load."""
    config = ModelConfig.from_hf(qwen3_dir)
    with torch.device("meta"):
        model = get_model_class(config.architecture)(config)
    model.to_empty(device="cpu")
    model.init_buffers()
    load_checkpoint(model, qwen3_dir)
    tokens = random_tokens(20, seed=3)
    assert_close(PagedRunner(model, block_size=16).step({0: tokens})[0], hf_logits(qwen3_dir, tokens))


# ---- weights -----------------------------------------------------------------------------


def test_sharded_checkpoint_loads_identically(llama_dir: str, llama_sharded_dir: str) -> None:
    assert os.path.isfile(os.path.join(llama_sharded_dir, "model.safetensors.index.json"))
    single, sharded = build(llama_dir).state_dict(), build(llama_sharded_dir).state_dict()
    assert single.keys() == sharded.keys()
    for name in single:
        assert torch.equal(single[name], sharded[name]), name


def _bad_checkpoint(src: str, dst: str, edit) -> str:
    os.makedirs(dst)
    shutil.copy(os.path.join(src, "config.json"), dst)
    # Every value changes, so a load that copied anything before failing would show.
    tensors = {name: t + 1.0 for name, t in iterate_checkpoint(src)}
    edit(tensors)
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    return dst


@pytest.mark.parametrize(
    ("name", "edit", "message"),
    [
        ("model.layers.1.self_attn.k_proj.weight", lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"), "missing"),
        ("model.layers.0.self_attn.bogus.weight", lambda t: t.update({"model.layers.0.self_attn.bogus.weight": torch.ones(2)}), "unexpected"),
        ("model.norm.weight", lambda t: t.update({"model.norm.weight": torch.ones(65)}), "shape"),
    ],
)
def test_bad_checkpoint_is_refused_atomically(tmp_path, llama_dir: str, name: str, edit, message: str) -> None:
    model = build(llama_dir)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    bad = _bad_checkpoint(llama_dir, str(tmp_path / "bad"), edit)
    with pytest.raises(WeightLoadError, match=message) as err:
        load_checkpoint(model, bad)
    assert name in str(err.value)
    with pytest.raises(WeightLoadError, match=message):
        load_named_tensors(model, iterate_checkpoint(bad), require_all=True)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), f"{k} changed by a refused load"


def test_partial_update_fills_packed_rows_in_place(qwen3_dir: str) -> None:
    model = build(qwen3_dir)
    qkv = model.model.layers[0].self_attn.qkv_proj.weight
    address, before = qkv.data_ptr(), qkv.detach().clone()
    k_rows = model.model.layers[0].self_attn.qkv_proj.rows["k_proj"]
    new_k = torch.randn(k_rows.stop - k_rows.start, 64, dtype=torch.bfloat16)  # cast on copy
    # lm_head.weight of a tied model is ignored, not refused.
    load_named_tensors(model, [("model.layers.0.self_attn.k_proj.weight", new_k), ("lm_head.weight", torch.ones(1))])
    assert qkv.data_ptr() == address
    assert torch.equal(qkv[k_rows], new_k.float())
    assert torch.equal(qkv[: k_rows.start], before[: k_rows.start])
    assert torch.equal(qkv[k_rows.stop :], before[k_rows.stop :])


def test_missing_weight_file_is_named(tmp_path, llama_sharded_dir: str) -> None:
    path = str(tmp_path / "broken")
    shutil.copytree(llama_sharded_dir, path)
    os.remove(os.path.join(path, "model-00002-of-00006.safetensors"))
    model = get_model_class("LlamaForCausalLM")(ModelConfig.from_hf(path))
    with pytest.raises(WeightLoadError, match="model-00002-of-00006.safetensors"):
        load_checkpoint(model, path)


def test_unknown_architecture_lists_supported() -> None:
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as err:
        get_model_class("GPT2LMHeadModel")
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert arch in str(err.value)


# ---- ModelConfig.from_hf ----------------------------------------------------------------------


def test_model_config_reads_the_checkpoint(tmp_path, llama_dir: str, qwen2_dir: str, qwen3_dir: str) -> None:
    llama = ModelConfig.from_hf(llama_dir)
    assert (llama.architecture, llama.num_heads, llama.num_kv_heads, llama.head_dim) == ("LlamaForCausalLM", 4, 2, 16)
    assert not llama.tie_word_embeddings and not llama.attention_bias
    assert llama.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 32)
    assert llama.max_position_embeddings == 512 and llama.torch_dtype == "float32"
    assert ModelConfig.from_hf(qwen2_dir).attention_bias
    qwen3 = ModelConfig.from_hf(qwen3_dir)
    assert (qwen3.num_heads, qwen3.num_kv_heads, qwen3.head_dim, qwen3.hidden_size) == (8, 2, 16, 64)
    assert qwen3.tie_word_embeddings and qwen3.rope_scaling is None

    # EOS ids: config.json's, then generation_config.json's, without repeats.
    path = tmp_path / "eos"
    shutil.copytree(llama_dir, path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7, 9]}))
    assert ModelConfig.from_hf(str(path)).eos_token_ids == (2, 7, 9)


def test_model_config_caps_context_at_sliding_window(tmp_path, llama_dir: str) -> None:
    hf = json.loads(open(os.path.join(llama_dir, "config.json")).read())
    hf.update(architectures=["MistralForCausalLM"], sliding_window=64)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    assert ModelConfig.from_hf(str(tmp_path)).max_position_embeddings == 64
    hf.update(architectures=["Qwen2ForCausalLM"], use_sliding_window=False)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    assert ModelConfig.from_hf(str(tmp_path)).max_position_embeddings == 512


def test_decode_kernels_prefetch_whole_lines_within_a_row() -> None:
    """The persistent decode kernels' L2 prefetch widths (decode_path.prefetch_width): what was
    asked for, cut to the row and down to a power of two of 128-byte lines (Triton's aranges);
    none below one line."""
    from engine.decode.rules import prefetch_width

    assert prefetch_width(1024, 256) == 256  # gate_up's first columns, 0.6B
    assert prefetch_width(512, 1 << 30) == 512  # a whole o_proj tile, 0.6B
    assert prefetch_width(896, 1 << 30) == 512  # 14 heads x 64 (Qwen2-0.5B): 14 lines -> 8
    assert prefetch_width(768, 512) == 512  # down_proj's K split of 3072 / 4
    assert prefetch_width(32, 256) == 0 and prefetch_width(1024, 0) == 0


@pytest.mark.parametrize(
    "hidden, inter, nh, nkv, d",
    [(1024, 3072, 16, 8, 128), (896, 4864, 14, 2, 64), (2048, 6144, 16, 8, 128)],  # Qwen3-0.6B, Qwen2-0.5B, Qwen3-1.7B
)
def test_decode_kernels_prefetch_within_their_items_k_split(hidden: int, inter: int, nh: int, nkv: int, d: int) -> None:
    """Every L2 prefetch width the persistent decode kernels are built with (fused_decode.layer_consts,
    batch_consts.kernel_consts, their defaults) covers at most its GEMV item's K split: the kernels'
    prefetch_items reads k_lo + [0, width), so a wider one would pull the next split's or the next
    row's weights, or run past the weight's end at its last row. Widths are whole power-of-two runs
    of 128-byte lines, or 0."""
    pytest.importorskip("triton")
    from engine.decode import batch_consts, batch_decode, fused_decode
    from engine.decode.rules import LayerShape

    shape = LayerShape(hidden=hidden, inter=inter, nh=nh, nkv=nkv, d=d, eps=1e-6, qk_norm=True,
                       device=torch.device("cpu"), dtype=torch.bfloat16)  # fmt: skip
    for programs in (132, 78):  # an H100 / H200, and a smaller part
        one = fused_decode.layer_consts(shape, programs, fused_decode.MAX_ROWS, 16, use_pdl=True)
        batch = batch_consts.kernel_consts(shape, programs, batch_decode.MAX_ROWS, use_pdl=True)
        widths = {
            "one-row O_PRE": (one["O_PRE"], nh * d // one["KS_O"]),
            "one-row G_PRE": (one["G_PRE"], hidden),
            "one-row Q_PRE": (one["Q_PRE"], hidden),
            "one-row D_PRE": (one["D_PRE"], inter // one["KS_D"]),
            "batch G_PRE": (batch["G_PRE"], hidden),
            "batch D_PRE": (batch["D_PRE"], inter // batch["KS_D"]),
            "batch Q_PRE": (batch["Q_PRE"], hidden // batch["KS_Q"]),
        }
        for name, (width, k_split) in widths.items():
            lines = width // 64
            assert width <= k_split, (name, programs, width, k_split)
            assert width % 64 == 0 and lines & (lines - 1) == 0, (name, programs, width)
        assert one["D_PRE"] > 0 and one["O_PRE"] > 0, one  # the defaults prefetch at these shapes
