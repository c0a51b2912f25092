"""Medusa heads: one residual block per future position on the target's last hidden state.

After a round, the target's final-normed hidden state h at the row that produced the bonus token
x_{t+1} already holds most of what comes next. Head i (i = 1 … H) maps it to a guess at x_{t+1+i}:

    g_i = h + SiLU(W_i h + b_i)            h, g_i: (C,)
    q_i = softmax(E_N g_i)                 E_N: the target's own LM head, N rows (a truncated vocabulary)

so a round's H drafts cost H small matrix-vector products and one LM-head pass over H rows of N
tokens — a few per cent of a target pass. The heads never see each other's guesses (Medusa-1), which
is what makes them cheap; the acceptance rule does not care how q was made, so verification stays
exact (q is zero off the N tokens, and a rejection recovers from max(0, p − q) as for any draft).

File format (safetensors, validated before use): `weight` (H, C, C) and `bias` (H, C) in float32
or float16/bfloat16, `vocab` (N,) int64 token ids, sorted and distinct; metadata `kind` = "medusa",
`hidden_size`, `vocab_size` (the target's), and free-form `target`, `command`, `heldout`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from verispec.errors import InvalidModelFile

MAX_HEADS = 16


class MedusaHeads(nn.Module):
    """H residual blocks over C-wide hidden states, and the N-token vocabulary they score."""

    def __init__(self, num_heads: int, hidden_size: int, vocab: torch.Tensor, meta: dict | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_heads, hidden_size, hidden_size))   # (H, C_out, C_in)
        self.bias = nn.Parameter(torch.zeros(num_heads, hidden_size))                    # (H, C)
        self.register_buffer("vocab", vocab.to(torch.long), persistent=False)           # (N,)
        self.meta = dict(meta or {})

    kind = "medusa"

    @property
    def num_heads(self) -> int:
        return self.weight.shape[0]

    @property
    def depth(self) -> int:
        """Most drafts per round: one per head."""
        return self.weight.shape[0]

    def forward(self, h: torch.Tensor, heads: int | None = None) -> torch.Tensor:
        """h (B, C) final-normed target states -> (B, H', C) states for the LM head, one per future
        position, from the first H' = heads (default all) heads: a round drafting K tokens reads only
        K heads' weights."""
        n = self.num_heads if heads is None else heads
        z = torch.einsum("bc,hdc->bhd", h, self.weight[:n]) + self.bias[:n]         # (B, H', C)
        return h[:, None, :] + F.silu(z)


def save_heads(heads: MedusaHeads, path: str | Path, dtype: torch.dtype = torch.float16) -> None:

    from verispec.cache import atomic_file, save_tensors

    meta = {"kind": "medusa", "hidden_size": str(heads.weight.shape[1]),
            **{k: v if isinstance(v, str) else json.dumps(v) for k, v in heads.meta.items()}}
    tensors = {"weight": heads.weight.detach().to(dtype).contiguous(), "bias": heads.bias.detach().to(dtype).contiguous(),
               "vocab": heads.vocab.contiguous()}
    with atomic_file(Path(path)) as tmp:
        save_tensors(tensors, tmp, metadata=meta)


def load_medusa(path: Path, meta: dict, names: set[str], f, hidden_size: int, vocab_size: int) -> MedusaHeads:
    """Check and read an open Medusa heads file (safe_open handle f) against the target (InvalidModelFile)."""
    if names != {"weight", "bias", "vocab"}:
        raise InvalidModelFile(path, f"expected tensors weight, bias and vocab, found {sorted(names)}")
    shapes = {n: tuple(f.get_slice(n).get_shape()) for n in names}
    h, c = shapes["weight"][:2] if len(shapes["weight"]) == 3 else (0, 0)
    if shapes["weight"] != (h, c, c) or not 1 <= h <= MAX_HEADS or shapes["bias"] != (h, c):
        raise InvalidModelFile(path, f"weight {shapes['weight']} and bias {shapes['bias']} are not "
                               f"(H, C, C) and (H, C) with 1 ≤ H ≤ {MAX_HEADS}")
    if c != hidden_size:
        raise InvalidModelFile(path, f"made for hidden size {c}, but the target's is {hidden_size}")
    if len(shapes["vocab"]) != 1 or not 1 <= shapes["vocab"][0] <= vocab_size:
        raise InvalidModelFile(path, f"vocab of shape {shapes['vocab']} is not 1 … {vocab_size} token ids")
    weight, bias, vocab = f.get_tensor("weight"), f.get_tensor("bias"), f.get_tensor("vocab")
    if not weight.is_floating_point() or not bias.is_floating_point() or vocab.dtype != torch.int64:
        raise InvalidModelFile(path, "weight and bias must be floating point and vocab int64")
    if not (torch.isfinite(weight).all() and torch.isfinite(bias).all()):
        raise InvalidModelFile(path, "weight or bias holds NaN or infinite values")
    if vocab.numel() and (int(vocab.min()) < 0 or int(vocab.max()) >= vocab_size
                          or not bool((vocab[1:] > vocab[:-1]).all())):
        raise InvalidModelFile(path, f"vocab must be distinct token ids in [0, {vocab_size}), sorted")
    info = {k: v for k, v in meta.items() if k not in ("kind", "hidden_size")}
    heads = MedusaHeads(h, c, vocab, info)
    with torch.no_grad():
        heads.weight.copy_(weight.float())
        heads.bias.copy_(bias.float())
    heads.requires_grad_(False)
    return heads
