"""The native int8 kernel: parity with a float64 reference of its exact arithmetic (activations rounded
to 16 bits per row, integer sums), closeness to fp32 activations, row exactness across M, awkward
shapes, and the fallback to torch's kernel."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from verispec import kernels
from verispec.models import quant
from verispec.loaders.gguf_blocks import Q4Fields, Q6Fields
from verispec.models.quant import Int8Linear, quantize_int8

@pytest.fixture(params=[v.name for v in kernels.VARIANTS])
def native(request):
    """Each instruction-set variant in turn; one this machine cannot run is skipped, saying why."""
    if kernels.switched_off():
        pytest.skip("native kernels switched off (VERISPEC_KERNELS)")
    try:
        return kernels.load_variant(request.param)
    except RuntimeError as err:
        pytest.skip(f"{request.param} kernels: {err}")


def round_rows_to_int16(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's activation rounding, written out: per row sx = max|x| / 32767, q = round(x / sx)."""
    amax = x.abs().amax(dim=1, keepdim=True)                                 # (M, 1) float32
    inv = torch.where(amax > 0, torch.tensor(32767.0) / amax, torch.zeros_like(amax))
    return torch.round(x * inv), amax / 32767.0


@pytest.mark.parametrize("m,n,k", [(1, 64, 896), (5, 130, 1536), (17, 67, 33), (3, 5, 7), (40, 300, 96),
                                   (2, 16, 8960), (7, 33, 1)])
def test_int8_gemm_matches_float64_reference(native, m, n, k):
    torch.manual_seed(m + n + k)
    q, scale = quantize_int8(torch.randn(n, k))
    x = torch.randn(m, k) * torch.rand(m, 1) * 10
    x[0, 0] = 40.0                                                          # an outlier sets row 0's scale
    qx, sx = round_rows_to_int16(x)
    exact = (qx.double() @ q.double().T) * scale.double() * sx.double()     # integer sums are exact
    out = native.int8_gemm(x, kernels.pack_int8(q), scale)
    assert out.shape == (m, n) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), exact, rtol=1e-6, atol=1e-6 * exact.abs().max().item())
    # Against fp32 activations: at most half a rounding step per activation, weighted by |w|
    unrounded = (x.double() @ q.double().T) * scale.double()
    bound = 0.5 * sx.double() * (q.double().abs().sum(1) * scale.double())[None, :]   # (M, N)
    assert ((out.double() - unrounded).abs() <= bound * 1.001 + 1e-9).all()


def test_int8_gemm_handles_zero_rows_and_full_scale_values(native):
    q = torch.full((16, 1024), 127, dtype=torch.int8)                       # the largest possible integer sums
    x = torch.ones(3, 1024)
    x[1] = 0.0
    x[2, ::2] = -1.0
    out = native.int8_gemm(x, kernels.pack_int8(q), torch.ones(16))
    assert torch.equal(out[0], torch.full((16,), 127.0 * 1024))
    assert torch.equal(out[1], torch.zeros(16))
    assert torch.equal(out[2], torch.zeros(16))


def test_int8_gemm_rows_do_not_depend_on_the_batch(native):
    """A row computed alone equals the same row inside any larger pass, bit for bit."""
    torch.manual_seed(0)
    q, scale = quantize_int8(torch.randn(257, 1536))
    packed = kernels.pack_int8(q)
    x = torch.randn(23, 1536)
    full = native.int8_gemm(x, packed, scale)
    for i in (0, 5, 6, 22):
        assert torch.equal(native.int8_gemm(x[i:i + 1].contiguous(), packed, scale)[0], full[i])
    for size in (2, 3, 5, 7, 13):
        assert torch.equal(native.int8_gemm(x[:size].contiguous(), packed, scale), full[:size])


@pytest.mark.parametrize("n,k", [(1, 1), (5, 7), (16, 3), (67, 33), (896, 96)])
def test_int8_packing_round_trips_and_pads_with_zeros(n, k):
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    packed = kernels.pack_int8(q)
    assert packed.shape == (-(-n // 16), -(-k // 2), 32)
    assert torch.equal(kernels.unpack_int8(packed, n, k), q)
    assert packed.sum(dtype=torch.int64) == q.sum(dtype=torch.int64)       # the padding is zeros
    if k > 1:
        assert torch.equal(packed[0, 0, :2], q[0, :2])                     # a column's pair of k is adjacent
    if n > 8 and k > 3:
        assert torch.equal(packed[0, 1, 16:18], q[8, 2:4])                 # columns 8-15 in the second half


def test_int8_gemm_refuses_a_weight_of_another_shape(native):
    q, scale = quantize_int8(torch.randn(40, 64))
    with pytest.raises(ValueError, match="does not fit"):
        native.int8_gemm(torch.randn(2, 64), q, scale)


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


def q4_fields(n: int, k: int, seed: int = 0) -> Q4Fields:
    """Random Q4_K-style fields: nibbles, 8-bit multipliers, fp16 factors per super-block of 256."""
    g = torch.Generator().manual_seed(seed)
    supers = -(-k // 256)
    return Q4Fields(torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8),
                    torch.randint(0, 256, (n, k // 32), generator=g, dtype=torch.uint8),
                    torch.randint(0, 256, (n, k // 32), generator=g, dtype=torch.uint8),
                    (torch.rand(n, supers, generator=g) * 1e-4 + 1e-6).half().float(),
                    (torch.rand(n, supers, generator=g) * 4e-4).half().float())


def on_q4(model: nn.Module, chosen, rounding=quant.round_to_q4) -> dict[str, Q4Fields]:
    """Round the linears `chosen(name, module)` picks to Q4_K-style fields (or `rounding`'s), give them
    exactly those weights (as a model prepared from a GGUF has them) and return the fields under the
    weights' names."""
    fields = {}
    with torch.no_grad():
        for name, mod in model.named_modules():
            if isinstance(mod, nn.Linear) and chosen(name, mod):
                fields[f"{name}.weight"] = rounding(mod.weight)
                mod.weight.copy_(fields[f"{name}.weight"].dequantized())
    return fields


def on_q6(model: nn.Module, chosen) -> dict[str, Q6Fields]:
    """As on_q4, with Q6_K-style fields."""
    return on_q4(model, chosen, quant.round_to_q6)


def q6_fields(n: int, k: int, seed: int = 0) -> Q6Fields:
    """Random Q6_K-style fields: 6-bit integers, int8 scales per 16, fp16 factors per super-block."""
    g = torch.Generator().manual_seed(seed)
    return Q6Fields(torch.randint(0, 64, (n, k), generator=g, dtype=torch.uint8),
                    torch.randint(-128, 128, (n, k // 16), generator=g).to(torch.int8),
                    (torch.rand(n, -(-k // 256), generator=g) * 1e-3 + 1e-6).half().float())


def _linear(w: torch.Tensor) -> nn.Linear:
    lin = nn.Linear(w.shape[1], w.shape[0], bias=False)
    with torch.no_grad():
        lin.weight.copy_(w)
    return lin


def test_rounding_to_q4_keeps_each_weight_within_half_a_step():
    w = torch.randn(40, 96) * 0.05
    w[0] = w[0].abs()                                               # a row with no negative weight
    fields = quant.round_to_q4(w)
    groups = w.reshape(40, 3, 32)
    step = (groups.amax(-1) - groups.amin(-1).clamp_max(0)) / 15
    err = (fields.dequantized() - w).reshape(40, 3, 32).abs().amax(-1)
    assert (err <= 0.5 * step * 1.01 + 1e-7).all()                 # 8-bit multipliers: ~0.4 % of a step more
    layer = quant.Int4Linear.from_linear(_linear(w))
    torch.testing.assert_close(layer.dequantized(), fields.dequantized(), rtol=0, atol=0)
    with pytest.raises(ValueError, match="multiple of 32"):
        quant.Int4Linear.from_linear(nn.Linear(80, 8))


def test_a_file_weight_that_is_not_the_model_weight_is_refused():
    model = nn.Sequential(nn.Linear(64, 16, bias=False))
    fields = on_q4(model, lambda name, mod: True)
    quant.quantize_linears(model, "int4", fields=fields)
    assert isinstance(model[0], quant.Int4Linear)
    other = nn.Sequential(nn.Linear(64, 16, bias=False))                   # another weight under the same name
    with pytest.raises(ValueError, match="not the model's"):
        quant.quantize_linears(other, "int4", fields=fields)


@pytest.mark.parametrize("n,k", [(16, 32), (40, 96), (200, 1536), (7, 64), (9, 896)])
def test_int4_packing_round_trips(n, k):
    f = q4_fields(n, k, seed=n)
    packed, groups, supers = kernels.pack_int4(f.q, f.sc, f.m, f.d, f.dmin)
    assert packed.shape == (-(-n // 16), k // 32, 4, 16) and groups.dtype == torch.uint8
    assert supers.shape == (-(-n // 16), -(-k // 256), 2, 16) and supers.dtype == torch.float16
    torch.testing.assert_close(kernels.unpack_int4(packed, groups, supers, n), f.dequantized(), rtol=0, atol=0)
    assert (packed[0, 0, 0, 0] & 0xF) == f.q[0, 0] and ((packed[0, 0, 0, 0] >> 16) & 0xF) == f.q[0, 1]
    if n > 2:
        assert ((packed[0, 0, 1, 2] >> 4) & 0xF) == f.q[2, 10]       # chunk 1 = k 8…15, i = 1 -> k 10
    assert groups[0, 0, 1, 1] == f.m[1, 0] and supers[0, -1, 0, 3] == f.d[3, -1].half()


@pytest.mark.parametrize("rows", [7, 16, 1000])
def test_unpacking_a_few_rows_at_a_time_gives_the_same_weights(monkeypatch, rows):
    """The torch path's dense copy of a packed layer is unpacked DEQUANT_ROWS rows at a time (the 1.5B's
    LM head at once took ~6 GB of intermediates): chunks that split a block, end mid-way or hold it all."""
    monkeypatch.setattr(kernels.packing, "DEQUANT_ROWS", rows)
    f4, f6 = q4_fields(200, 544, seed=4), q6_fields(200, 512, seed=6)
    torch.testing.assert_close(kernels.unpack_int4(*kernels.pack_int4(f4.q, f4.sc, f4.m, f4.d, f4.dmin), 200),
                               f4.dequantized(), rtol=0, atol=0)
    torch.testing.assert_close(kernels.unpack_int6(*kernels.pack_int6(f6.q, f6.sc, f6.d), 200), f6.dequantized(),
                               rtol=0, atol=0)


@pytest.mark.parametrize("n,k", [(40, 96), (9, 896), (300, 64), (33, 544)])
def test_int4_rows_read_only_those_rows_exactly(n, k):
    f = q4_fields(n, k, seed=n)
    packed, groups, supers = kernels.pack_int4(f.q, f.sc, f.m, f.d, f.dmin)
    ids = torch.tensor([[0, n - 1, 3], [n // 2, 3, 1]])
    rows = kernels.int4_rows(packed, groups, supers, ids)                     # (2, 3, K)
    assert rows.shape == (2, 3, k)
    torch.testing.assert_close(rows, f.dequantized()[ids], rtol=0, atol=0)
    torch.testing.assert_close(kernels.packing.int4_rows(packed, groups, supers, ids), rows, rtol=0, atol=0)
    sub = torch.tensor([n - 1, 0, 2])
    picked = kernels.unpack_int4(*kernels.select_block_rows((packed, groups, supers), sub), len(sub))
    torch.testing.assert_close(picked, f.dequantized()[sub], rtol=0, atol=0)


@pytest.mark.parametrize("n,k", [(40, 96), (17, 896), (5, 288)])
def test_native_int4_rows_equal_the_torch_lookup_bit_for_bit(native, n, k):
    """The native embedding lookup runs packing.int4_rows' fp32 operations (the same bits), reads any
    shape of ids, and refuses an id past the table instead of reading beyond it."""
    f = q4_fields(n, k, seed=n + k)
    packed, groups, supers = kernels.pack_int4(f.q, f.sc, f.m, f.d, f.dmin)
    ids = torch.tensor([[n - 1, 0], [4, 4], [n // 3, 1]])
    rows = native.int4_rows(packed, groups, supers, ids)                      # (3, 2, K)
    assert rows.shape == (3, 2, k)
    torch.testing.assert_close(rows, kernels.packing.int4_rows(packed, groups, supers, ids), rtol=0, atol=0)
    torch.testing.assert_close(rows, f.dequantized()[ids], rtol=0, atol=0)
    for bad in (-1, packed.shape[0] * 16):
        with pytest.raises(IndexError):
            native.int4_rows(packed, groups, supers, torch.tensor([0, bad]))
    with pytest.raises(ValueError):
        native.int4_rows(packed, groups.to(torch.int8), supers, ids)


@pytest.mark.parametrize("c", [896, 1536, 13])
def test_native_final_norm_matches_rmsnorm_and_is_row_exact(native, c):
    """The final norm on gathered rows: RMSNorm's values (to rounding), each row's bits independent of
    which and how many rows share the call, and a row index past the pass refused."""
    from verispec.models.transformer import RMSNorm

    torch.manual_seed(c)
    x = torch.randn(2, 7, c) * 3                                             # (B, T, C)
    norm = RMSNorm(c, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(c) + 0.5)
    rows = torch.tensor([[6, 0, 3], [2, 2, 5]])
    out = native.rmsnorm_rows(x, rows, norm.weight.detach(), 1e-6)           # (B, R, C)
    ref = norm(torch.gather(x, 1, rows[..., None].expand(-1, -1, c)))
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    alone = native.rmsnorm_rows(x[1:], torch.tensor([[5]]), norm.weight.detach(), 1e-6)
    assert torch.equal(alone[0, 0], out[1, 2])
    for bad in (-1, 7):
        with pytest.raises(IndexError):
            native.rmsnorm_rows(x, torch.tensor([[0], [bad]]), norm.weight.detach(), 1e-6)
    with pytest.raises(ValueError):
        native.rmsnorm_rows(x.double(), rows, norm.weight.detach(), 1e-6)


def test_int4_embeddings_give_the_files_rows_and_keep_greedy_output():
    """A model whose token embeddings the file holds as Q4_K: int4 keeps them in that layout (an
    eighth of the float32 bytes) and every lookup gives exactly the float rows, so the output is the
    float-embedding model's; a table whose file fields are another weight is refused."""
    import copy

    from conftest import tiny_model
    from verispec import LLM, SamplingParams

    model = tiny_model(0, scale=1.5)
    fields = on_q4(model, lambda name, mod: mod.in_features % 32 == 0 and name != "lm_head")
    with torch.no_grad():
        fields["model.embed_tokens.weight"] = quant.round_to_q4(model.model.embed_tokens.weight)
        model.model.embed_tokens.weight.copy_(fields["model.embed_tokens.weight"].dequantized())
    prompts, params = [[1, 5, 9, 2, 7], [3, 3]], SamplingParams(temperature=0, max_tokens=16)
    float_table = quant.quantize_linears(copy.deepcopy(model), "int4", fields={
        k: v for k, v in fields.items() if k != "model.embed_tokens.weight"})
    quant.quantize_linears(model, "int4", fields=fields)
    assert isinstance(model.model.embed_tokens, quant.Int4Embedding)
    assert isinstance(float_table.model.embed_tokens, nn.Embedding)
    ids = torch.tensor([[4, 0, 95]])
    torch.testing.assert_close(model.model.embed_tokens(ids), float_table.model.embed_tokens(ids), rtol=0, atol=0)
    assert ([o.token_ids for o in LLM(model, proposer="none").generate(prompts, params)]
            == [o.token_ids for o in LLM(float_table, proposer="none").generate(prompts, params)])
    other = tiny_model(1)
    with pytest.raises(ValueError, match="not the model's"):
        quant.quantize_linears(other, "int4", fields={"model.embed_tokens.weight": fields["model.embed_tokens.weight"]})


def test_q4k_blocks_read_as_the_gguf_package_dequantizes_them():
    import gguf
    import numpy as np

    from verispec.loaders.gguf_blocks import parse_q4k

    rng = np.random.default_rng(0)
    n, k = 5, 512
    blocks = rng.integers(0, 256, (n * k // 256, 144), dtype=np.uint8)
    blocks[:, 0:4] = (rng.random((n * k // 256, 2)) * 1e-3).astype(np.float16).view(np.uint8)   # finite d, dmin
    ref = gguf.quants.dequantize(blocks.reshape(n, -1), gguf.GGMLQuantizationType.Q4_K).reshape(n, k)
    fields = parse_q4k(blocks.reshape(n, -1), n, k)
    assert fields.sc.max() < 64 and fields.q.max() < 16
    torch.testing.assert_close(fields.dequantized(), torch.from_numpy(ref), rtol=0, atol=0)
    layer = quant.Int4Linear.from_fields(fields)
    torch.testing.assert_close(layer.dequantized(), torch.from_numpy(ref), rtol=0, atol=0)


def test_q6k_blocks_read_as_the_gguf_package_dequantizes_them():
    import gguf
    import numpy as np

    from verispec.loaders.gguf_blocks import parse_q6k

    rng = np.random.default_rng(1)
    n, k = 5, 512
    blocks = rng.integers(0, 256, (n * k // 256, 210), dtype=np.uint8)
    blocks[:, 208:210] = (rng.random((n * k // 256, 1)) * 1e-3).astype(np.float16).view(np.uint8)   # finite d
    ref = gguf.quants.dequantize(blocks.reshape(n, -1), gguf.GGMLQuantizationType.Q6_K).reshape(n, k)
    fields = parse_q6k(blocks.reshape(n, -1), n, k)
    assert fields.q.max() < 64 and fields.sc.dtype == torch.int8
    torch.testing.assert_close(fields.dequantized(), torch.from_numpy(ref), rtol=0, atol=0)
    torch.testing.assert_close(quant.Int6Linear.from_fields(fields).dequantized(), torch.from_numpy(ref), rtol=0, atol=0)


@pytest.mark.parametrize("n,k", [(16, 256), (40, 96), (9, 896), (200, 1536)])
def test_int6_packing_round_trips_and_selects_rows(n, k):
    f = q6_fields(n, k, seed=n)
    packed, scales, supers = kernels.pack_int6(f.q, f.sc, f.d)
    assert packed.shape == (-(-n // 16), k // 32, 6, 16) and scales.shape == (-(-n // 16), k // 32, 2, 16)
    assert supers.shape == (-(-n // 16), -(-k // 256), 16) and supers.dtype == torch.float16
    torch.testing.assert_close(kernels.unpack_int6(packed, scales, supers, n), f.dequantized(), rtol=0, atol=0)
    assert (packed[0, 0, 0, 0] & 0xF) == (f.q[0, 0] & 0xF)                   # the low nibbles as int4's words
    assert (packed[0, 0, 4, 0] & 0x3) == f.q[0, 0] >> 4                      # chunk 0, byte lane 0 (k = 0)
    assert ((packed[0, 0, 4, 0] >> 6) & 0x3) == f.q[0, 10] >> 4              # chunk 1, second lanes, byte 0 (k = 8 + 2)
    rows = torch.tensor([n - 1, 0, n // 2])
    torch.testing.assert_close(kernels.int6_rows(packed, scales, supers, rows), f.dequantized()[rows], rtol=0, atol=0)
    sub = kernels.select_block_rows((packed, scales, supers), rows)
    torch.testing.assert_close(kernels.unpack_int6(*sub, len(rows)), f.dequantized()[rows], rtol=0, atol=0)


def test_rounding_to_q6_keeps_each_weight_within_half_a_step():
    w = torch.randn(40, 512) * 0.05
    f = quant.round_to_q6(w)
    step = w.reshape(40, -1, 16).abs().amax(-1) / 31
    err = (f.dequantized() - w).reshape(40, -1, 16).abs().amax(-1)
    assert (err <= 0.5 * step * 1.02 + 1e-7).all()                         # int8 multiples of d: ~0.4 % more


def round_groups_to_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gemm4.c's activation rounding, written out: per row and group of 32, s8 = max|x| / 127 and
    q8 = round(x · 127 / max|x|) -> q8 (M, K), s8 (M, K/32)."""
    m, k = x.shape
    g = x.reshape(m, k // 32, 32)
    amax = g.abs().amax(dim=-1, keepdim=True)                                # (M, G, 1) float32
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    return torch.round(g * inv).reshape(m, k), (amax / 127.0)[..., 0]


def int4_reference(x: torch.Tensor, f: Q4Fields) -> torch.Tensor:
    """float64 of gemm4.c's arithmetic: Σ_g (I · scale · s8 − min · Σ_{k in g} x) with I the exact sum
    of q · q8 over the group, scale = d · sc and min = dmin · m."""
    n, k = f.shape
    q8, s8 = round_groups_to_int8(x)
    per_group = lambda v: v.double().repeat_interleave(8, dim=1)[:, : k // 32]
    scale, mins = per_group(f.d) * f.sc.double(), per_group(f.dmin) * f.m.double()                   # (N, G)
    qscale = (f.q.double().view(n, -1, 32) * scale[..., None]).reshape(n, k)                           # (N, K)
    xq = (q8.double().reshape(len(x), -1, 32) * s8.double()[..., None]).reshape(len(x), -1)            # (M, K)
    gsum = x.double().reshape(len(x), -1, 32).sum(-1)                                                   # (M, G)
    return xq @ qscale.T - gsum @ mins.T


@pytest.mark.parametrize("m", [1, 3, 4, 5, 7, 13, 23])
def test_int4_gemm_matches_reference_and_is_row_exact(native, m):
    f = q4_fields(200, 1536, seed=m)
    layer = quant.Int4Linear.from_fields(f)
    x = torch.randn(m, 1536) * 3
    out = native.int4_gemm(x, layer.packed, layer.groups, layer.supers)[:, :200]
    ref = int4_reference(x, f)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    unrounded = x.double() @ layer.dequantized().double().T           # 8-bit rounding of activations is small
    assert (out.double() - unrounded).norm() < 2e-2 * unrounded.norm()
    for i in range(m):
        alone = native.int4_gemm(x[i:i + 1].contiguous(), layer.packed, layer.groups, layer.supers)
        assert torch.equal(alone[0, :200], out[i])


def int6_reference(x: torch.Tensor, f: Q6Fields) -> torch.Tensor:
    """float64 of gemm6.c's arithmetic: the 8-bit rounded activations times the file's weights."""
    q8, s8 = round_groups_to_int8(x)
    xq = (q8.double().reshape(len(x), -1, 32) * s8.double()[..., None]).reshape(len(x), -1)
    return xq @ f.dequantized().double().T


@pytest.mark.parametrize("m,n,k", [(1, 200, 1536), (3, 37, 896), (5, 200, 1536), (7, 40, 8960), (23, 16, 256)])
def test_int6_gemm_matches_reference_and_is_row_exact(native, m, n, k):
    f = q6_fields(n, k, seed=m)
    layer = quant.Int6Linear.from_fields(f)
    x = torch.randn(m, k) * 3
    out = native.int6_gemm(x, layer.packed, layer.scales, layer.supers)[:, :n]
    ref = int6_reference(x, f)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    for i in range(m):
        alone = native.int6_gemm(x[i:i + 1].contiguous(), layer.packed, layer.scales, layer.supers)
        assert torch.equal(alone[0, :n], out[i])


@pytest.mark.parametrize("kind", ["int4", "int6"])
def test_integer_sums_at_their_extremes_neither_saturate_nor_wrap(native, kind):
    """Every weight at its largest or smallest level (int6: and every scale) against activations that
    round to ±127: the AVX2 kernels add pair products in 16 bits (int4: eight, int6: two) before
    widening, which these sums would overflow if they added one more. int4's widening multiply also
    weighs a group by its multiplier, up to 255 here: I · sc then reaches 32 · 15 · 127 · 255, still an
    exact integer in fp32."""
    n, k = 32, 512
    if kind == "int4":
        f = q4_fields(n, k, seed=1)
        f.sc[:, ::2] = 255
        f.q[: n // 2] = 15
        f.q[n // 2:] = torch.where(torch.arange(k) % 2 == 0, 15, 0).to(torch.uint8)
        layer, ref_fn = quant.Int4Linear.from_fields(f), int4_reference
        run = lambda x: native.int4_gemm(x, layer.packed, layer.groups, layer.supers)
    else:
        f = q6_fields(n, k, seed=1)
        f.q[: n // 2] = 63
        f.q[n // 2:] = 0                                                   # q − 32 = −32
        f.sc[: n // 4] = -128                                              # the AVX2 kernel weighs pair sums
        f.sc[n // 4:] = 127                                                # by the scales in 16 bits
        layer, ref_fn = quant.Int6Linear.from_fields(f), int6_reference
        run = lambda x: native.int6_gemm(x, layer.packed, layer.scales, layer.supers)
    x = torch.ones(4, k)
    x[1] = -1.0
    x[2] = torch.where(torch.arange(k) % 2 == 0, 1.0, -1.0)
    x[3] = torch.where(torch.arange(k) % 64 < 32, 2.5, -0.5)
    out = run(x)[:, :n]
    ref = ref_fn(x, f)
    torch.testing.assert_close(out.double(), ref, rtol=1e-6, atol=1e-6 * ref.abs().max().item())


def test_int4_model_mixes_formats_and_keeps_greedy_speculation_exact():
    from conftest import tiny_model
    from verispec import LLM, SamplingParams

    def int4(model):
        fields = on_q4(model, lambda name, mod: mod.in_features % 32 == 0 and name != "lm_head")
        return quant.quantize_linears(model, "int4", fields=fields)

    target = int4(tiny_model(0, scale=1.5))
    draft = int4(tiny_model(1, scale=1.5, num_layers=1))
    layers = [type(m).__name__ for m in target.modules() if type(m).__name__.endswith("Linear")]
    assert "Int4Linear" in layers and "Int8Linear" in layers          # the LM head (no file fields) is int8
    prompts = [[1, 5, 9, 2, 7], [3, 3], [11, 4, 8, 15, 16, 23, 42, 8, 1]]
    params = SamplingParams(temperature=0, max_tokens=20)
    plain = [o.token_ids for o in LLM(target, proposer="none").generate(prompts, params)]
    spec = LLM(target, draft=draft, proposer="draft", k=3).generate(prompts, params)
    assert [o.token_ids for o in spec] == plain


def attention_reference(q, keys, values, positions, scale):
    """float64, row by row: q (B, H, T, D), keys/values (B, H_kv, S, D) -> (B, T, H, D)."""
    b, h, t, d = q.shape
    g = h // keys.shape[1]
    out = torch.empty(b, t, h, d, dtype=torch.float64)
    for i in range(b):
        for j in range(t):
            p = int(positions[i, j])
            for head in range(h):
                k, v = keys[i, head // g, : p + 1].double(), values[i, head // g, : p + 1].double()
                w = torch.softmax(k @ q[i, head, j].double() * scale, dim=0)
                out[i, j, head] = w @ v
    return out


# The last case has more scores than one work item holds, so its rows are split across work items.
# Head sizes 128 and 64 (the embedded models') and 16 take the grouped score path, 20 one key at a time.
@pytest.mark.parametrize("b,h,hkv,t,d,s", [(1, 12, 2, 1, 128, 40), (2, 12, 2, 5, 128, 300), (3, 4, 4, 2, 20, 9),
                                          (2, 14, 2, 3, 64, 77), (1, 2, 1, 7, 16, 60000)])
def test_attend_rows_matches_reference_and_is_row_exact(native, b, h, hkv, t, d, s):
    torch.manual_seed(b * 100 + t)
    q = torch.randn(b, h, t, d)
    cache = torch.randn(2, b + 1, hkv, s + 7, d)                 # a larger cache, read through a slice
    keys, values = cache[0, 1:, :, :s], cache[1, 1:, :, :s]
    positions = torch.stack([torch.arange(s - t - i, s - i) for i in range(b)])   # (B, T)
    out = native.attend_rows(q, keys, values, positions, d ** -0.5)
    ref = attention_reference(q, keys, values, positions, d ** -0.5)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    for i in range(b):                                           # one row alone equals that row in the pass
        for j in range(t):
            alone = native.attend_rows(q[i:i + 1, :, j:j + 1], keys[i:i + 1], values[i:i + 1],
                                        positions[i:i + 1, j:j + 1], d ** -0.5)
            assert torch.equal(alone[0, 0], out[i, j])


# bf16 keys and values (paired in the store's layout, kernels/abi.py): widened to float32 (AVX2, AVX-512
# without BF16) or, where the CPU has AVX512_BF16, multiplied by `vdpbf16ps` with the query and the
# softmax weights rounded to bf16. The reference reads the same bf16 values (and the rounded query).
# Past 6,144 positions a pass's rows share work items (the tile loop) while a row alone takes the
# one-row sweep of the AVX512_BF16 build: the last case holds the two to the same bits.
@pytest.mark.parametrize("b,h,hkv,t,d,s", [(1, 12, 2, 1, 128, 40), (2, 12, 2, 5, 128, 301), (3, 4, 4, 2, 20, 9),
                                          (2, 14, 2, 3, 64, 77), (1, 12, 2, 17, 128, 1001), (1, 2, 1, 7, 32, 60000),
                                          (1, 12, 2, 3, 128, 6500)])
def test_attend_rows_reads_bf16_caches_and_is_row_exact(native, b, h, hkv, t, d, s):
    torch.manual_seed(b * 100 + t + s)
    q = torch.randn(b, h, t, d)
    cache = torch.randn(2, b + 1, hkv, s + 7, d).bfloat16()
    keys, values = cache[0, 1:, :, :s], cache[1, 1:, :, :s]
    positions = torch.stack([torch.arange(s - t - i, s - i) for i in range(b)])
    out = native.attend_rows(q, keys, values, positions, d ** -0.5)
    dot_bf16 = kernels.builds_with(native.variant, "avx512bf16")          # attention.c with AVX512_BF16
    ref = attention_reference(q.bfloat16().float() if dot_bf16 else q, keys.float(), values.float(), positions,
                              d ** -0.5)
    tol = 4e-3 if dot_bf16 else 1e-5                     # the weights' rounding to bf16: 2^-9 relative
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    for i in range(b):
        for j in range(t):
            alone = native.attend_rows(q[i:i + 1, :, j:j + 1], keys[i:i + 1], values[i:i + 1],
                                        positions[i:i + 1, j:j + 1], d ** -0.5)
            assert torch.equal(alone[0, 0], out[i, j]), (i, j)


def test_attend_rows_declines_what_it_cannot_read_and_refuses_bad_positions(native):
    q, kv = torch.randn(1, 2, 1, 8), torch.randn(1, 1, 4, 8)
    assert native.attend_rows(q.bfloat16(), kv.bfloat16(), kv.bfloat16(), torch.tensor([[3]]), 1.0) is None
    assert native.attend_rows(q, kv.half(), kv.half(), torch.tensor([[3]]), 1.0) is None
    assert native.attend_rows(q, kv, kv.bfloat16(), torch.tensor([[3]]), 1.0) is None
    assert native.attend_rows(q, kv.transpose(2, 3), kv.transpose(2, 3), torch.tensor([[3]]), 1.0) is None
    with pytest.raises(ValueError, match="outside"):
        native.attend_rows(q, kv, kv, torch.tensor([[4]]), 1.0)


def test_attention_fallback_loop_matches_the_kernel(monkeypatch):
    """The torch loop (no compiler, other dtypes) computes the same attention as the kernel."""
    from verispec.models import transformer

    torch.manual_seed(5)
    q, keys, values = torch.randn(2, 6, 3, 16), torch.randn(2, 2, 10, 16), torch.randn(2, 2, 10, 16)
    positions = torch.tensor([[5, 6, 7], [7, 8, 9]])

    class View:
        position_lists = positions.tolist()

    View.positions = positions
    ref = attention_reference(q, keys, values, positions, 0.25)
    fast = transformer._attend_rows(q, keys, values, View, 0.25)
    monkeypatch.setattr(transformer.kernels, "available", lambda: False)
    slow = transformer._attend_rows(q, keys, values, View, 0.25)
    for out in (fast, slow):
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_every_variant_gives_the_same_matmul_bits():
    """The matmul variants differ in vector width only: the same integer sums and fp32 steps, the same
    bits — a matmul on an AVX-512 machine equals the one on an AVX2 machine."""
    libs = []
    for name in kernels.supported_variants():
        try:
            libs.append(kernels.load_variant(name))
        except RuntimeError as err:
            pytest.skip(f"{name} kernels: {err}")
    if len(libs) < 2:
        pytest.skip(f"this CPU runs only {[v.variant for v in libs]}: nothing to compare")
    torch.manual_seed(3)
    for m, n, k in [(1, 1000, 1536), (5, 130, 1536), (23, 67, 33), (8, 2048, 8960)]:
        q, scale = quantize_int8(torch.randn(n, k))
        x, packed = torch.randn(m, k), kernels.pack_int8(q)
        first = libs[0].int8_gemm(x, packed, scale)
        for other in libs[1:]:
            assert torch.equal(other.int8_gemm(x, packed, scale), first), (other.variant, m, n, k)
    layer = quant.Int4Linear.from_fields(q4_fields(100, 8960))
    for m in (1, 3, 4, 5, 7):           # each variant in the sweep schedules kept here (test_kernel_sweeps: either gives these bits)
        x = torch.randn(m, 8960)
        first = libs[0].int4_gemm(x, layer.packed, layer.groups, layer.supers)
        for other in libs[1:]:
            assert torch.equal(other.int4_gemm(x, layer.packed, layer.groups, layer.supers), first), (other.variant, m)
    six = quant.Int6Linear.from_fields(q6_fields(100, 8960))
    for m in (1, 3, 5, 7):
        x = torch.randn(m, 8960)
        first = libs[0].int6_gemm(x, six.packed, six.scales, six.supers)
        for other in libs[1:]:
            assert torch.equal(other.int6_gemm(x, six.packed, six.scales, six.supers), first), (other.variant, m)
    # int6 at its extremes: AVX-512 joins a group's two half-group sums in fp32, exact only while every
    # sc · (I − 32 Q) stays below 2²⁴ — here 128 · 16 · 32 · 127, the largest there is.
    f = q6_fields(32, 512, seed=2)
    f.q[:] = 0
    f.q[16:, ::2] = 63
    f.sc[:, ::2] = -128
    f.sc[:, 1::2] = 127
    six = quant.Int6Linear.from_fields(f)
    x = torch.where(torch.arange(512) % 3 == 0, 4.0, -4.0).repeat(3, 1)
    x[1] = 1.0
    first = libs[0].int6_gemm(x, six.packed, six.scales, six.supers)
    for other in libs[1:]:
        assert torch.equal(other.int6_gemm(x, six.packed, six.scales, six.supers), first), other.variant
    q, kv = torch.randn(2, 12, 5, 128), torch.randn(2, 2, 300, 128)
    positions = torch.stack([torch.arange(290, 295), torch.arange(10, 15)])
    # Attention sums in 16 lanes on AVX-512 and 8 on AVX2: the same values to float rounding.
    first = libs[0].attend_rows(q, kv, kv * 0.5, positions, 0.1)
    for other in libs[1:]:
        torch.testing.assert_close(other.attend_rows(q, kv, kv * 0.5, positions, 0.1), first, rtol=1e-5, atol=1e-6)


def test_using_puts_a_variant_in_force_for_the_block_only():
    """kernels.using (the variant comparisons of docs/measure_variants.py): inside the block the module's
    calls and its records name and run the chosen variant; after it, the best one again, even when the
    block raised."""
    names = kernels.supported_variants()
    if len(names) < 2 or not kernels.available():
        pytest.skip(f"this CPU runs only {names}: nothing to choose between")
    best, low = kernels.active_variant(), kernels.load_variant(names[-1])
    with kernels.using(low):
        assert kernels.active_variant() == names[-1] == kernels.machine()["kernel_variant"]
        assert names[-1] in kernels.kernel_status()
        q, scale = quantize_int8(torch.randn(40, 256))
        x, packed = torch.randn(3, 256), kernels.pack_int8(q)
        assert torch.equal(kernels.int8_gemm(x, packed, scale), low.int8_gemm(x, packed, scale))
    with pytest.raises(RuntimeError), kernels.using(low):
        raise RuntimeError("a measurement that failed")
    assert kernels.active_variant() == best != names[-1]


def test_a_misbuilt_avx_vnni_kernel_is_caught():
    """Broken on purpose: the avxvnni variant built with a slip in its vpdpbusd sums (int4: the high
    nibbles meet the low nibbles' activations; int6: one half-group without its −32 Q). The bit
    comparison with the avx2 variant above fails on it — it can fail — while the sound build passes."""
    if "avxvnni" not in kernels.supported_variants():
        pytest.skip("the CPU lacks AVX-VNNI: no avxvnni kernel to compare")
    try:
        vnni, avx2 = kernels.load_variant("avxvnni"), kernels.load_variant("avx2")
    except RuntimeError as err:
        pytest.skip(f"avxvnni kernels: {err}")
    broken = kernels.build_variant("avxvnni", ("VERISPEC_BROKEN_VNNI",))
    four = quant.Int4Linear.from_fields(q4_fields(64, 1536, seed=6))
    six = quant.Int6Linear.from_fields(q6_fields(64, 1536, seed=6))
    x = torch.randn(3, 1536)
    for gemm in (lambda lib: lib.int4_gemm(x, four.packed, four.groups, four.supers),
                 lambda lib: lib.int6_gemm(x, six.packed, six.scales, six.supers)):
        expected = gemm(avx2)
        assert torch.equal(gemm(vnni), expected)
        assert not torch.equal(gemm(broken), expected)


def amx_and_vector_kernels():
    """(the amx variant, the avx512bf16 variant), or a skip saying why this machine cannot compare them."""
    if "amx" not in kernels.supported_variants():
        pytest.skip("the CPU lacks AMX-INT8: no tile kernel to compare")
    try:
        return kernels.load_variant("amx"), kernels.load_variant("avx512bf16")
    except RuntimeError as err:
        pytest.skip(f"amx kernels: {err}")


AMX_CASES = [(12, 200, 1536), (13, 37, 896), (16, 48, 8960), (17, 16, 256), (31, 40, 4864), (33, 200, 1536),
             (64, 37, 896), (65, 33, 1536), (72, 100, 8960), (130, 20, 1536)]


def amx_layer(kind: str, n: int, k: int, seed: int):
    """(the layer, a function (kernels, x) -> its matmul) of one weight format."""
    if kind == "int4":
        layer = quant.Int4Linear.from_fields(q4_fields(n, k, seed=seed))
        return layer, lambda lib, x: lib.int4_gemm(x, layer.packed, layer.groups, layer.supers)
    layer = quant.Int6Linear.from_fields(q6_fields(n, k, seed=seed))
    return layer, lambda lib, x: lib.int6_gemm(x, layer.packed, layer.scales, layer.supers)


@pytest.mark.parametrize("kind", ["int4", "int6"])
@pytest.mark.parametrize("m,n,k", AMX_CASES)
def test_amx_tiles_give_the_vector_kernels_bits(m, n, k, kind):
    """The int4 and int6 matmuls on AMX tiles (wide passes: 12 or 13 rows and more) form the AVX-512
    kernels' integer sums and run their fp32 steps in their order: the same bits for every row count —
    whole and short 16-row sweeps, more rows than a panel of 64, partial super-blocks (K = 896) and partial
    column blocks."""
    amx, vector = amx_and_vector_kernels()
    _, gemm = amx_layer(kind, n, k, seed=m)
    x = torch.randn(m, k) * 3
    x[0, :32] = 0.0                                                    # a group whose sums are all zero
    tiles = gemm(amx, x)
    assert torch.equal(tiles, gemm(vector, x))
    alone = gemm(amx, x[m - 1:].contiguous())                          # one row: the vector kernel
    assert torch.equal(alone[0], tiles[m - 1])


@pytest.mark.parametrize("kind,slip", [("int4", "VERISPEC_BROKEN_AMX_B"), ("int6", "VERISPEC_BROKEN_AMX_B6")])
def test_a_misbuilt_amx_tile_is_caught(kind, slip):
    """Broken on purpose: the amx variant built with a slip in its B tiles (int4: one chunk's two rows
    swapped, so each weight meets the wrong activation; int6: four k of every group without their −32).
    The bit comparison above fails on it — it can fail."""
    amx, vector = amx_and_vector_kernels()
    broken = kernels.build_variant("amx", (slip,))
    _, gemm = amx_layer(kind, 64, 1536, seed=5)
    x = torch.randn(16, 1536)
    expected = gemm(vector, x)
    assert torch.equal(gemm(amx, x), expected)
    assert not torch.equal(gemm(broken, x), expected)
    assert torch.equal(gemm(broken, x[:5].contiguous()), expected[:5])  # narrow passes never touch the tiles


def choose_afresh(monkeypatch) -> None:
    """Let kernels choose its variant again on every call for the rest of a test (its choice is cached per
    process), leaving the process's choice as it was afterwards."""
    monkeypatch.setattr(kernels, "_load_best", kernels._load_best.__wrapped__)
    monkeypatch.setattr(kernels, "_status", kernels._status)
    monkeypatch.setattr(kernels, "_best", kernels._best)


def test_a_variant_that_cannot_load_gives_way_to_the_next(monkeypatch):
    """A variant whose build or load fails (the amx one when Linux refuses the tile state) is skipped for the
    next one the CPU supports, and the status says why; a variant forced by VERISPEC_KERNEL_ISA is not."""
    def load(name):
        if name == "amx":
            raise RuntimeError("the operating system refused the AMX tile state (Operation not permitted)")
        native = kernels.NativeKernels.__new__(kernels.NativeKernels)
        native.variant, native.defaults = name, None
        return native

    monkeypatch.setattr(kernels, "load_variant", load)
    monkeypatch.setattr(kernels, "supported_variants", lambda: ["amx", "avx2"])
    monkeypatch.delenv("VERISPEC_KERNELS", raising=False)
    monkeypatch.delenv("VERISPEC_KERNEL_ISA", raising=False)
    choose_afresh(monkeypatch)
    assert kernels._load_best() is not None
    assert kernels.kernel_status() == ("active (avx2); skipped amx: the operating system refused the AMX tile "
                                       "state (Operation not permitted)")
    monkeypatch.setenv("VERISPEC_KERNEL_ISA", "amx")
    assert kernels._load_best() is None
    assert kernels.kernel_status() == ("unavailable: amx: the operating system refused the AMX tile state "
                                       "(Operation not permitted)")


@pytest.mark.parametrize("value", ["avx512", "AVX-2", "native"])
def test_a_kernel_build_that_does_not_exist_is_refused_not_run_slowly(value, monkeypatch):
    """VERISPEC_KERNEL_ISA names a variant (a lower one than the CPU's best, for a comparison) or nothing;
    a name that is no variant used to leave the kernels unavailable and every pass on torch's slower
    path. It is refused with the names to choose from; a variant the CPU lacks still falls back (its
    status says why)."""
    from verispec.errors import InvalidSetting

    monkeypatch.delenv("VERISPEC_KERNELS", raising=False)
    choose_afresh(monkeypatch)
    monkeypatch.setenv("VERISPEC_KERNEL_ISA", value)
    with pytest.raises(InvalidSetting, match=f"VERISPEC_KERNEL_ISA='{value.lower()}' names no kernel build; "
                                             "choose one of amx, avx512bf16"):
        kernels.kernel_status()
    lacking = [v.name for v in kernels.VARIANTS if v.name not in kernels.supported_variants()]
    if lacking:
        monkeypatch.setenv("VERISPEC_KERNEL_ISA", lacking[0])
        assert kernels.kernel_status().startswith(f"unavailable: {lacking[0]}: the CPU lacks")


@pytest.mark.parametrize("value", ["of", "disable", "2"])
def test_a_switch_that_is_neither_off_nor_on_is_refused(value, monkeypatch):
    """VERISPEC_KERNELS=off runs on torch's kernels; a value that is neither off nor on used to be taken
    as on, so a misspelt 'off' measured the native kernels under the wrong name. LLM checks it first."""
    from verispec import LLM
    from verispec.errors import InvalidSetting

    monkeypatch.delenv("VERISPEC_KERNEL_ISA", raising=False)
    choose_afresh(monkeypatch)
    monkeypatch.setenv("VERISPEC_KERNELS", value)
    with pytest.raises(InvalidSetting, match=f"VERISPEC_KERNELS='{value}' is not a setting"):
        kernels.kernel_status()
    with pytest.raises(InvalidSetting):                 # before the model is looked for, let alone loaded
        LLM("/no/such/model.gguf")
    monkeypatch.setenv("VERISPEC_KERNELS", " OFF ")
    assert kernels.kernel_status() == "off (VERISPEC_KERNELS)" and not kernels.available()
    monkeypatch.setenv("VERISPEC_KERNELS", "yes")
    assert not kernels.switched_off()


def test_results_files_name_the_cpu_core_a_virtual_machine_hides():
    """'AMD EPYC' is all a virtual machine's model name may say; family and model tell a Zen/Zen+ (one 256-bit
    integer multiply every other cycle) from a Zen 2 or Zen 4."""
    from verispec.kernels import cpu

    block = "processor\t: {n}\nvendor_id\t: {v}\ncpu family\t: {f}\nmodel\t\t: {m}\nmodel name\t: AMD EPYC\n"
    two = lambda v, f, m, f2=None: block.format(n=0, v=v, f=f, m=m) + "\n" + block.format(n=1, v=v, f=f2 or f, m=m)
    assert cpu.cpu_core(two("AuthenticAMD", 23, 1, f2=25)) == "AMD family 23 model 1 (Zen/Zen+)"
    assert cpu.cpu_core(two("AuthenticAMD", 23, 49)) == "AMD family 23 model 49 (Zen 2)"
    assert cpu.cpu_core(two("AuthenticAMD", 25, 1)) == "AMD family 25 model 1 (Zen 3)"
    assert cpu.cpu_core(two("AuthenticAMD", 25, 17)) == "AMD family 25 model 17 (Zen 4)"
    assert cpu.cpu_core(two("GenuineIntel", 6, 143)) == "Intel family 6 model 143"
    assert cpu.cpu_core("processor\t: 0\nmodel name\t: ARMv8\n") == ""
    assert cpu.cpu_core(two("AuthenticAMD", "x", 1)) == ""
    assert kernels.machine()["cpu_core"] == cpu.cpu_core(Path("/proc/cpuinfo").read_text())


def test_the_best_supported_variant_is_active_and_named():
    if not kernels.available():
        pytest.skip(f"native kernel {kernels.kernel_status()}")
    info = kernels.machine()
    assert info["kernel_variant"] in kernels.supported_variants()
    if not os.environ.get("VERISPEC_KERNEL_ISA"):
        assert info["kernel_variant"] == kernels.supported_variants()[0]
    assert "avx2" in info["cpu_flags"]
    # the AVX2-class variants name their sweep schedule after the variant: 'active (avx2; one sweep …)'
    assert re.match(rf"active \({info['kernel_variant']}[;)]", info["kernel"]), info["kernel"]


def test_every_supported_variant_builds_where_there_is_a_compiler():
    """The `native` fixture skips a variant the CPU lacks; a variant that fails to compile must fail here
    instead of skipping every kernel test with it."""
    if kernels._compiler() is None:
        pytest.skip("no C compiler")
    for name in kernels.supported_variants():
        assert kernels.load_variant(name).variant == name


def test_an_unknown_or_unsupported_variant_says_why():
    with pytest.raises(RuntimeError, match="unknown kernel variant"):
        kernels.load_variant("sse9")
    for v in kernels.VARIANTS:
        if v.name not in kernels.supported_variants():
            with pytest.raises(RuntimeError, match="the CPU lacks"):
                kernels.load_variant(v.name)




@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attend_rows_a_nan_key_makes_nan_only_the_rows_that_see_it(native, dtype):
    """The softmax's NaN check: a row whose prefix holds a NaN score is NaN throughout (as torch's
    softmax would make it); a row whose prefix ends before it stays finite and unchanged."""
    torch.manual_seed(11)
    q = torch.randn(1, 12, 3, 128)
    keys, values = torch.randn(1, 2, 40, 128).to(dtype), torch.randn(1, 2, 40, 128).to(dtype)
    positions = torch.tensor([[36, 37, 38]])
    clean = native.attend_rows(q, keys, values, positions, 128 ** -0.5)
    keys[0, 1, 37, 5] = float("nan")                             # KV head 1: query heads 6 … 11
    out = native.attend_rows(q, keys, values, positions, 128 ** -0.5)
    assert torch.equal(out[0, 0], clean[0, 0])                   # position 36 never sees key 37
    assert torch.isnan(out[0, 1:, 6:]).all() and torch.equal(out[0, 1:, :6], clean[0, 1:, :6])
