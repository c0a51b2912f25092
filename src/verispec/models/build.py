"""Turning a validated state dict (loaders/checkpoint.py) into a Transformer."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from verispec.config import ModelConfig
from verispec.errors import InvalidModelFile
from verispec.loaders.checkpoint import check_state, expected_shapes, fuse_projections, is_fused
from verispec.models.quant import quantize_linears
from verispec.models.transformer import Rotary, Transformer


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


def looked_up(names: Iterable[str], cfg: ModelConfig, quantized: bool) -> frozenset[str]:
    """The tensors of a state that a pass reads by rows, one per token: the token embedding's, unless
    it is also the LM head (a float model with tied embeddings, see build_model, or a state without an
    LM head of its own). The loader leaves them out of huge pages (loaders/safetensors_file.py)."""
    names = list(names)
    if (cfg.tie_word_embeddings and not quantized) or not any(n.startswith("lm_head.") for n in names):
        return frozenset()
    return frozenset(n for n in names if n.startswith("model.embed_tokens."))


def build_quantized(cfg: ModelConfig, state: dict[str, torch.Tensor], quant: str,
                    device: str | torch.device, source: object) -> Transformer:
    """A model whose linears are already quantized, from the state dict a quantized model saved
    (every tensor keeps the dtype it was saved in)."""
    with torch.device("meta"):
        model = quantize_linears(Transformer(cfg), quant, state)
    try:
        model.load_state_dict(state, assign=True, strict=True)
    except RuntimeError as exc:
        raise InvalidModelFile(source, f"cached {quant} weights do not fit the model ({str(exc)[:200]})") from None
    model.rotary = Rotary(cfg.head_dim, cfg.rope_theta)
    return model.to(device).eval()
