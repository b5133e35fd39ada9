"""bench/kernels/occupancy.py on the CPU: the decode path's Triton kernels compiled for Hopper
(sm_90) without a GPU, and the occupancy they are built on checked: programs per SM by registers
and shared memory, software-pipelined K/V loads, no spills. A compile error here is an engine that
fails at its first decode step on a GPU."""

from __future__ import annotations

import json
import os

import pytest
from bench_util import run_script


def test_the_layers_attention_kernel_compiles_for_every_head_dim(tmp_path: str) -> None:
    """Every head dim the Triton backend takes (powers of two, 16..256), bf16 and fp32 caches; a
    compile error here is an engine that fails at its first decode step on a GPU."""
    pytest.importorskip("triton")
    out = os.path.join(tmp_path, "compile.json")
    p = run_script(os.path.join("bench", "kernels", "occupancy.py"), "--decode-configs", "64x4x3", "--layers-head-dims",
             "16,32,64,128,256", "--json", out, timeout=600)  # fmt: skip
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    with open(out) as f:
        kernels = json.load(f)
    layers = {name: r for name, r in kernels.items() if name.startswith("layers attention")}
    assert len(layers) == 10
    assert all(min(r["per_sm_regs"], r["per_sm_shared"]) >= 1 for r in layers.values()), layers
    # The served shapes (bf16, head_dim <= 128) keep everything in registers.
    bf16 = {n: r["stack"] for n, r in layers.items() if n.endswith("bf16") and int(n.split()[2]) <= 128}
    assert bf16 == dict.fromkeys(bf16, 0), bf16


def test_decode_kernels_compile_for_hopper_at_the_occupancy_they_are_built_on(tmp_path: str) -> None:
    pytest.importorskip("triton")
    out = os.path.join(tmp_path, "compile.json")
    p = run_script(os.path.join("bench", "kernels", "occupancy.py"), "--persistent", "--json", out, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    with open(out) as f:
        kernels = json.load(f)
    (decode,) = (r for name, r in kernels.items() if name.startswith("decode "))  # the engine's own config
    # Four split-KV programs per SM: the batch decode's 64 rows x 8 KV heads in one wave.
    assert min(decode["per_sm_regs"], decode["per_sm_shared"]) >= 4, decode
    assert decode["buffers"] >= 1, decode  # its K/V loads are software-pipelined
    # So does the batch decode's own attention kernel, with q/k norm, rope and the K/V store in it.
    # The same kernel on the qkv linear's bf16 output (the layers' decode steps) fits four too.
    for name in ("rope_decode_kernel", "rope_decode_kernel (layers)"):
        attention = kernels[name]
        assert min(attention["per_sm_regs"], attention["per_sm_shared"]) >= 4, (name, attention)
    # The batch decode's attention buffers two K/V tiles: one streams while the other computes.
    assert kernels["rope_decode_kernel"]["buffers"] >= 2, kernels["rope_decode_kernel"]
    # Two layer kernels per SM: a layer's programs, launched with PDL, start beside the layer before.
    layer = kernels["decoder_layer_kernel"]
    assert min(layer["per_sm_regs"], layer["per_sm_shared"]) >= 2, layer
    # The batch decode is cooperative: one program an SM must fit, `--deterministic`'s variant too.
    for name in ("batch_layer_kernel", "batch_layer_kernel (--deterministic)"):
        assert min(kernels[name]["per_sm_regs"], kernels[name]["per_sm_shared"]) >= 1, (name, kernels[name])
    # Its steps of few rows fit two: the next layer's launch (PDL) is placed beside them (one an SM by
    # shared memory, 128-key tiles made a four-row launch 1.1 us longer; bench/history/2026-12-02.md, entry c).
    few = kernels["batch_layer_kernel (--deterministic, few rows)"]
    assert min(few["per_sm_regs"], few["per_sm_shared"]) >= 2, few
    # The decode graphs' logits run PROGRAMS_PER_SM programs an SM in one wave.
    from engine.kernels.logits_linear import PROGRAMS_PER_SM

    for rows in (16, 64):
        logits = kernels[f"_logits_kernel ({rows} rows)"]
        assert min(logits["per_sm_regs"], logits["per_sm_shared"]) >= PROGRAMS_PER_SM, (rows, logits)
    assert {name: r["stack"] for name, r in kernels.items()} == dict.fromkeys(kernels, 0)  # nothing spills
