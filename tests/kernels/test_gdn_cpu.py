"""The compiled CPU decode step of the GDN layers (kernels/gdn_cpu.py) against its twin (the reference kernels, as
the eager path runs them): the same read-out, the slot's conv window and state written back, the other slots
untouched (tests/engine/test_gdn_compiled.py runs it in the model)."""
from __future__ import annotations

import logging

import pytest
import torch

from kernels.gdn_cpu import GDNDecode, GDNDims, gdn_decode_twin

DIMS = GDNDims(num_k_heads=2, num_v_heads=6, head_k_dim=16, head_v_dim=8, conv_kernel=4)


@pytest.fixture(scope="module")
def step():
    built, why = GDNDecode.build(DIMS, torch.float32, torch.float32, torch.float32, 1e-6)
    assert why is None and built is not None
    return built


@pytest.mark.parametrize("ssm_dtype", [torch.float32, torch.float16])
def test_the_compiled_step_equals_its_twin_and_writes_only_its_slot(step, ssm_dtype):
    d = DIMS
    gen = torch.Generator().manual_seed(7)
    rand = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    weights = (rand(d.conv_dim, d.conv_kernel), -rand(d.num_v_heads).exp(), rand(d.num_v_heads),
               1 + 0.1 * rand(d.head_v_dim))
    conv, ssm = rand(5, d.conv_dim, d.conv_kernel - 1), (0.2 * rand(5, d.num_v_heads, d.head_k_dim,
                                                                    d.head_v_dim)).to(ssm_dtype)
    mine, twin = (conv.clone(), ssm.clone()), (conv.clone(), ssm.clone())
    slots = torch.tensor([3])
    shape = (d.num_k_heads, d.num_v_heads, d.head_k_dim, d.head_v_dim)
    for t in range(5):  # several steps: each reads what the one before wrote
        proj = rand(1, d.conv_dim + d.value_dim + 2 * d.num_v_heads)
        got = step(proj, weights[0], mine[0], mine[1], slots, *weights[1:])
        with torch.inference_mode():
            want = gdn_decode_twin(proj, weights[0], twin[0], twin[1], slots, *weights[1:], 1e-6, *shape)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
        torch.testing.assert_close(mine[0], twin[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(mine[1].float(), twin[1].float(), rtol=1e-3 if ssm_dtype == torch.float16 else 1e-5,
                                   atol=1e-6)
    others = [0, 1, 2, 4]
    assert torch.equal(mine[0][others], conv[others]) and torch.equal(mine[1][others], ssm[others])
    assert not torch.equal(mine[1][3], ssm[3])
    assert step.calls >= 5
