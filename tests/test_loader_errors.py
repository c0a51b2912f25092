"""Bad model files get one clear error that names the file and the problem."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from verispec.errors import InvalidModelFile, ModelNotFound, ModelNotInstalled, UnsupportedModel  # noqa: E402
from verispec.loaders import builtin  # noqa: E402
from verispec.engine.loading import load_model  # noqa: E402


# A 48-token byte-level BPE for tiny models: letters, digits, a space, two merges, ChatML specials.
TINY_TOKENS = [*"abcdefghijklmnopqrstuvwxyz", *"ABCDEFGHIJKLMN", "0", "1", "Ġ", "Ġa", "ab",
               "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TINY_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def add_tiny_tokenizer(w) -> None:
    """Tokenizer metadata as llama.cpp writes it (gpt2 BPE, token types, merges, ids, chat template)."""
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(TINY_TOKENS)
    w.add_token_types([3 if t.startswith("<|") else 1 for t in TINY_TOKENS])
    w.add_token_merges(["Ġ a", "a b"])
    w.add_eos_token_id(TINY_TOKENS.index("<|im_end|>"))
    w.add_bos_token_id(TINY_TOKENS.index("<|endoftext|>"))
    w.add_chat_template(TINY_TEMPLATE)


def write_tiny_gguf(path: Path, arch: str = "qwen2", qtype=None, drop: str | None = None, layers: int = 1,
                    tokenizer: bool = False) -> Path:
    """A small valid GGUF written with the gguf package (F32 weights unless qtype given; with
    `tokenizer`, a 48-token BPE and a chat template in the metadata)."""
    from gguf import GGMLQuantizationType as Q
    w = gguf.GGUFWriter(str(path), arch)
    if tokenizer:
        add_tiny_tokenizer(w)
    c, ff, heads, kv, vocab = 32, 64, 4, 2, 48
    w.add_block_count(layers)
    w.add_context_length(128)
    w.add_embedding_length(c)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    rng = np.random.default_rng(0)
    d = c // heads

    def t(name, shape):
        if name == drop:
            return
        data = rng.standard_normal(shape).astype(np.float32) * 0.1
        if qtype is not None and len(shape) == 2:
            data = gguf.quants.quantize(data, qtype)
            w.add_tensor(name, data, raw_dtype=qtype)
        else:
            w.add_tensor(name, data)

    t("token_embd.weight", (vocab, c))
    t("output_norm.weight", (c,))
    t("output.weight", (vocab, c))
    for i in range(layers):
        p = f"blk.{i}."
        t(p + "attn_norm.weight", (c,))
        t(p + "ffn_norm.weight", (c,))
        t(p + "attn_q.weight", (heads * d, c))
        t(p + "attn_k.weight", (kv * d, c))
        t(p + "attn_v.weight", (kv * d, c))
        if arch == "qwen2":
            t(p + "attn_q.bias", (heads * d,))
            t(p + "attn_k.bias", (kv * d,))
            t(p + "attn_v.bias", (kv * d,))
        t(p + "attn_output.weight", (c, heads * d))
        t(p + "ffn_gate.weight", (ff, c))
        t(p + "ffn_up.weight", (ff, c))
        t(p + "ffn_down.weight", (c, ff))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_tiny_gguf_loads_and_runs(tmp_path, arch):
    from verispec import LLM, SamplingParams
    path = write_tiny_gguf(tmp_path / "m.gguf", arch=arch)
    m = load_model(path)
    assert m.config.architecture == arch and m.config.attention_bias == (arch == "qwen2") and m.cold
    again = load_model(path)
    assert not again.cold       # second load reads the prepared cache
    out = LLM(again.model, proposer="none").generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4))
    assert len(out[0].token_ids) == 4


def test_quantized_tensor_types_dequantize(tmp_path):
    from gguf import GGMLQuantizationType as Q
    for qtype in (Q.Q8_0, Q.Q4_0, Q.F16):
        path = write_tiny_gguf(tmp_path / f"m-{qtype.name}.gguf", qtype=qtype)
        m = load_model(path, dtype="float32")
        assert m.model.model.layers[0].mlp.gate_up_proj.weight.abs().sum() > 0


def test_truncated_file(tmp_path):
    path = write_tiny_gguf(tmp_path / "m.gguf")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])
    with pytest.raises(InvalidModelFile, match="m.gguf"):
        load_model(path)


def test_not_a_gguf(tmp_path):
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"this is not a model" * 10)
    with pytest.raises(InvalidModelFile, match="bad magic"):
        load_model(path)


def test_missing_tensor(tmp_path):
    path = write_tiny_gguf(tmp_path / "m.gguf", drop="blk.0.ffn_up.weight")
    with pytest.raises(InvalidModelFile, match="missing"):
        load_model(path)


def test_unsupported_architecture(tmp_path):
    path = write_tiny_gguf(tmp_path / "m.gguf", arch="gpt2")
    with pytest.raises(UnsupportedModel, match="gpt2"):
        load_model(path)


def test_unsupported_tensor_type(tmp_path):
    from gguf import GGMLQuantizationType as Q
    path = write_tiny_gguf(tmp_path / "m.gguf", qtype=Q.Q5_1)
    import verispec.loaders.gguf_loader as gl
    saved = gl.SUPPORTED_TYPES
    gl.SUPPORTED_TYPES = saved - {Q.Q5_1}
    try:
        with pytest.raises(UnsupportedModel, match="Q5_1"):
            load_model(path)
    finally:
        gl.SUPPORTED_TYPES = saved


def test_unknown_model_name():
    with pytest.raises(ModelNotFound, match="built-in"):
        load_model("no-such-model")


def test_builtin_hash_mismatch_leaves_nothing_behind(tmp_path, monkeypatch):
    """A corrupted part fails the sha256 check; the cache holds no half-written file afterwards."""
    parts = []
    for i in range(2):
        p = tmp_path / f"part{i + 1:02d}.bin"
        p.write_bytes(bytes([i]) * 1000)
        parts.append(p)
    fake = builtin.BuiltinModel("fake-model", "draft", ("a", "b"), 2000, "0" * 64)
    monkeypatch.setitem(builtin.BUILTIN_MODELS, "fake-model", fake)
    monkeypatch.setattr(builtin, "part_files", lambda model: (parts, []))
    with pytest.raises(ModelNotInstalled, match="corrupt"):
        builtin.ensure_assembled("fake-model", progress=False)
    assert list((tmp_path / "cache").iterdir()) == []


def test_builtin_missing_packages_say_what_to_run(monkeypatch):
    fake = builtin.BuiltinModel("fake-model", "draft", ("verispec-no-such-dist-1",), 10, "0" * 64)
    monkeypatch.setitem(builtin.BUILTIN_MODELS, "fake-model", fake)
    with pytest.raises(ModelNotInstalled, match="pip install"):
        builtin.ensure_assembled("fake-model")
