"""Host -> device copies by the SMs (engine/kernels/host_copy.py) and the weight store's restore built on
them (engine/weights/store.py): every byte arrives, whatever the length, alignment or dtype; a
model whose weights were wiped gets them back bit for bit. GPU only."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("offset", [0, 1, 16, 100])
@pytest.mark.parametrize("nbytes", [0, 1, 15, 16, 4097, 16384, 3 * 16384 + 7, 5 << 20])
def test_copy_from_host_moves_every_byte(offset: int, nbytes: int) -> None:
    from engine.kernels.host_copy import copy_from_host, device_alias

    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(nbytes + offset)
    host = torch.randint(0, 256, (offset + nbytes + 64,), dtype=torch.uint8, generator=gen).pin_memory()
    alias = device_alias(host, device)
    assert alias.is_cuda and alias.data_ptr() == host.data_ptr()
    dst = torch.full((nbytes + 32,), 0xAB, dtype=torch.uint8, device=device)
    copy_from_host(dst[16 : 16 + nbytes], alias[offset : offset + nbytes])
    torch.cuda.synchronize()
    got = dst.cpu()
    assert torch.equal(got[16 : 16 + nbytes], host[offset : offset + nbytes])
    assert bool((got[:16] == 0xAB).all()) and bool((got[16 + nbytes :] == 0xAB).all()), "wrote outside its range"


def test_copy_from_host_refuses_mismatches() -> None:
    from engine.kernels.host_copy import copy_from_host, device_alias

    device = torch.device("cuda")
    with pytest.raises(ValueError, match="pinned"):
        device_alias(torch.zeros(8, dtype=torch.uint8), device)
    alias = device_alias(torch.zeros(64, dtype=torch.uint8).pin_memory(), device)
    with pytest.raises(ValueError, match="source bytes"):
        copy_from_host(torch.zeros(4, dtype=torch.float32, device=device), alias[:15])


def test_a_plan_moves_many_tensors_in_one_launch_and_odd_ones_alone() -> None:
    from engine.kernels.host_copy import HostCopyPlan, device_alias

    device = torch.device("cuda")
    sizes = [16, 4096, 262144, 262144 + 16, 3 * 262144 + 4080, 5, 1000, 7 << 20]  # bytes; 5 and 1000 are odd
    host = torch.randint(0, 256, (sum(sizes) + 256 * len(sizes),), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(1)).pin_memory()
    offsets, dsts, at = [], [], 0
    for n in sizes:
        offsets.append(at)
        dsts.append(torch.zeros(n, dtype=torch.uint8, device=device))
        at += -(-n // 256) * 256
    plan = HostCopyPlan(device_alias(host, device), offsets, dsts)
    assert len(plan.odd) == 2 and plan.chunks == sum(-(-n // 262144) for n in sizes if n % 16 == 0)
    plan.run()
    torch.cuda.synchronize()
    for o, n, d in zip(offsets, sizes, dsts, strict=True):
        assert torch.equal(d.cpu(), host[o : o + n]), f"{n} bytes at {o}"


def test_weight_store_restores_wiped_weights_bit_for_bit(qwen3_bf16_dir: str) -> None:
    from engine.config import ModelConfig
    from engine.models import get_model_class
    from engine.weights.loader import load_checkpoint
    from engine.weights.store import WeightStore

    config = ModelConfig.from_hf(qwen3_bf16_dir)
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            model = get_model_class(config.architecture)(config)
    finally:
        torch.set_default_dtype(torch.float32)
    store = WeightStore(model, torch.device("cuda"))
    store.written(load_checkpoint(model, qwen3_bf16_dir))
    store.keep_host_copy()
    before = [t.clone() for t in [*model.parameters(), *model.buffers()]]
    assert {t.dtype for t in before} == {torch.bfloat16, torch.float32}  # the rotary table is fp32
    store.released()
    store.flat.fill_(0xFF)  # NaN in every float dtype: what lost pages may hold
    store.ensure_current()
    assert store.last_restore["bytes"] == sum(t.numel() * t.element_size() for t in before)
    for got, want in zip([*model.parameters(), *model.buffers()], before, strict=True):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_copy_tensors_moves_small_aligned_pairs_in_one_launch_and_leaves_the_rest() -> None:
    from engine.kernels.host_copy import COPY_ALONE_BYTES, copy_tensors

    torch.manual_seed(0)
    flat = torch.randn(3 << 20, device="cuda").view(torch.uint8)  # 12 MiB of sources
    srcs = [
        flat[: 512 << 10].view(torch.bfloat16),  # 512 KiB: one chunk of the launch
        flat[1 << 20 : (1 << 20) + 4096].view(torch.float32).view(32, 32),  # one more chunk
        flat[(2 << 20) + 2 : (2 << 20) + 2 + 64].view(torch.bfloat16),  # misaligned source: left over
        torch.randn(7, device="cuda"),  # 28 bytes: not a multiple of 16, left over
        torch.randn(64, device="cuda"),  # another dtype than its destination: left over
        torch.empty(0, device="cuda"),  # nothing to do
        flat[4 << 20 : 9 << 20].view(torch.float16),  # 5 MiB: copied alone by the caller
    ]
    assert srcs[6].numel() * 2 >= COPY_ALONE_BYTES
    dsts = [torch.zeros_like(t) for t in srcs]
    dsts[4] = torch.zeros(64, device="cuda", dtype=torch.bfloat16)
    rest, table = copy_tensors(dsts, srcs)
    assert rest == [2, 3, 4, 6] and table is not None and len(table) == 2
    torch.cuda.synchronize()
    for i in (0, 1):
        assert torch.equal(dsts[i].view(torch.uint8), srcs[i].view(torch.uint8)), i
    for i in rest:
        assert not dsts[i].any(), i  # untouched: the caller copies them


def test_launch_chunks_writes_device_bytes_into_pinned_host_memory_with_few_programs() -> None:
    from engine.kernels.host_copy import launch_chunks

    src = torch.randint(0, 255, (9 << 20,), dtype=torch.uint8, device="cuda")
    host = torch.zeros(9 << 20, dtype=torch.uint8, pin_memory=True)
    spans = [(src.data_ptr(), host.data_ptr(), 5 << 20), (src.data_ptr() + (6 << 20), host.data_ptr() + (6 << 20), 48)]
    table = launch_chunks(spans, torch.device("cuda"), steps=4, programs=3)  # 64 KiB chunks, 3 programs loop
    torch.cuda.synchronize()
    assert len(table) == 81
    want = src.cpu()
    assert torch.equal(host[: 5 << 20], want[: 5 << 20])
    assert torch.equal(host[6 << 20 : (6 << 20) + 48], want[6 << 20 : (6 << 20) + 48])
    assert not host[5 << 20 : 6 << 20].any() and not host[(6 << 20) + 48 :].any()
