"""What every checkpoint must hold for a config, and the model's names for its fused projections."""

from __future__ import annotations

import torch

from verispec.config import ModelConfig
from verispec.errors import InvalidModelFile


FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def fuse_projections(state: dict, prefix: str = "", combine=torch.cat) -> None:
    """In place: replace each group of checkpoint projections under `prefix` by its fused tensor,
    dropping the parts as it goes (a state dict already fused passes through). `combine` joins the
    parts (torch.cat for tensors; anything else for, say, a dict of shapes)."""
    for name in [n for n in state if n.startswith(prefix)]:
        stem, _, kind = name.rpartition(".")
        module, _, leaf = stem.rpartition(".")
        for fused, parts in FUSED.items():
            names = [f"{module}.{p}.{kind}" for p in parts]
            if leaf == parts[0] and all(n in state for n in names):
                state[f"{module}.{fused}.{kind}"] = combine([state.pop(n) for n in names])


def expected_shapes(cfg: ModelConfig, fused: bool = False) -> dict[str, tuple[int, ...]]:
    """Hugging Face name -> (out, in) shape every checkpoint of this config must have; fused: under
    the model's own names, q/k/v and gate/up as one tensor each (FUSED)."""
    c, d = cfg.hidden_size, cfg.head_dim
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, c), "model.norm.weight": (c,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, c)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (c,), p + "post_attention_layernorm.weight": (c,),
            p + "self_attn.q_proj.weight": (cfg.num_heads * d, c),
            p + "self_attn.k_proj.weight": (cfg.num_kv_heads * d, c),
            p + "self_attn.v_proj.weight": (cfg.num_kv_heads * d, c),
            p + "self_attn.o_proj.weight": (c, cfg.num_heads * d),
            p + "mlp.gate_proj.weight": (cfg.intermediate_size, c),
            p + "mlp.up_proj.weight": (cfg.intermediate_size, c),
            p + "mlp.down_proj.weight": (c, cfg.intermediate_size),
        }
        if cfg.attention_bias:
            shapes |= {p + "self_attn.q_proj.bias": (cfg.num_heads * d,),
                       p + "self_attn.k_proj.bias": (cfg.num_kv_heads * d,),
                       p + "self_attn.v_proj.bias": (cfg.num_kv_heads * d,)}
    if fused:
        fuse_projections(shapes, combine=lambda parts: (sum(s[0] for s in parts), *parts[0][1:]))
    return shapes


def is_fused(state: dict) -> bool:
    """Whether a state dict names its projections the model's way (FUSED)."""
    return any(k.endswith(tuple(f".{fused}.weight" for fused in FUSED)) for k in state)


def check_state(cfg: ModelConfig, state: dict[str, torch.Tensor], source: object) -> None:
    """Raise InvalidModelFile unless `state` holds exactly the tensors `cfg` needs, with their shapes."""
    want = expected_shapes(cfg, fused=is_fused(state))
    missing = sorted(set(want) - set(state))
    if missing:
        raise InvalidModelFile(source, f"missing {len(missing)} tensor(s), e.g. {missing[0]}")
    for name, shape in want.items():
        if tuple(state[name].shape) != shape:
            raise InvalidModelFile(source, f"tensor {name} has shape {tuple(state[name].shape)}, expected {shape}")
