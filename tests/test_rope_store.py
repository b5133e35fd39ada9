"""The fused rope kernel storing the step's K/V rows itself (engine/kernels/rope.py `rotary`
with `kv_store`, what a Triton backend's `kv_target` asks for): on a CPU under Triton's
interpreter and on a GPU, the cache afterwards is bit for bit the cache of rope, then
attention.store_kv (the two launches it replaces), slot -1 writes nothing, every other slot keeps
its bytes, and q and k are rotated in place as without the store."""

from __future__ import annotations

import pytest
import torch
from interpreted import interpret


def check_store(device: str, dtype: torch.dtype, qk_norm: bool) -> None:
    from engine.kernels import attention as tk
    from engine.kernels import rope as rope_kernel
    from engine.models.rotary import RotaryEmbedding

    dev = torch.device(device)
    gen = torch.Generator().manual_seed(7)
    T, H, Hkv, D, blocks, block_size = 5, 4, 2, 16, 3, 4
    rope = RotaryEmbedding(D, 64, 1e6, None).to(dev)
    positions = torch.tensor([0, 3, 17, 40, 63], device=dev)
    slots = torch.tensor([5, -1, 0, 11, 6], dtype=torch.int64, device=dev)
    qkv = torch.randn(T, (H + 2 * Hkv) * D, generator=gen).to(dtype).to(dev)
    weights = [(1 + 0.5 * torch.randn(D, generator=gen)).to(dtype).to(dev) for _ in range(2)] if qk_norm else [None, None]
    cache = torch.randn(2, blocks, block_size, Hkv, D, generator=gen).to(dtype).to(dev)

    def run(fused_store: bool) -> tuple[torch.Tensor, torch.Tensor]:
        x, kv = qkv.clone(), cache.clone()
        q, k, v = (t.view(T, -1, D) for t in x.split([H * D, Hkv * D, Hkv * D], dim=-1))
        store = (v, kv[0], kv[1], slots) if fused_store else None
        rope_kernel.rotary(q, k, positions, rope.cos_sin_cache, *weights, 1e-6, kv_store=store)
        if not fused_store:
            tk.store_kv(k, v, kv[0], kv[1], slots)
        return x, kv

    (x_ref, kv_ref), (x, kv) = run(False), run(True)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(x.view(bits), x_ref.view(bits)), "q/k/v not as without the store"
    assert torch.equal(kv, kv_ref), "the cache differs from rope + store_kv"
    flat = kv.view(2, blocks * block_size, Hkv, D)
    untouched = [s for s in range(blocks * block_size) if s not in slots.tolist()]
    assert torch.equal(flat[:, untouched], cache.view(2, blocks * block_size, Hkv, D)[:, untouched]), "another slot was written"
    assert not torch.equal(flat[:, 5], cache.view(2, -1, Hkv, D)[:, 5]), "slot 5 was not written"
    with pytest.raises(ValueError, match="caches"):
        q, k, v = (t.view(T, -1, D) for t in qkv.clone().split([H * D, Hkv * D, Hkv * D], dim=-1))
        rope_kernel.rotary(q, k, positions, rope.cos_sin_cache, *weights, 1e-6, kv_store=(v, cache[0], cache[1, :, :, :1], slots))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("qk_norm", [False, True], ids=["rope", "norm_rope"])
def test_rope_stores_what_store_kv_would_on_a_cpu(dtype: str, qk_norm: bool) -> None:
    interpret("test_rope_store", f"check_store('cpu', torch.{dtype}, {qk_norm})")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("qk_norm", [False, True], ids=["rope", "norm_rope"])
def test_rope_stores_what_store_kv_would(dtype: torch.dtype, qk_norm: bool) -> None:
    check_store("cuda", dtype, qk_norm)
