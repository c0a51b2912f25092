"""Other checkpoint forms against transformers: a Hugging Face safetensors directory, and a llama
GGUF whose Q/K rows carry llama.cpp's RoPE permutation (which the loader must undo)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from verispec.engine.loading import load_model
from verispec.models import KVCache

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))


def hf_llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(cfg).float().eval()


def our_logits(model, ids):
    t = ids.shape[1]
    cache = KVCache.for_model(model.config, 1, t, torch.float32)
    pos = torch.arange(t)[None]
    return model.logits(model(ids, pos, cache.view([0], pos)), pos)


def test_hf_safetensors_directory(tmp_path):
    hf = hf_llama()
    hf.save_pretrained(tmp_path / "llama", safe_serialization=True)
    m = load_model(tmp_path / "llama", dtype="float32")
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad():
        ref = hf(ids).logits
    torch.testing.assert_close(our_logits(m.model, ids), ref, atol=1e-4, rtol=1e-4)


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's conversion of HF Q/K rows (rotate-half) to interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_llama_gguf_permutation_is_undone(tmp_path):
    hf = hf_llama()
    cfg = hf.config
    sd = {k: v.numpy() for k, v in hf.state_dict().items()}
    path = tmp_path / "llama.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for i in range(cfg.num_hidden_layers):
        for hf_name, g_name in names.items():
            t = sd[f"model.layers.{i}.{hf_name}.weight"]
            if g_name == "attn_q":
                t = _permute(t, cfg.num_attention_heads)
            elif g_name == "attn_k":
                t = _permute(t, cfg.num_key_value_heads)
            w.add_tensor(f"blk.{i}.{g_name}.weight", np.ascontiguousarray(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    m = load_model(path, dtype="float32")
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad():
        ref = hf(ids).logits
    torch.testing.assert_close(our_logits(m.model, ids), ref, atol=1e-4, rtol=1e-4)
