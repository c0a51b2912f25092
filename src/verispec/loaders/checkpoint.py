"""What every checkpoint must hold for a config, and turning a validated state dict into a model."""

from __future__ import annotations

import torch

from verispec.config import ModelConfig
from verispec.errors import InvalidModelFile
from verispec.models import Transformer
from verispec.models.transformer import FUSED, Rotary, fuse_projections


def expected_shapes(cfg: ModelConfig, fused: bool = False) -> dict[str, tuple[int, ...]]:
    """Hugging Face name -> (out, in) shape every checkpoint of this config must have; fused: under
    the model's own names, q/k/v and gate/up as one tensor each (transformer.FUSED)."""
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
    """Whether a state dict names its projections the model's way (transformer.FUSED)."""
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


def build_model(cfg: ModelConfig, state: dict[str, torch.Tensor], dtype: torch.dtype,
                device: str | torch.device, source: object) -> Transformer:
    """Assemble a Transformer from a state dict without allocating a second copy of the weights."""
    check_state(cfg, state, source)
    wanted = expected_shapes(cfg, fused=is_fused(state))
    state = {k: v for k, v in state.items() if k in wanted}
    fuse_projections(state)                     # here, so each part is freed as soon as it is fused
    if cfg.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    with torch.device("meta"):
        model = Transformer(cfg)
    model.load_state_dict(state, assign=True, strict=True)
    model.rotary = Rotary(cfg.head_dim, cfg.rope_theta)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.to(device=device, dtype=dtype).eval()


def build_quantized(cfg: ModelConfig, state: dict[str, torch.Tensor], quant: str,
                    device: str | torch.device, source: object) -> Transformer:
    """A model whose linears are already quantized, from the state dict a quantized model saved
    (every tensor keeps the dtype it was saved in)."""
    from verispec.models.quant import quantize_linears

    with torch.device("meta"):
        model = quantize_linears(Transformer(cfg), quant, state)
    try:
        model.load_state_dict(state, assign=True, strict=True)
    except RuntimeError as exc:
        raise InvalidModelFile(source, f"cached {quant} weights do not fit the model ({str(exc)[:200]})") from None
    model.rotary = Rotary(cfg.head_dim, cfg.rope_theta)
    return model.to(device).eval()
