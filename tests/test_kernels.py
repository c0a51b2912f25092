"""The native small-M int8 kernel: parity with a float64 reference, row exactness across M, awkward
shapes, and the fallback to torch's kernel."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from verispec import kernels
from verispec.models import quant
from verispec.models.quant import Int8Linear, quantize_int8

needs_kernel = pytest.mark.skipif(not kernels.int8_gemm_available(),
                                  reason=f"native kernel {kernels.kernel_status()}")


@needs_kernel
@pytest.mark.parametrize("m,n,k", [(1, 64, 896), (5, 130, 1536), (17, 67, 33), (3, 5, 7), (40, 300, 96)])
def test_int8_gemm_matches_float64_reference(m, n, k):
    torch.manual_seed(m + n + k)
    q, scale = quantize_int8(torch.randn(n, k))
    x = torch.randn(m, k)
    ref = (x.double() @ q.double().T) * scale.double()
    out = kernels.int8_gemm(x, q, scale)
    assert out.shape == (m, n) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


@needs_kernel
def test_int8_gemm_rows_do_not_depend_on_the_batch():
    """A row computed alone equals the same row inside any larger pass, bit for bit."""
    torch.manual_seed(0)
    q, scale = quantize_int8(torch.randn(257, 1536))
    x = torch.randn(23, 1536)
    full = kernels.int8_gemm(x, q, scale)
    for i in (0, 5, 6, 22):
        assert torch.equal(kernels.int8_gemm(x[i:i + 1].contiguous(), q, scale)[0], full[i])
    for size in (2, 5, 7, 13):
        assert torch.equal(kernels.int8_gemm(x[:size].contiguous(), q, scale), full[:size])


def test_int8_linear_falls_back_to_torch_kernel(monkeypatch):
    torch.manual_seed(2)
    lin = nn.Linear(96, 40, bias=True)
    layer = Int8Linear(lin)
    x = torch.randn(3, 96)
    fast = layer(x)
    monkeypatch.setattr(quant, "int8_gemm_available", lambda: False)
    slow = layer(x)
    ref = x @ layer.dequantized().T + lin.bias
    for out in (fast, slow):
        assert (out - ref).abs().max() < 2e-2 * ref.abs().max()


def test_kernel_status_says_why():
    assert kernels.kernel_status().split()[0] in ("active", "off", "unavailable:")
