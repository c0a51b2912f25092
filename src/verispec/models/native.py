"""A whole decoder pass in one native call (kernels/decoder.c) for int8 models on the CPU.

`NativeDecoder.build(model)` says whether a model qualifies — float32 compute, every projection an
`Int8Linear`, `Int4Linear` or `Int6Linear` in the kernels' packed layouts (o, gate/up and down without bias), the
native kernels available — and holds one `LayerWeights` record of tensor pointers per layer. Calling it runs every
decoder layer over a pass of new tokens, reading and writing the engine's cache (static or paged) in
place through `CacheView.layout()`. The torch layers in `transformer.py` stay the reference and the
fallback: bf16, GPUs, prefill chunks, `VERISPEC_KERNELS=off`.
"""

from __future__ import annotations


import torch

from verispec import kernels
from verispec.models.kv_cache import CacheView
from verispec.models.quant import Int4Linear, Int6Linear, Int8Linear

MAX_HEAD_DIM = 512            # decoder.c's per-head scratch


class NativeDecoder:
    def __init__(self, model):
        cfg = model.config
        layers = model.model.layers
        self._keep: list[torch.Tensor] = []       # the tensors behind the pointers
        self.weights = (kernels.LayerWeights * len(layers))()
        for record, block in zip(self.weights, layers):
            attn, mlp = block.self_attn, block.mlp
            record.ln1 = self._pointer(block.input_layernorm.weight)
            record.ln2 = self._pointer(block.post_attention_layernorm.weight)
            record.qkv_bias = self._pointer(attn.qkv_proj.bias)
            for field, linear in (("qkv", attn.qkv_proj), ("o", attn.o_proj), ("gu", mlp.gate_up_proj),
                                  ("down", mlp.down_proj)):
                target = getattr(record, field)
                if isinstance(linear, Int4Linear):
                    target.format, target.w = 1, self._pointer(linear.packed)
                    target.scale, target.super = self._pointer(linear.groups), self._pointer(linear.supers)
                elif isinstance(linear, Int6Linear):
                    target.format, target.w = 2, self._pointer(linear.packed)
                    target.scale, target.super = self._pointer(linear.scales), self._pointer(linear.supers)
                else:
                    target.format, target.w = 0, self._pointer(linear.weight)
                    target.scale, target.super = self._pointer(linear.scales), None
        self.dims = kernels.DecoderDims(layers=len(layers), C=cfg.hidden_size, H=cfg.num_heads, Hkv=cfg.num_kv_heads,
                                        D=cfg.head_dim, I=cfg.intermediate_size, eps=cfg.rms_norm_eps,
                                        scale=cfg.head_dim ** -0.5)

    def _pointer(self, tensor: torch.Tensor | None) -> int | None:
        if tensor is None:
            return None
        tensor = tensor.detach().contiguous()
        self._keep.append(tensor)
        return tensor.data_ptr()

    @staticmethod
    def fingerprint(model) -> tuple:
        """Identifies the weights the pointers were read from (a reload or a quantization swap changes it)."""
        # Read on every pass, so through the modules' own tables (a few dict lookups; nn.Module attribute
        # access costs ~10x that): the first and last projections, and the integers (or weight) they hold.
        layers = model._modules["model"]._modules["layers"]._modules
        first = layers[next(iter(layers))]._modules["self_attn"]._modules["qkv_proj"]
        last = layers[next(reversed(layers))]._modules["mlp"]._modules["down_proj"]
        return tuple((id(m), _stored(m).data_ptr()) for m in (first, last))

    @classmethod
    def build(cls, model) -> "NativeDecoder | None":
        """The native pass for this model, or None when it does not qualify (see the module docstring)."""
        cfg = model.config
        if (model.device.type != "cpu" or model.dtype != torch.float32 or not kernels.available()
                or cfg.head_dim > MAX_HEAD_DIM or cfg.num_heads % cfg.num_kv_heads):
            return None
        for block in model.model.layers:
            attn, mlp = block.self_attn, block.mlp
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if not all(isinstance(m, (Int8Linear, Int4Linear, Int6Linear)) for m in linears):
                return None
            if any(m.bias is not None for m in linears[1:]):
                return None
            norms = (block.input_layernorm.weight, block.post_attention_layernorm.weight)
            if any(n.dtype != torch.float32 for n in norms):
                return None
        return cls(model)

    def __call__(self, x: torch.Tensor, rotary, cache: CacheView,
                 keep: torch.Tensor | None = None) -> torch.Tensor | None:
        """x (B, T, C) float32 embeddings at the cache view's positions -> hidden states (B, T, C) before the
        final norm, or None when the cache cannot be read in place (the caller runs the torch layers).
        rotary: the model's `Rotary`, whose angle tables the kernel reads by position.
        keep: the flat rows (b · T + t, ascending) whose states the caller reads, or None for all; only
        those are meaningful in the result (see `Transformer.forward`)."""
        layout = cache.layout()
        if layout is None:
            return None
        x = x.contiguous()
        positions = cache.positions.contiguous()                                # (B, T) int64
        cos, sin = rotary.table(cache.kv_len, positions.device)                 # (P, D) each, P ≥ kv_len
        kernels.decoder(x, self.weights, self.dims, cos, sin, positions, layout, keep)
        return x


def _stored(linear) -> torch.Tensor:
    """The tensor a projection's values live in: the packed formats' integers, else its weight."""
    for table, name in ((linear._buffers, "packed"), (linear._buffers, "weight"), (linear._parameters, "weight")):
        if table.get(name) is not None:
            return table[name]
    raise TypeError(f"{type(linear).__name__} holds no weight")


__all__ = ["NativeDecoder"]
