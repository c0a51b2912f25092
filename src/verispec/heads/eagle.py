"""EAGLE-style head: one decoder layer that predicts the target's next hidden state.

Where a Medusa head guesses a token two places ahead without knowing the one in between, this head
reads the pair the target has just settled — its final-normed state h_t at the row that scored the
pending token, and the pending token x_{t+1} itself — and predicts the state the target will have
one position later:

    u_t = W_fc [h_t ; E(x_{t+1})] + b_fc          h_t, u_t: (C,); E: the target's own embeddings
    ĥ_{t+1} = Layer(u_{≤t})                         one pre-norm decoder layer (attention + SwiGLU)
    q = softmax(E_N ĥ_{t+1})                        E_N: the target's LM head over N tokens

Drafting runs it autoregressively: the drafted token x̃ and ĥ_{t+1} form the next pair. The layer
attends over the last W settled pairs of the sequence (the round keeps the target's states of
every accepted row, `Sequence.recent_states`) and over the round's own drafted rows, with RoPE on
positions within that window — a small cache rebuilt each round, so nothing is rolled back.

Lossless like any draft: each x̃_i is drawn from the q_i it reports, given the drafts before it.

File format (safetensors, validated before use): the layer's weights in float16/bfloat16/float32
(names and shapes in `EagleHead.shapes`) and `vocab` (N,) int64 sorted token ids; metadata `kind` =
"eagle", `hidden_size`, `num_heads`, `num_kv_heads`, `head_dim`, `intermediate_size`, `window`,
`depth`, `rope_theta`, `rms_norm_eps`, `vocab_size`, and free-form `target`, `command`, `heldout`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from verispec.errors import InvalidModelFile

MAX_DEPTH = 16          # most drafts per round
MAX_WINDOW = 64         # most settled pairs a draft attends over

_DIMS = ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size", "window", "depth")


class EagleHead(nn.Module):
    """fc over [state ; embedding], one decoder layer, the target's LM head over `vocab`."""

    kind = "eagle"

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 intermediate_size: int, vocab: torch.Tensor, window: int = 16, depth: int = 6,
                 rope_theta: float = 10000.0, rms_norm_eps: float = 1e-6, meta: dict | None = None):
        super().__init__()
        c = hidden_size
        self.dims = dict(hidden_size=c, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                         intermediate_size=intermediate_size, window=window, depth=depth)
        self.rope_theta, self.eps = float(rope_theta), float(rms_norm_eps)
        self.fc = nn.Linear(2 * c, c, bias=True)                                     # [h ; e] -> u
        self.norm1 = nn.Parameter(torch.ones(c))
        self.qkv = nn.Linear(c, (num_heads + 2 * num_kv_heads) * head_dim, bias=True)
        self.o = nn.Linear(num_heads * head_dim, c, bias=False)
        self.norm2 = nn.Parameter(torch.ones(c))
        self.gate_up = nn.Linear(c, 2 * intermediate_size, bias=False)
        self.down = nn.Linear(intermediate_size, c, bias=False)
        self.register_buffer("vocab", vocab.to(torch.long), persistent=False)      # (N,)
        inv = 1.0 / (self.rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        self.register_buffer("inv_freq", inv.float(), persistent=False)             # (D/2,)
        self.meta = dict(meta or {})

    @property
    def depth(self) -> int:
        """Most drafts per round."""
        return self.dims["depth"]

    @property
    def window(self) -> int:
        """Settled (state, next token) pairs a draft attends over."""
        return self.dims["window"]

    @staticmethod
    def shapes(d: dict) -> dict[str, tuple[int, ...]]:
        c, h, kv, hd, i = (d[k] for k in _DIMS[:5])
        return {"fc.weight": (c, 2 * c), "fc.bias": (c,), "norm1": (c,), "qkv.weight": ((h + 2 * kv) * hd, c),
                "qkv.bias": ((h + 2 * kv) * hd,), "o.weight": (c, h * hd), "norm2": (c,),
                "gate_up.weight": (2 * i, c), "down.weight": (c, i)}

    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))

    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """x (B, H, T, D) rotated by positions pos (B, T) (rotate-half layout)."""
        freqs = pos[..., None].float() * self.inv_freq                               # (B, T, D/2)
        cos, sin = freqs.cos()[:, None], freqs.sin()[:, None]                        # (B, 1, T, D/2)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def forward(self, h: torch.Tensor, e: torch.Tensor, pos: torch.Tensor, past: tuple | None = None,
                mask: torch.Tensor | None = None, last_only: bool = False
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """h, e (B, T, C): states and the embeddings of the tokens after them; pos (B, T) their positions
        in the window. past: keys and values (B, KV, P, D) of earlier rows; mask (B, T, P + T) bool, True
        where a row may attend (default: all of past, causal over the new rows).
        Returns ĥ (B, T, C), the predicted next states, and the keys and values (B, KV, P + T, D).
        last_only: every row gives its keys and values, only the last its ĥ (B, 1, C) — drafting needs
        no prediction for the settled rows before it, and skips their attention and feed-forward."""
        b, t, _ = h.shape
        nh, nkv, hd = self.dims["num_heads"], self.dims["num_kv_heads"], self.dims["head_dim"]
        u = self.fc(torch.cat([h, e], dim=-1))                                       # (B, T, C)
        q, k, v = self.qkv(self._norm(u, self.norm1)).split([nh * hd, nkv * hd, nkv * hd], dim=-1)
        q = self._rope(q.view(b, t, nh, hd).transpose(1, 2), pos)                    # (B, H, T, D)
        k = self._rope(k.view(b, t, nkv, hd).transpose(1, 2), pos)                   # (B, KV, T, D)
        v = v.view(b, t, nkv, hd).transpose(1, 2)
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)    # (B, KV, P+T, D)
        p = k.shape[2] - t
        if mask is None:
            mask = torch.ones(t, p + t, dtype=torch.bool).tril(p)[None].expand(b, -1, -1)
        if last_only:
            q, u, mask, t = q[:, :, -1:], u[:, -1:], mask[:, -1:], 1
        rep = nh // nkv
        att = torch.einsum("bhtd,bhsd->bhts", q, k.repeat_interleave(rep, dim=1)) / math.sqrt(hd)
        att = att.masked_fill(~mask[:, None], float("-inf")).softmax(-1)             # (B, H, T, P+T)
        y = torch.einsum("bhts,bhsd->bhtd", att, v.repeat_interleave(rep, dim=1))    # (B, H, T, D)
        u = u + self.o(y.transpose(1, 2).reshape(b, t, nh * hd))
        gate, up = self.gate_up(self._norm(u, self.norm2)).chunk(2, dim=-1)
        return u + self.down(F.silu(gate) * up), (k, v)

    def quantize(self) -> "EagleHead":
        """Its linears as int8 (the native row kernels) for drafting: a quarter of the float32 bytes."""
        from verispec import kernels
        from verispec.models.quant import Int8Linear

        if kernels.available():
            for name in ("fc", "qkv", "o", "gate_up", "down"):
                if type(getattr(self, name)) is nn.Linear:
                    setattr(self, name, Int8Linear(getattr(self, name)))
        return self


def save_head(head: EagleHead, path: str | Path, dtype: torch.dtype = torch.float16) -> None:

    from verispec.cache import atomic_file, save_tensors

    meta = {"kind": "eagle", **{k: str(v) for k, v in head.dims.items()}, "rope_theta": repr(head.rope_theta),
            "rms_norm_eps": repr(head.eps),
            **{k: v if isinstance(v, str) else json.dumps(v) for k, v in head.meta.items()}}
    state = {k: v for k, v in head.state_dict().items()}
    tensors = {k: state[k].detach().to(dtype).contiguous() for k in EagleHead.shapes(head.dims)}
    tensors["vocab"] = head.vocab.contiguous()
    with atomic_file(Path(path)) as tmp:
        save_tensors(tensors, tmp, metadata=meta)


def load_head(path: Path, meta: dict, names: set[str], f, hidden_size: int, vocab_size: int) -> EagleHead:
    """Check and read an open EAGLE heads file (safe_open handle f) against the target (InvalidModelFile)."""
    try:
        dims = {k: int(meta[k]) for k in _DIMS}
        theta, eps = float(meta["rope_theta"]), float(meta["rms_norm_eps"])
    except (KeyError, ValueError):
        raise InvalidModelFile(path, f"metadata must give integers {', '.join(_DIMS)} and rope_theta, "
                                     "rms_norm_eps") from None
    if dims["hidden_size"] != hidden_size:
        raise InvalidModelFile(path, f"made for hidden size {dims['hidden_size']}, but the target's is {hidden_size}")
    if (min(dims.values()) < 1 or dims["num_heads"] % dims["num_kv_heads"] or dims["head_dim"] % 2
            or dims["depth"] > MAX_DEPTH or dims["window"] > MAX_WINDOW or not (theta > 0 and eps > 0)
            or max(dims.values()) > 1 << 16):
        raise InvalidModelFile(path, f"dimensions {dims} (rope_theta {theta}, eps {eps}) are not a decoder layer "
                                     f"this head can run (depth ≤ {MAX_DEPTH}, window ≤ {MAX_WINDOW})")
    shapes = EagleHead.shapes(dims)
    if names != set(shapes) | {"vocab"}:
        raise InvalidModelFile(path, f"expected tensors {sorted(set(shapes) | {'vocab'})}, found {sorted(names)}")
    for name, shape in shapes.items():
        got = tuple(f.get_slice(name).get_shape())
        if got != shape:
            raise InvalidModelFile(path, f"{name} has shape {got}, expected {shape}")
    vshape = tuple(f.get_slice("vocab").get_shape())
    if len(vshape) != 1 or not 1 <= vshape[0] <= vocab_size:
        raise InvalidModelFile(path, f"vocab of shape {vshape} is not 1 … {vocab_size} token ids")
    tensors = {name: f.get_tensor(name) for name in names}
    vocab = tensors.pop("vocab")
    if vocab.dtype != torch.int64 or any(not t.is_floating_point() for t in tensors.values()):
        raise InvalidModelFile(path, "weights must be floating point and vocab int64")
    if not all(torch.isfinite(t).all() for t in tensors.values()):
        raise InvalidModelFile(path, "a weight holds NaN or infinite values")
    if int(vocab.min()) < 0 or int(vocab.max()) >= vocab_size or not bool((vocab[1:] > vocab[:-1]).all()):
        raise InvalidModelFile(path, f"vocab must be distinct token ids in [0, {vocab_size}), sorted")
    info = {k: v for k, v in meta.items() if k not in (*_DIMS, "kind", "rope_theta", "rms_norm_eps")}
    head = EagleHead(**dims, vocab=vocab, rope_theta=theta, rms_norm_eps=eps, meta=info)
    head.load_state_dict({k: v.float() for k, v in tensors.items()})
    head.requires_grad_(False)
    return head
