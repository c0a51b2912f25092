"""Weight-only int8: parity against the dequantized reference, awkward shapes, and losslessness
relative to the target as it is run (same format on both sides)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from verispec import LLM, SamplingParams, kernels
from verispec.models.quant import Int8Linear, quantize_int8, quantize_linears
from conftest import tiny_model


@pytest.mark.parametrize("shape", [(896, 4864), (4864, 896), (7, 33), (151, 96)])
def test_int8_round_trip_error_is_bounded(shape):
    torch.manual_seed(0)
    w = torch.randn(shape)
    q, scale = quantize_int8(w)
    err = (q.float() * scale[:, None] - w).abs()
    assert (err <= scale[:, None] / 2 + 1e-6).all()          # at most half a quantization step


@pytest.mark.parametrize("rows", [1, 5, 9])
def test_int8_linear_matches_dequantized_reference(rows):
    torch.manual_seed(1)
    lin = nn.Linear(896, 4864 // 4, bias=True)
    q = Int8Linear(lin)
    x = torch.randn(rows, 896)
    ref = x.to(torch.bfloat16).float() @ q.dequantized().T + lin.bias
    out = q(x)
    assert out.shape == (rows, 4864 // 4)
    assert (out - ref).abs().max() < 2e-2 * ref.abs().max()


def test_greedy_speculative_equals_plain_in_int8():
    target = quantize_linears(tiny_model(0, scale=1.5), "int8")
    draft = quantize_linears(tiny_model(1, scale=1.5, num_layers=1), "int8")
    assert isinstance(target.lm_head, Int8Linear)
    prompts = [[1, 5, 9, 2, 7], [3, 3], [11, 4, 8, 15, 16, 23, 42, 8, 1]]
    params = SamplingParams(temperature=0, max_tokens=24)
    plain = [o.token_ids for o in LLM(target, proposer="none").generate(prompts, params)]
    for k in (2, 4):
        spec = LLM(target, draft=draft, proposer="draft", k=k).generate(prompts, params)
        assert [o.token_ids for o in spec] == plain


def test_quantized_weights_are_cached_in_the_prepared_directory(tmp_path, monkeypatch):
    from test_loader_errors import write_tiny_gguf
    from verispec.engine.loading import load_model

    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    path = write_tiny_gguf(tmp_path / "m.gguf")
    first = load_model(path, dtype="int8")
    assert list((tmp_path / "cache").rglob("model.int8.v*.safetensors"))
    second = load_model(path, dtype="int8")
    assert isinstance(second.model.lm_head, Int8Linear)
    ids = [[1, 2, 3, 4]]
    params = SamplingParams(temperature=0, max_tokens=6)
    a = LLM(first.model, proposer="none").generate(ids, params)[0].token_ids
    b = LLM(second.model, proposer="none").generate(ids, params)[0].token_ids
    assert a == b
    assert load_model(path, dtype="float32").model.lm_head.weight.dtype == torch.float32


def test_quantized_caches_of_an_older_layout_are_ignored_and_replaced(tmp_path, monkeypatch):
    from test_loader_errors import write_tiny_gguf
    from verispec.engine.loading import load_model

    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    path = write_tiny_gguf(tmp_path / "m.gguf")
    load_model(path, dtype="float32")                                   # prepares the directory
    prepared = next((tmp_path / "cache").rglob("verispec.json")).parent
    (prepared / "model.int8.safetensors").write_bytes(b"an int8 cache in an older layout")
    assert load_model(path, dtype="float32").model is not None          # not mistaken for weights
    assert isinstance(load_model(path, dtype="int8").model.lm_head, Int8Linear)
    assert not (prepared / "model.int8.safetensors").exists()
    assert list(prepared.glob("model.int8.v*.safetensors"))


def test_prepared_directories_store_fused_projections_and_older_ones_are_redone(tmp_path, monkeypatch):
    import json

    from safetensors.torch import load_file

    from test_loader_errors import write_tiny_gguf
    from verispec.engine.loading import PREPARED_VERSION, load_model

    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    path = write_tiny_gguf(tmp_path / "m.gguf")
    assert load_model(path, dtype="float32").cold
    prepared = next((tmp_path / "cache").rglob("verispec.json")).parent
    names = set(load_file(str(prepared / "model.safetensors")))
    assert "model.layers.0.self_attn.qkv_proj.weight" in names and "model.layers.0.mlp.gate_up_proj.weight" in names
    assert not any(".q_proj." in n or ".up_proj." in n for n in names)
    assert not load_model(path, dtype="float32").cold
    meta = json.loads((prepared / "verispec.json").read_text())
    (prepared / "verispec.json").write_text(json.dumps(meta | {"version": PREPARED_VERSION - 1}))
    assert load_model(path, dtype="float32").cold                        # an older layout is prepared again


def test_int8_rows_selected_keep_their_integers_and_scores():
    """A truncated LM head (draft vocabulary, heads) slices the int8 rows: the same logits as the full head."""
    from torch import nn

    from verispec.models.quant import Int8Linear

    torch.manual_seed(0)
    head = Int8Linear(nn.Linear(64, 300, bias=False))
    rows = torch.tensor([0, 5, 17, 299])
    sub = head.select_rows(rows)
    x = torch.randn(3, 64)
    assert sub.out_features == 4 and torch.equal(sub.scales, head.scales[rows])
    assert torch.equal(sub(x), head(x)[:, rows])


def test_int4_all_puts_every_linear_in_int4_and_is_cached(tmp_path, monkeypatch):
    """A draft's CPU default: every linear (the LM head too) rounded into the 4-bit format, cached in its
    own file beside int4's, and loaded back with the same weights."""
    from test_loader_errors import write_tiny_gguf
    from verispec.engine.loading import load_model
    from verispec.models.quant import Int4Embedding, Int4Linear

    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    path = write_tiny_gguf(tmp_path / "m.gguf")
    first = load_model(path, dtype="int4-all")
    linears = [m for m in first.model.modules() if isinstance(m, (Int4Linear, Int8Linear))]
    assert linears and all(isinstance(m, Int4Linear) for m in linears)
    assert isinstance(first.model.model.embed_tokens, Int4Embedding)           # the table too, rounded
    assert list((tmp_path / "cache").rglob("model.int4-all.v*.safetensors"))
    second = load_model(path, dtype="int4-all")
    assert not second.cold
    for a, b in zip(first.model.state_dict().values(), second.model.state_dict().values()):
        assert torch.equal(a, b)
    assert isinstance(load_model(path, dtype="int8").model.lm_head, Int8Linear)     # its own cache


def test_an_unknown_draft_dtype_fails_before_any_load():
    from verispec.errors import VerispecError

    with pytest.raises(VerispecError, match="unknown dtype"):
        LLM(tiny_model(0), proposer="none", draft_dtype="int3")


@pytest.mark.parametrize("native", [True, False])
def test_auto_picks_the_packed_formats_only_where_the_native_kernels_run(monkeypatch, native):
    """int4 for a target and int4-all for a draft on a CPU that runs the kernels; float32 where it cannot
    (the torch path would hold a float32 copy of every packed layer beside it); an explicit format as
    given; bfloat16 on a GPU."""
    from verispec.engine.loading import auto_dtype, draft_auto_dtype

    monkeypatch.setattr(kernels, "available", lambda: native)
    assert auto_dtype("auto", "cpu") == ("int4" if native else "float32")
    assert draft_auto_dtype("auto", "cpu") == ("int4-all" if native else "float32")
    assert auto_dtype("int8", "cpu") == draft_auto_dtype("int8", "cpu") == "int8"
    assert auto_dtype("auto", "cuda") == draft_auto_dtype("auto", "cuda") == "bfloat16"


def test_with_the_kernels_off_auto_loads_float32_and_no_packed_layer(tmp_path, monkeypatch):
    from test_loader_errors import write_tiny_gguf
    from verispec.engine.loading import load_model
    from verispec.models.quant import BlockLinear

    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(kernels, "available", lambda: False)
    loaded = load_model(write_tiny_gguf(tmp_path / "m.gguf"))
    assert loaded.model.dtype == torch.float32
    assert not [m for m in loaded.model.modules() if isinstance(m, (BlockLinear, Int8Linear))]
