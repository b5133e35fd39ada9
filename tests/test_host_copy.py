"""Host -> device copies by the SMs (engine/host_copy.py) and the pinned weights copy built on them
(engine/memory.py `HostWeights`): every byte arrives, whatever the length, alignment or dtype; a
model whose weights were wiped gets them back bit for bit. GPU only."""

from __future__ import annotations

import pytest
import torch

from engine.memory import HostWeights

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("offset", [0, 1, 16, 100])
@pytest.mark.parametrize("nbytes", [0, 1, 15, 16, 4097, 16384, 3 * 16384 + 7, 5 << 20])
def test_copy_from_host_moves_every_byte(offset: int, nbytes: int) -> None:
    from engine.host_copy import copy_from_host, device_alias

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
    from engine.host_copy import copy_from_host, device_alias

    device = torch.device("cuda")
    with pytest.raises(ValueError, match="pinned"):
        device_alias(torch.zeros(8, dtype=torch.uint8), device)
    alias = device_alias(torch.zeros(64, dtype=torch.uint8).pin_memory(), device)
    with pytest.raises(ValueError, match="source bytes"):
        copy_from_host(torch.zeros(4, dtype=torch.float32, device=device), alias[:15])


def test_a_plan_moves_many_tensors_in_one_launch_and_odd_ones_alone() -> None:
    from engine.host_copy import HostCopyPlan, device_alias

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


def test_host_weights_restore_wiped_weights_bit_for_bit() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Embedding(1001, 24), torch.nn.Linear(24, 37), torch.nn.LayerNorm(37), torch.nn.Linear(37, 3, bias=False),
    ).to("cuda", torch.bfloat16)
    model.register_buffer("table", torch.randn(5, 7, device="cuda"))  # a buffer, in fp32
    before = [t.clone() for t in [*model.parameters(), *model.buffers()]]
    host = HostWeights(model)
    assert host.nbytes == sum(t.numel() * t.element_size() for t in before)
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            t.fill_(float("nan"))
    assert host.restore() > 0
    for got, want in zip([*model.parameters(), *model.buffers()], before, strict=True):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_host_weights_refuses_non_contiguous_weights() -> None:
    model = torch.nn.Linear(4, 6).cuda()
    model.weight = torch.nn.Parameter(torch.randn(6, 4, device="cuda").t().contiguous().t())  # not contiguous
    with pytest.raises(ValueError, match="contiguous"):
        HostWeights(model)
