"""Our Qwen2/Llama model against Hugging Face transformers on the same random weights (fp32)."""

from __future__ import annotations

import pytest
import torch

from verispec.models import KVCache
from verispec.models.transformer import ROTARY_TABLE_MIN, Rotary
from conftest import tiny_model

transformers = pytest.importorskip("transformers")


def _checkpoint_names(ours) -> dict[str, torch.Tensor]:
    """Our state dict under checkpoint names: the fused projections split back into their parts."""
    out = {}
    for name, t in ours.state_dict().items():
        if ".qkv_proj." in name:
            split = ours.model.layers[0].self_attn.split
            for part, piece in zip(("q_proj", "k_proj", "v_proj"), t.split(split)):
                out[name.replace("qkv_proj", part)] = piece
        elif ".gate_up_proj." in name:
            for part, piece in zip(("gate_proj", "up_proj"), t.chunk(2)):
                out[name.replace("gate_up_proj", part)] = piece
        else:
            out[name] = t
    return out


def _hf_model(ours):
    cfg = ours.config
    common = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                  num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                  num_key_value_heads=cfg.num_kv_heads, max_position_embeddings=cfg.max_position_embeddings,
                  rope_theta=cfg.rope_theta, rms_norm_eps=cfg.rms_norm_eps, tie_word_embeddings=False)
    if cfg.architecture == "qwen2":
        hf_cfg = transformers.Qwen2Config(**common)
        hf = transformers.Qwen2ForCausalLM(hf_cfg)
    else:
        hf_cfg = transformers.LlamaConfig(**common, attention_bias=False, mlp_bias=False)
        hf = transformers.LlamaForCausalLM(hf_cfg)
    missing, unexpected = hf.load_state_dict(_checkpoint_names(ours), strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    return hf.float().eval()


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_prefill_and_cached_decode_match_transformers(arch):
    ours = tiny_model(1, arch=arch)
    hf = _hf_model(ours)
    torch.manual_seed(0)
    ids = torch.randint(0, ours.config.vocab_size, (1, 12))

    with torch.no_grad():
        ref = hf(ids).logits                                                   # (1, 12, V)

    cache = KVCache.for_model(ours.config, num_slots=1, max_len=64, dtype=torch.float32)
    prompt = 7
    pos = torch.arange(prompt)[None]
    h = ours(ids[:, :prompt], pos, cache.view([0], pos))
    logits = ours.logits(h, torch.arange(prompt)[None])
    torch.testing.assert_close(logits, ref[:, :prompt], atol=1e-4, rtol=1e-4)
    for t in range(prompt, 12):                                                # cached decode, one at a time
        pos = torch.tensor([[t]])
        h = ours(ids[:, t:t + 1], pos, cache.view([0], pos))
        torch.testing.assert_close(ours.logits(h, torch.zeros(1, 1, dtype=torch.long))[:, 0], ref[:, t],
                                   atol=1e-4, rtol=1e-4)


def test_rollback_then_redecode_gives_same_logits():
    ours = tiny_model(2)
    torch.manual_seed(1)
    ids = torch.randint(0, ours.config.vocab_size, (1, 10))
    other = torch.randint(0, ours.config.vocab_size, (1, 4))
    cache = KVCache.for_model(ours.config, num_slots=1, max_len=32, dtype=torch.float32)
    pos = torch.arange(10)[None]
    first = ours.logits(ours(ids, pos, cache.view([0], pos)), torch.arange(6, 10)[None])
    # Overwrite positions 6..9 with other tokens (a rejected draft), then roll back and redo.
    pos_b = torch.arange(6, 10)[None]
    ours(other, pos_b, cache.view([0], pos_b))
    cache.set_length(0, 6)
    again = ours.logits(ours(ids[:, 6:], pos_b, cache.view([0], pos_b)), torch.arange(4)[None])
    torch.testing.assert_close(again, first, atol=1e-5, rtol=1e-5)


def test_ragged_batch_matches_single_sequences():
    """Right-padded batched prefill and per-row positions give each row its own logits."""
    ours = tiny_model(3)
    torch.manual_seed(2)
    a = torch.randint(0, ours.config.vocab_size, (9,))
    b = torch.randint(0, ours.config.vocab_size, (5,))
    cache = KVCache.for_model(ours.config, num_slots=3, max_len=32, dtype=torch.float32)
    ids = torch.zeros(2, 9, dtype=torch.long)
    ids[0], ids[1, :5] = a, b
    pos = torch.arange(9)[None].repeat(2, 1)
    # Non-contiguous slots 0 and 2 exercise the gather path.
    h = ours(ids, pos, cache.view([0, 2], pos))
    batched = ours.logits(h, torch.tensor([[8], [4]]))
    for slot, seq in ((1, a), (1, b)):
        single = KVCache.for_model(ours.config, 1, 32, torch.float32)
        p = torch.arange(len(seq))[None]
        out = ours.logits(ours(seq[None], p, single.view([0], p)), torch.tensor([[len(seq) - 1]]))
        row = 0 if seq is a else 1
        torch.testing.assert_close(batched[row], out[0], atol=1e-5, rtol=1e-5)


def test_checkpoint_projections_load_fused_and_round_trip():
    """Checkpoints name q/k/v and gate/up apart; the model fuses them at load, rows in order."""
    from verispec.models import Transformer

    ours = tiny_model(3)
    parts = _checkpoint_names(ours)
    assert "model.layers.0.self_attn.k_proj.bias" in parts and "model.layers.0.mlp.up_proj.weight" in parts
    again = Transformer(ours.config)
    again.load_state_dict(parts, strict=False)
    for name, t in ours.state_dict().items():
        assert torch.equal(again.state_dict()[name], t), name


@pytest.mark.parametrize("head_dim", [64, 128, 8])
def test_rotary_table_keeps_each_positions_angles_as_it_grows(head_dim):
    """cos/sin come from a table grown on demand: a position's angles are the direct computation's
    (RoPE's freqs · position, duplicated), and have the same bits before and after the table grows."""
    rot = Rotary(head_dim, 10000.0)
    early = torch.tensor([[0, 5, 17, 63]])
    cos, sin = rot(early, torch.float32)                                     # (1, 1, 4, D)
    assert cos.shape == (1, 1, 4, head_dim) and rot._table[0].shape[0] == ROTARY_TABLE_MIN
    freqs = (early[..., None].float() * rot.inv_freq).double()              # RoPE's fp32 angles, exact cos
    ref = torch.cat((freqs, freqs), dim=-1)
    torch.testing.assert_close(cos[:, 0].double(), ref.cos(), rtol=0, atol=1e-6)
    torch.testing.assert_close(sin[:, 0].double(), ref.sin(), rtol=0, atol=1e-6)
    far = torch.tensor([[5, 3000], [17, 63]])
    cos2, sin2 = rot(far, torch.float32)                                     # grows the table to 4096
    assert rot._table[0].shape[0] == 4096
    assert torch.equal(cos2[0, 0, 0], cos[0, 0, 1]) and torch.equal(sin2[1, 0], sin[0, 0, 2:])
    freqs = (torch.tensor(3000.0) * rot.inv_freq).double()
    torch.testing.assert_close(cos2[0, 0, 1, : head_dim // 2].double(), freqs.cos(), rtol=0, atol=1e-6)
