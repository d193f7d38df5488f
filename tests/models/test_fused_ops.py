"""The C++ fused ops equal their torch definitions (kvtier/models/fused_ops.py) in every dtype:
rotary bit for bit in half types, the others within a rounding step of the dtype (a sum in
another order, a fused multiply-add, expf's last bit)."""

import shutil

import pytest
import torch

from kvtier.models import cpu_kernels, fused_ops

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture
def torch_path(monkeypatch):
    """Calls fused_ops with the kernels switched off: the reference definitions."""
    def call(fn, *args):
        with monkeypatch.context() as patch:
            patch.setattr(fused_ops, "_kernels", lambda x: None)
            return fn(*args)
    return call


def _randn(*shape, dtype):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape))).to(dtype)


@pytest.fixture(autouse=True)
def kernels_built():
    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler: kvtier runs the torch path only")
    assert cpu_kernels.ops() is not None, "the CPU kernels must build where a compiler exists"


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_torch(dtype, torch_path):
    x, weight = _randn(37, 576, dtype=dtype), _randn(576, dtype=dtype)
    expected = torch_path(fused_ops.rms_norm, x, weight, 1e-5)
    got = fused_ops.rms_norm(x, weight, 1e-5)
    # One fp32 sum in a different order may move a value across one rounding boundary.
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(got, expected, atol=4 * eps, rtol=2 * eps)
    if dtype != torch.float32:  # fp32 keeps the sum's last-bit noise; half types round it off
        assert (got == expected).float().mean() > 0.99


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_torch(dtype, torch_path):
    x = _randn(19, 2 * 96, dtype=dtype) * 4
    expected = torch_path(fused_ops.silu_and_mul, x)
    got = fused_ops.silu_and_mul(x)
    assert got.shape == (19, 96)
    eps = torch.finfo(dtype).eps
    # expf's last bit may differ from torch's; the roundings happen at the same places.
    torch.testing.assert_close(got, expected, atol=eps, rtol=2 * eps)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_matches_torch(dtype, torch_path):
    x = _randn(11, 3, 64, dtype=dtype)
    angles = torch.linspace(0, 20, 11 * 32).view(11, 1, 32)
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    expected = torch_path(fused_ops.rotary, x, cos, sin)
    got = fused_ops.rotary(x, cos, sin)
    if dtype == torch.float32:  # the compiler may fuse the last multiply-add (one rounding less)
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
    else:
        assert torch.equal(got, expected)


def test_non_contiguous_inputs_are_accepted(torch_path):
    """q and k come out of one fused projection as strided views."""
    qkv = _randn(5, 3 * 64 + 2 * 32, dtype=torch.bfloat16)
    q = qkv[:, :192].reshape(5, 3, 64)
    assert not q.is_contiguous()
    angles = torch.linspace(0, 3, 5 * 64).view(5, 1, 64)
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    assert torch.equal(fused_ops.rotary(q, cos, sin), torch_path(fused_ops.rotary, q, cos, sin))
    # Heads not contiguous within a token (the kernel copies such a view first).
    swapped = _randn(3, 5, 64, dtype=torch.bfloat16).transpose(0, 1)
    assert torch.equal(fused_ops.rotary(swapped, cos, sin),
                       torch_path(fused_ops.rotary, swapped, cos, sin))
