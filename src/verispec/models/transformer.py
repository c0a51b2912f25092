"""One model family for Qwen2 and Llama: RMSNorm, RoPE, grouped-query attention, SwiGLU, optional QKV bias.

Module names mirror Hugging Face's (`model.layers.N.self_attn.q_proj`, `lm_head`, ...) so a
safetensors checkpoint loads as is and GGUF tensors map onto one naming. Linear layers are plain
`nn.Linear` modules: a quantization handler swaps them without this file knowing.

The model never allocates a cache (DESIGN rule 1): `forward` takes a `CacheView` from the engine.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from verispec import kernels
from verispec.config import ModelConfig
from verispec.loaders.checkpoint import fuse_projections
from verispec.models.kv_cache import CacheView, KVStore, in_place
from verispec.models.native import NativeDecoder


# Passes of at most this many tokens per row (decode, and verify with K <= 64 drafts) attend row by
# row — and, for int8 models on the CPU, run in the native decoder pass.
ROW_EXACT_MAX_T = 65


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


# The smallest cos/sin table: its element count (positions × head_dim) is then a multiple of every
# vector width torch's elementwise kernels use, so no position falls in a scalar remainder loop and a
# position's angles have the same bits whatever size the table has grown to.
ROTARY_TABLE_MIN = 256


class Rotary(nn.Module):
    """RoPE in the rotate-half layout (Hugging Face's; GGUF llama Q/K are un-permuted at load)."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        # Built on the CPU even inside a meta-device context (a model built to be loaded): the meta
        # device's arange is torch's reference implementation, whose first call imports torch._dynamo
        # (~1.5 s of a load). `.to(device)` moves the buffer with the model.
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim))
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)

        self._table: tuple[torch.Tensor, torch.Tensor] | None = None       # cos, sin (P, D) float32

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (B, T) -> cos, sin (B, 1, T, D): rows of `table`; one lookup per pass instead of ~6 ops."""
        cos, sin = self.table(int(positions.max()) + 1 if positions.numel() else 1, positions.device)
        return cos[positions].to(dtype)[:, None], sin[positions].to(dtype)[:, None]

    def table(self, top: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (P, D) float32, contiguous, on device, for every position 0 … P-1 with P ≥ top: a table
        kept between passes and grown (to a power of two) when a position passes its end."""
        if self._table is None or self._table[0].shape[0] < top or self._table[0].device != device:
            size = max(ROTARY_TABLE_MIN, 1 << (top - 1).bit_length())
            self._table = self._angles(torch.arange(size, device=device))
        return self._table

    def _angles(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq      # (P, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)                    # (P, D)
        return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


# Checkpoints name these projections apart; the model holds each group as one linear, so a pass
# makes one matmul call per group. Rows are concatenated in the parts' order.
class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        c, bias = cfg.hidden_size, cfg.attention_bias
        self.split = [self.n_heads * self.head_dim, self.n_kv * self.head_dim, self.n_kv * self.head_dim]
        self.qkv_proj = nn.Linear(c, sum(self.split), bias=bias)            # q, k, v in one matmul
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, c, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: CacheView) -> torch.Tensor:
        b, t, _ = x.shape                                                     # (B, T, C)
        q, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        q = q.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)        # (B, H, T, D)
        k = k.view(b, t, self.n_kv, self.head_dim).transpose(1, 2)           # (B, H_kv, T, D)
        v = v.view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        keys, values = cache.update(self.layer, k, v)                         # (B, H_kv, S, D)
        keys, values = keys.to(q.dtype), values.to(q.dtype)
        gqa = self.n_heads != self.n_kv
        if t <= ROW_EXACT_MAX_T:
            # Decode and verify passes: each query row attends over exactly its own prefix, by the same
            # sequence of operations a one-token decode step uses. A row's result then never depends on
            # how many rows share the pass (K+1 verify vs 1-token decode, batch vs alone).
            out = _attend_rows(q, keys, values, cache, self.head_dim ** -0.5)      # (B, T, H, D)
        else:                                                                 # prefill: one masked call
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=cache.mask, enable_gqa=gqa)
            out = out.transpose(1, 2)                                         # (B, T, H, D)
        return self.o_proj(out.reshape(b, t, self.n_heads * self.head_dim))


def _attend_rows(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, cache: CacheView,
                 scale: float) -> torch.Tensor:
    """q (B, H, T, D), keys/values (B, H_kv, S, D) -> (B, T, H, D): the native kernel on CPU float32,
    else one pair of matmuls per row (GQA without repeating keys: the G query heads that share a KV
    head act as G queries)."""
    if q.device.type == "cpu" and kernels.available():
        out = kernels.attend_rows(q, keys, values, cache.positions, scale)
        if out is not None:
            return out
    b, h, t, d = q.shape
    n_kv = keys.shape[1]
    qg = q.reshape(b, n_kv, h // n_kv, t, d).transpose(2, 3)                 # (B, H_kv, T, G, D)
    out = torch.empty_like(qg)
    for i, row_positions in enumerate(cache.position_lists):
        for j, p in enumerate(row_positions):
            scores = torch.matmul(qg[i, :, j], keys[i, :, : p + 1].transpose(1, 2)) * scale
            out[i, :, j] = torch.matmul(torch.softmax(scores, dim=-1), values[i, :, : p + 1])
    return out.transpose(2, 3).reshape(b, h, t, d).transpose(1, 2)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)                      # (B, T, I) each
        return self.down_proj(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, cache):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if torch.get_default_device().type == "meta":
            # A model built to be loaded: no random init (the meta device's normal_ is torch's reference
            # implementation, whose first call imports torch._dynamo: ~1.8 s of every load).
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                             _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        else:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Transformer(nn.Module):
    """`forward(input_ids, positions, cache) -> hidden`; `logits(hidden, rows)` for chosen rows only."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # Decode, verify and draft passes of an int8 model run in one native call (models/native.py);
        # False keeps every pass in the torch layers below (the reference).
        self.native_pass = True
        self._native: NativeDecoder | None = None
        self._native_key: tuple | None = None                                  # the weights it was built for
        self._sub_heads: dict[tuple, nn.Module] = {}                           # LM heads over truncated vocabularies
        self._last_head: tuple | None = None                                   # (vocab, lm_head, head) of the last call
        # load_state_dict takes checkpoint names (q_proj, …) as well as fused ones.
        self.register_load_state_dict_pre_hook(lambda module, state, prefix, *_: fuse_projections(state, prefix))

    @property
    def dtype(self) -> torch.dtype:
        return self.model.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.norm.weight.device

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: CacheView,
                keep: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions: (B, T) -> hidden states (B, T, C) before the final norm.

        keep: the rows the caller will read, as flat indices b · T + t in ascending order (empty for a
        prefill piece, which only writes the cache), or None for all. Every row's keys and values are
        written either way; the native pass then runs the last layer's o_proj and MLP on the kept rows
        alone (each computed as in a full pass; with none kept, not that layer's attention either), and
        the other rows of the result are meaningless. The torch layers compute every row."""
        if positions.shape != input_ids.shape or input_ids.dim() != 2:
            raise ValueError(f"input_ids {tuple(input_ids.shape)} and positions {tuple(positions.shape)} "
                             "must both be (B, T)")
        x = self.model.embed_tokens(input_ids)                                 # (B, T, C)
        if input_ids.shape[1] <= ROW_EXACT_MAX_T and (native := self._native_decoder()) is not None:
            out = native(x, self.rotary, cache, keep)
            if out is not None:
                return out
        cos, sin = self.rotary(positions, x.dtype)
        for block in self.model.layers:
            x = block(x, cos, sin, cache)
        return x

    @torch.inference_mode()
    def forward_logits(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: CacheView, rows: torch.Tensor,
                       vocab: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward`, `final_states` and `project` as one step: input_ids, positions (B, T); rows (B', R)
        indices into T of the first B' ≤ B batch rows -> (float32 logits (B', R, V), or (B', R, N) over
        `vocab` only; the final-normed states they came from, (B', R, C)). Every row's keys and values are
        written; the last layer's o_proj and MLP run on the rows read alone (see `forward`).

        With a native pass whose embedding table and LM head qualify, the whole of it is one native call
        (kernels/decoder.c's verispec_pass): the same operations as the separate steps, the same bits."""
        if positions.shape != input_ids.shape or input_ids.dim() != 2 or rows.dim() != 2 \
                or rows.shape[0] > input_ids.shape[0]:
            raise ValueError(f"input_ids {tuple(input_ids.shape)} and positions {tuple(positions.shape)} must both "
                             f"be (B, T), rows {tuple(rows.shape)} (B' ≤ B, R)")
        b, t = input_ids.shape
        if t <= ROW_EXACT_MAX_T and (native := self._native_decoder()) is not None:
            head = self.lm_head if vocab is None else self._head_for(vocab)
            out = native.model_pass(input_ids, self.rotary, cache, rows, head)
            if out is not None:
                return out
        offsets = torch.arange(rows.shape[0], device=rows.device)[:, None] * t  # (B', 1)
        keep = torch.unique(rows.to(torch.long) + offsets)                    # ascending flat rows read
        hidden = self(input_ids, positions, cache, keep=None if keep.numel() == b * t else keep)
        states = self.final_states(hidden[: rows.shape[0]], rows)
        return self.project(states, vocab), states

    def exact_pass_rows(self, store: KVStore) -> int | None:
        """The most tokens per row a pass may hold and still compute each row exactly as a one-token
        decode step would (the native pass), or None when passes of every length run the torch layers.
        Prefill in passes of at most this many tokens gives every cached position the same bits however
        the prompt was split: cold, after a prefix-cache hit, or in chunks under load."""
        if not self.runs_native() or not in_place(store):
            return None
        return ROW_EXACT_MAX_T

    def runs_native(self) -> bool:
        """Whether passes of up to ROW_EXACT_MAX_T tokens run the native decoder (kernels/decoder.c)."""
        return self._native_decoder() is not None

    def _native_decoder(self) -> NativeDecoder | None:
        if not self.native_pass:
            return None
        key = NativeDecoder.fingerprint(self)
        if key != self._native_key:                                            # new weights: qualify again
            self._native, self._native_key = NativeDecoder.build(self), key
        return self._native

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor, rows: torch.Tensor, vocab: torch.Tensor | None = None) -> torch.Tensor:
        """hidden (B, T, C), rows (B, R) indices into T -> float32 logits (B, R, V), or (B, R, N) for the
        N token ids in `vocab` only (a truncated draft vocabulary: the LM head reads N rows, not V).

        The final norm and LM head run only on the gathered rows: a verify pass asks for K+1,
        a decode step for 1, a prefill for the last prompt token.
        """
        return self.project(self.final_states(hidden, rows), vocab)

    @torch.inference_mode()
    def final_states(self, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """hidden (B, T, C), rows (B, R) -> the final-normed states the LM head reads, (B, R, C).

        A model with a native pass (as the forward that made `hidden` found it) normalises natively,
        whichever layers made `hidden` (a pure function of each row, so every position's logits keep one
        value), else with the torch norm."""
        if self.native_pass and self._native is not None:
            return kernels.rmsnorm_rows(hidden.contiguous(), rows, self.model.norm.weight, self.model.norm.eps)
        idx = rows[..., None].expand(-1, -1, hidden.shape[-1])                 # (B, R, C)
        return self.model.norm(torch.gather(hidden, 1, idx))

    @torch.inference_mode()
    def project(self, h: torch.Tensor, vocab: torch.Tensor | None = None) -> torch.Tensor:
        """Final-normed states (..., C) -> float32 logits (..., V), or (..., N) over `vocab` only."""
        head = self.lm_head if vocab is None else self._head_for(vocab)
        return head(h).float()

    def _head_for(self, vocab: torch.Tensor) -> nn.Module:
        """The LM head restricted to the rows in vocab (built once per vocabulary)."""
        last = self._last_head
        if last is not None and last[0] is vocab and last[1] is self.lm_head:  # the same tensor as last step
            return last[2]
        key = (hash(vocab.numpy().tobytes()), vocab.numel(), id(self.lm_head))   # by content: engines share it
        head = self._sub_heads.get(key)
        if head is None:
            if len(self._sub_heads) >= 4:                                       # a few vocabularies at most
                self._sub_heads.pop(next(iter(self._sub_heads)))
            head = self._sub_heads[key] = _select_rows(self.lm_head, vocab)
        self._last_head = (vocab, self.lm_head, head)
        return head


def _select_rows(head: nn.Module, vocab: torch.Tensor) -> nn.Module:
    """A linear with only the output rows in vocab: float weights sliced; an int8 or int4 head's
    integers and factors sliced."""
    if hasattr(head, "select_rows"):
        return head.select_rows(vocab)
    weight = head.dequantized() if hasattr(head, "dequantized") else head.weight.detach()
    sub = nn.Linear(weight.shape[1], len(vocab), bias=False, dtype=weight.dtype)
    with torch.no_grad():
        sub.weight.copy_(weight[vocab])
    return sub
