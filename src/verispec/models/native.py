"""A whole pass in one native call (kernels/decoder.c) for int8, int4 and int6 models on the CPU.

`NativeDecoder.build(model)` says whether a model qualifies — float32 compute, every projection an
`Int8Linear`, `Int4Linear` or `Int6Linear` in the kernels' packed layouts (o, gate/up and down without bias), the
native kernels available — and holds one `LayerWeights` record of tensor pointers per layer. Calling it runs every
decoder layer over a pass of new tokens, reading and writing the engine's cache (static or paged) in
place through `CacheView.layout()`; `model_pass` runs the whole model, token ids to logits, in the same call
where the embedding table (float32 or `Int4Embedding`) and the LM head (one of the three packed formats,
without bias) qualify too. The torch layers in `transformer.py` stay the reference and the fallback: bf16,
GPUs, `VERISPEC_KERNELS=off`.
"""

from __future__ import annotations

import torch
from torch import nn

from verispec import kernels
from verispec.models.kv_cache import CacheView
from verispec.models.quant import Int4Embedding, Int4Linear, Int6Linear, Int8Linear

MAX_HEAD_DIM = 512            # decoder.c's per-head scratch
HEADS_KEPT = 8                # LM heads (the full one and truncated vocabularies) with pointer records


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
                self._fill(getattr(record, field), linear)
        self.dims = kernels.DecoderDims(layers=len(layers), C=cfg.hidden_size, H=cfg.num_heads, Hkv=cfg.num_kv_heads,
                                        D=cfg.head_dim, I=cfg.intermediate_size, eps=cfg.rms_norm_eps,
                                        scale=cfg.head_dim ** -0.5)
        self._ends = self._ends_template(model)   # None: the embedding or the final norm does not qualify
        self._heads: dict[int, tuple[nn.Module, kernels.LinearWeights | None, list]] = {}   # by id(head)

    def _pointer(self, tensor: torch.Tensor | None, keep: list | None = None) -> int | None:
        """The address of a contiguous tensor holding `tensor`'s values, kept alive in `keep` (the
        decoder's own list by default)."""
        if tensor is None:
            return None
        tensor = tensor.detach().contiguous()
        (self._keep if keep is None else keep).append(tensor)
        return tensor.data_ptr()

    def _fill(self, target: kernels.LinearWeights, linear: nn.Module, keep: list | None = None) -> None:
        if isinstance(linear, Int4Linear):
            target.format, target.w = 1, self._pointer(linear.packed, keep)
            target.scale, target.super = self._pointer(linear.groups, keep), self._pointer(linear.supers, keep)
        elif isinstance(linear, Int6Linear):
            target.format, target.w = 2, self._pointer(linear.packed, keep)
            target.scale, target.super = self._pointer(linear.scales, keep), self._pointer(linear.supers, keep)
        else:
            target.format, target.w = 0, self._pointer(linear.weight, keep)
            target.scale, target.super = self._pointer(linear.scales, keep), None

    def _ends_template(self, model) -> kernels.PassEnds | None:
        """The pass's fixed ends (embedding table, final norm), or None when they do not qualify."""
        embed, norm, c = model.model.embed_tokens, model.model.norm, model.config.hidden_size
        ends = kernels.PassEnds()
        if isinstance(embed, Int4Embedding) and embed.embedding_dim == c and c % 32 == 0:
            ends.embed_format, ends.embed_w = 1, self._pointer(embed.packed)
            ends.embed_scale, ends.embed_super = self._pointer(embed.groups), self._pointer(embed.supers)
            ends.vocab = embed.num_embeddings
        elif type(embed) is nn.Embedding and embed.weight.dtype == torch.float32 and embed.embedding_dim == c:
            ends.embed_format, ends.embed_w, ends.vocab = 0, self._pointer(embed.weight), embed.num_embeddings
        else:
            return None
        if norm.weight.dtype != torch.float32 or norm.weight.shape != (c,):
            return None
        ends.norm, ends.norm_eps = self._pointer(norm.weight), norm.eps
        return ends

    def _head(self, head: nn.Module) -> kernels.LinearWeights | None:
        """The pointer record of an LM head (the model's or a truncated vocabulary's), or None when it
        does not qualify (another format, a bias, another input size)."""
        found = self._heads.get(id(head))
        if found is not None and found[0] is head:
            return found[1]
        record, keep = None, []
        if (isinstance(head, (Int8Linear, Int4Linear, Int6Linear)) and head.bias is None
                and head.in_features == self.dims.C):
            record = kernels.LinearWeights()
            self._fill(record, head, keep)
        if len(self._heads) >= HEADS_KEPT:
            self._heads.pop(next(iter(self._heads)))
        self._heads[id(head)] = (head, record, keep)      # the head itself too: its id stays its own
        return record

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
        inputs = _cache_inputs(rotary, cache)
        if inputs is None:
            return None
        x = x.contiguous()
        kernels.decoder(x, self.weights, self.dims, *inputs, keep)
        return x

    def model_pass(self, input_ids: torch.Tensor, rotary, cache: CacheView, rows: torch.Tensor,
                   head: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
        """input_ids (B, T) at the cache view's positions, rows (B', R) indices into T of the first B' batch
        rows, head the LM head (or a truncated vocabulary's) -> (logits (B', R, N), the final-normed states
        they came from (B', R, C)), every row's keys and values written; or None when the ends, the head or
        the cache do not qualify (the caller runs the separate steps). A token id outside the embedding
        table raises IndexError before anything is computed."""
        if self._ends is None or (record := self._head(head)) is None:
            return None
        inputs = _cache_inputs(rotary, cache)
        if inputs is None:
            return None
        bp, r = rows.shape
        ids = input_ids.to(torch.int64).contiguous()                            # (B, T)
        rows = rows.to(torch.int64).contiguous()                                # (B', R)
        states = torch.empty(bp, r, self.dims.C)
        logits = torch.empty(bp, r, head.out_features)
        ends = kernels.PassEnds.from_buffer_copy(self._ends)
        ends.ids, ends.head, ends.N = ids.data_ptr(), record, head.out_features
        ends.rows, ends.Bn, ends.Rn = rows.data_ptr(), bp, r
        ends.states, ends.logits = states.data_ptr(), logits.data_ptr()
        kernels.model_pass(ends, self.weights, self.dims, *inputs)
        return logits, states


def _cache_inputs(rotary, cache: CacheView) -> tuple | None:
    """(cos, sin, positions, layout), a native pass's arguments in the kernels' order: the rotary tables
    (P, D) each with P ≥ kv_len, the positions (B, T) int64 and the cache's layout; None when the cache
    cannot be read in place."""
    layout = cache.layout()
    if layout is None:
        return None
    positions = cache.positions.contiguous()
    return (*rotary.table(cache.kv_len, positions.device), positions, layout)


def _stored(linear) -> torch.Tensor:
    """The tensor a projection's values live in: the packed formats' integers, else its weight."""
    for table, name in ((linear._buffers, "packed"), (linear._buffers, "weight"), (linear._parameters, "weight")):
        if table.get(name) is not None:
            return table[name]
    raise TypeError(f"{type(linear).__name__} holds no weight")


__all__ = ["NativeDecoder"]
