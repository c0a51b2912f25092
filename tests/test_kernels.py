"""The native small-M int8 kernel: parity with a float64 reference, row exactness across M, awkward
shapes, and the fallback to torch's kernel."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from verispec import kernels
from verispec.models import quant
from verispec.models.quant import Int8Linear, quantize_int8

needs_kernel = pytest.mark.skipif(not kernels.available(),
                                  reason=f"native kernel {kernels.kernel_status()}")


@needs_kernel
@pytest.mark.parametrize("m,n,k", [(1, 64, 896), (5, 130, 1536), (17, 67, 33), (3, 5, 7), (40, 300, 96)])
def test_int8_gemm_matches_float64_reference(m, n, k):
    torch.manual_seed(m + n + k)
    q, scale = quantize_int8(torch.randn(n, k))
    x = torch.randn(m, k)
    ref = (x.double() @ q.double().T) * scale.double()
    out = kernels.int8_gemm(x, kernels.pack_int8(q), scale)
    assert out.shape == (m, n) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


@needs_kernel
def test_int8_gemm_rows_do_not_depend_on_the_batch():
    """A row computed alone equals the same row inside any larger pass, bit for bit."""
    torch.manual_seed(0)
    q, scale = quantize_int8(torch.randn(257, 1536))
    packed = kernels.pack_int8(q)
    x = torch.randn(23, 1536)
    full = kernels.int8_gemm(x, packed, scale)
    for i in (0, 5, 6, 22):
        assert torch.equal(kernels.int8_gemm(x[i:i + 1].contiguous(), packed, scale)[0], full[i])
    for size in (2, 3, 5, 7, 13):
        assert torch.equal(kernels.int8_gemm(x[:size].contiguous(), packed, scale), full[:size])


@pytest.mark.parametrize("n,k", [(1, 1), (5, 7), (16, 3), (67, 33), (896, 96)])
def test_int8_packing_round_trips_and_pads_with_zeros(n, k):
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    packed = kernels.pack_int8(q)
    assert packed.shape == (-(-n // 16), k, 16)
    assert torch.equal(kernels.unpack_int8(packed, n), q)
    assert not packed.transpose(1, 2).reshape(-1, k)[n:].any()
    assert torch.equal(packed[0, :, 0], q[0])                      # k-major: a block's column is contiguous in k


@needs_kernel
def test_int8_gemm_refuses_a_weight_of_another_shape():
    q, scale = quantize_int8(torch.randn(40, 64))
    with pytest.raises(ValueError, match="does not fit"):
        kernels.int8_gemm(torch.randn(2, 64), q, scale)


def test_int8_linear_falls_back_to_torch_kernel(monkeypatch):
    torch.manual_seed(2)
    lin = nn.Linear(96, 40, bias=True)
    layer = Int8Linear(lin)
    x = torch.randn(3, 96)
    fast = layer(x)
    monkeypatch.setattr(quant.kernels, "available", lambda: False)
    slow = layer(x)
    ref = x @ layer.dequantized().T + lin.bias
    for out in (fast, slow):
        assert (out - ref).abs().max() < 2e-2 * ref.abs().max()


def test_kernel_status_says_why():
    assert kernels.kernel_status().split()[0] in ("active", "off", "unavailable:")


def q4_weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """A weight on a 16-level affine grid per group of 32, like a dequantized Q4_K tensor."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k // 32, 32), generator=g).float()
    scale = torch.rand(n, k // 32, 1, generator=g) * 0.02 + 0.001
    low = -8 * scale + torch.randn(n, k // 32, 1, generator=g) * 0.001
    return (low + q * scale).reshape(n, k)


def test_int4_quantization_is_exact_on_a_4bit_grid_and_refuses_other_weights():
    w = q4_weight(8, 96)
    packed, scales, mins = quant.quantize_int4(w)
    layer = quant.Int4Linear(96, 8, packed, scales, mins, None)
    torch.testing.assert_close(layer.dequantized(), w, rtol=0, atol=1e-5)
    assert quant.quantize_int4(torch.randn(8, 96)) is None          # not on a grid: stays int8
    assert quant.quantize_int4(q4_weight(8, 96)[:, :80]) is None    # K not a multiple of 32


@needs_kernel
@pytest.mark.parametrize("m", [1, 3, 4, 5, 9])
def test_int4_gemm_matches_reference_and_is_row_exact(m):
    w = q4_weight(200, 1536, seed=m)
    packed, scales, mins = quant.quantize_int4(w)
    x = torch.randn(m, 1536)
    out = kernels.int4_gemm(x, packed, scales, mins)
    ref = x.double() @ w.double().T
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
    for i in range(m):
        assert torch.equal(kernels.int4_gemm(x[i:i + 1].contiguous(), packed, scales, mins)[0], out[i])


def test_int4_model_mixes_formats_and_keeps_greedy_speculation_exact():
    from conftest import tiny_model
    from verispec import LLM, SamplingParams

    def on_grid(model):
        with torch.no_grad():
            for mod in model.modules():
                if isinstance(mod, nn.Linear) and mod.in_features % 32 == 0 and mod.out_features != 96:
                    mod.weight.copy_(q4_weight(mod.out_features, mod.in_features) * 10)
        return model

    target = quant.quantize_linears(on_grid(tiny_model(0, scale=1.5)), "int4")
    draft = quant.quantize_linears(on_grid(tiny_model(1, scale=1.5, num_layers=1)), "int4")
    layers = [type(m).__name__ for m in target.modules() if type(m).__name__.endswith("Linear")]
    assert "Int4Linear" in layers and "Int8Linear" in layers          # the LM head (not on a grid) is int8
    prompts = [[1, 5, 9, 2, 7], [3, 3], [11, 4, 8, 15, 16, 23, 42, 8, 1]]
    params = SamplingParams(temperature=0, max_tokens=20)
    plain = [o.token_ids for o in LLM(target, proposer="none").generate(prompts, params)]
    spec = LLM(target, draft=draft, proposer="draft", k=3).generate(prompts, params)
    assert [o.token_ids for o in spec] == plain
