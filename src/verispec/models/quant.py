"""Weight-only quantization as a swapped linear: the model file never sees it (gpt-fast style).

int8: symmetric per-output-channel scales, weights stored int8 in the native kernel's packed layout
(16 output columns per block, k-pair-major; `kernels.pack_int8`). On CPUs with AVX2 + FMA the matmul
runs in verispec's own kernel (verispec/kernels/gemm.c: each activation row rounded to 16-bit
integers with its own scale, integer dot products, each weight read once per pass, row-exact);
elsewhere in `torch.ops.aten._weight_int8pack_mm` with bf16 activations. Everything around the linears (norms, RoPE, attention, residuals) keeps the
model's dtype.

int4 (`--dtype int4`): the GGUF's Q4_K tensors as the file stores them (loaders/gguf_blocks.py):
w = d · sc · q − dmin · m with q in 0 … 15 per weight, 8-bit sc and m per group of 32, fp16 d and dmin
per super-block of 256 — 4.625 bits per weight, the file's weights exactly. Its Q6_K tensors likewise
(`Int6Linear`, kernels/gemm6.c): w = d · sc · (q − 32), q in 0 … 63, an int8 sc per 16 weights, 6.5625
bits per weight. Every other weight (fp16, Q8_0, …) stays int8. The matmul is kernels/gemm4.c: activations rounded to 8 bits per row and group of
32 (as llama.cpp rounds them for its 4-bit formats), integer sums per group, 64 multiply-adds per
vector instruction; without the native kernel the layer dequantizes once and runs in float32.
`Int4Linear.from_linear` quantizes any weight into the same format (round to nearest per group).

int4-all (a draft model's CPU default): every linear in that 4-bit format — the GGUF's Q4_K tensors as
stored, every other weight (Q5_0, Q6_K, Q8_0, fp16, …) rounded to nearest into it by `round_to_q4`.
Not the file's weights exactly, so never a target's format by default; a draft's weights change only
how often its guesses are accepted, never the output (the target verifies every token).
"""

from __future__ import annotations

import torch
from torch import nn

from verispec import kernels
from verispec.loaders.gguf_blocks import GROUP, SUPER, Q4Fields, Q6Fields

WEIGHT_FORMATS = ("float32", "bfloat16", "int8", "int4", "int4-all")


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) float -> int8 (N, K) and per-row scales (N,) float32 with w ≈ q · scale."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-10)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


class Int8Linear(nn.Module):
    """int8 weight (per-channel scales) stored in the native kernel's packed layout."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        q, scale = quantize_int8(linear.weight.detach())
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight", kernels.pack_int8(q))               # (ceil(N/16), ceil(K/2), 32) int8
        self.register_buffer("scales", scale)                               # (N,) float32
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float())
        self._torch_weight: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def empty(cls, linear: nn.Linear) -> "Int8Linear":
        """A shell with the right buffer shapes (for loading cached weights); nothing is computed."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        n, k = linear.out_features, linear.in_features
        self.in_features, self.out_features = k, n
        self.register_buffer("weight", torch.empty(-(-n // kernels.BLOCK), -(-k // 2), 32, dtype=torch.int8))
        self.register_buffer("scales", torch.empty(n))
        self.register_buffer("bias", None if linear.bias is None else torch.empty(n))
        self._torch_weight = None
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape                                                     # (..., K)
        x2 = x.reshape(-1, shape[-1])                                       # (M, K)
        if x2.device.type == "cpu" and kernels.available():
            y = kernels.int8_gemm(x2.float().contiguous(), self.weight, self.scales).to(x.dtype)   # (M, N)
        else:
            if self._torch_weight is None:                                  # torch's kernel: row-major, bf16 scales
                self._torch_weight = (kernels.unpack_int8(self.weight, self.out_features, self.in_features),
                                      self.scales.to(torch.bfloat16))
            y = torch.ops.aten._weight_int8pack_mm(x2.to(torch.bfloat16), *self._torch_weight).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.reshape(*shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        return kernels.unpack_int8(self.weight, self.out_features, self.in_features).float() * self.scales[:, None]

    def select_rows(self, rows: torch.Tensor) -> "Int8Linear":
        """A linear with only the given output rows: the same integers and scales, no float round trip."""
        sub = Int8Linear.__new__(Int8Linear)
        nn.Module.__init__(sub)
        sub.in_features, sub.out_features = self.in_features, len(rows)
        q = kernels.unpack_int8(self.weight, self.out_features, self.in_features)[rows]      # (N', K) int8
        sub.register_buffer("weight", kernels.pack_int8(q))
        sub.register_buffer("scales", self.scales[rows].clone())
        sub.register_buffer("bias", None if self.bias is None else self.bias[rows].clone())
        sub._torch_weight = None
        return sub


def round_to_q4(weight: torch.Tensor) -> Q4Fields:
    """(N, K) float, K a multiple of 32 -> the nearest Q4_K-style fields: per group of 32 the affine grid
    from min(w, 0) to max(w) in 15 steps, its step and minimum rounded to 8-bit multiples of fp16
    factors per super-block of 256, then each weight to its nearest level."""
    n, k = weight.shape
    groups, supers = k // GROUP, -(-k // SUPER)
    w = weight.float().reshape(n, groups, GROUP)
    low = (-w.amin(-1)).clamp_min(0)                                         # (N, G) the minimum, negated
    step = (w.amax(-1) + low) / 15
    pad = lambda v: torch.cat([v, v.new_zeros(n, supers * 8 - groups)], 1).view(n, supers, 8)

    def factor(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:       # v (N, G) >= 0 -> (sc, d)
        d = (pad(v).amax(-1) / 255).to(torch.float16).float()              # (N, S)
        dg = d.repeat_interleave(8, dim=1)[:, :groups]
        mult = torch.where(dg > 0, torch.round(v / dg.clamp_min(1e-30)), torch.zeros_like(v)).clamp(0, 255)
        return mult.to(torch.uint8), d

    sc, d = factor(step)
    m, dmin = factor(low)
    scale = (d.repeat_interleave(8, 1)[:, :groups] * sc.float())[..., None]   # (N, G, 1)
    minimum = (dmin.repeat_interleave(8, 1)[:, :groups] * m.float())[..., None]
    q = torch.where(scale > 0, torch.round((w + minimum) / scale.clamp_min(1e-30)), torch.zeros_like(w))
    return Q4Fields(q.clamp(0, 15).to(torch.uint8).reshape(n, k), sc, m, d, dmin)


def round_to_q6(weight: torch.Tensor) -> Q6Fields:
    """(N, K) float, K a multiple of 16 -> the nearest Q6_K-style fields: per group of 16 a symmetric
    step max|w| / 31 as an int8 multiple of an fp16 factor per super-block of 256, then each weight to
    its nearest level in −32 … 31."""
    n, k = weight.shape
    w = weight.float().reshape(n, k // 16, 16)
    step = w.abs().amax(-1) / 31                                              # (N, K/16)
    supers = -(-k // SUPER)
    padded = torch.cat([step, step.new_zeros(n, supers * 16 - k // 16)], 1).view(n, supers, 16)
    d = (padded.amax(-1) / 127).to(torch.float16).float()                    # (N, S)
    dg = d.repeat_interleave(16, dim=1)[:, : k // 16]
    sc = torch.where(dg > 0, torch.round(step / dg.clamp_min(1e-30)), torch.zeros_like(step)).clamp(-128, 127)
    scale = (dg * sc)[..., None]                                              # (N, K/16, 1)
    q = torch.where(scale != 0, torch.round(w / torch.where(scale != 0, scale, torch.ones_like(scale))),
                    torch.zeros_like(w)).clamp(-32, 31) + 32
    return Q6Fields(q.to(torch.uint8).reshape(n, k), sc.to(torch.int8), d)


class BlockLinear(nn.Module):
    """A linear whose weight is a kernel's packed block layout: three tensors (the packed integers, the
    per-group numbers, the per-super-block factors; their buffer names in FIELDS), each (ceil(N/16), …,
    16) with the output column last, so rows can be selected without unpacking. Subclasses name the
    kernel (`_gemm`) and its inverse (`_unpack`)."""

    FIELDS: tuple[str, str, str]

    def __init__(self, in_features: int, out_features: int, packed: torch.Tensor, middle: torch.Tensor,
                 supers: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        for name, tensor in zip(self.FIELDS, (packed, middle, supers)):
            self.register_buffer(name, tensor)
        self.register_buffer("bias", bias)
        self._dense: torch.Tensor | None = None

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(self, name) for name in self.FIELDS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape                                                     # (..., K)
        x2 = x.reshape(-1, shape[-1]).float().contiguous()                 # (M, K)
        if x2.device.type == "cpu" and kernels.available():
            y = self._gemm(x2, *self.tensors())[:, : self.out_features]    # (M, N)
        else:
            if self._dense is None:
                self._dense = self.dequantized()
            y = x2 @ self._dense.T
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        return self._unpack(*self.tensors(), self.out_features)

    def select_rows(self, rows: torch.Tensor) -> "BlockLinear":
        """A linear with only the given output rows: the same integers, numbers and factors."""
        return type(self)(self.in_features, len(rows), *kernels.select_block_rows(self.tensors(), rows),
                          None if self.bias is None else self.bias[rows].clone())

    @classmethod
    def _shell(cls, linear: nn.Linear, shapes: tuple, dtypes: tuple) -> "BlockLinear":
        """A shell with the right buffer shapes (for loading cached weights); shapes after the block count."""
        blocks = -(-linear.out_features // kernels.BLOCK)
        bias = None if linear.bias is None else torch.empty(linear.out_features)
        return cls(linear.in_features, linear.out_features,
                   *(torch.empty(blocks, *shape, dtype=dtype) for shape, dtype in zip(shapes, dtypes)), bias)


class Int4Linear(BlockLinear):
    """int4 weights in gemm4.c's layout (kernels.pack_int4): packed (ceil(N/16), K/32, 4, 16) int32
    nibbles, groups (ceil(N/16), K/32, 2, 16) uint8 (sc, m), supers (ceil(N/16), ceil(K/256), 2, 16)
    float16 (d, dmin)."""

    FIELDS = ("packed", "groups", "supers")

    @classmethod
    def from_fields(cls, fields: Q4Fields, bias: torch.Tensor | None = None) -> "Int4Linear":
        n, k = fields.shape
        return cls(k, n, *kernels.pack_int4(fields.q, fields.sc, fields.m, fields.d, fields.dmin),
                   None if bias is None else bias.detach().float())

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Int4Linear":
        """Quantize any weight (K a multiple of 32) into the format by rounding (`round_to_q4`)."""
        if linear.in_features % GROUP:
            raise ValueError(f"int4 needs the input size to be a multiple of {GROUP}, not {linear.in_features}")
        return cls.from_fields(round_to_q4(linear.weight.detach()), linear.bias)

    @classmethod
    def empty(cls, linear: nn.Linear) -> "Int4Linear":
        k, b = linear.in_features, kernels.BLOCK
        return cls._shell(linear, ((k // GROUP, 4, b), (k // GROUP, 2, b), (-(-k // SUPER), 2, b)),
                          (torch.int32, torch.uint8, torch.float16))

    @staticmethod
    def _gemm(x, packed, groups, supers):
        return kernels.int4_gemm(x, packed, groups, supers)

    @staticmethod
    def _unpack(packed, groups, supers, n):
        return kernels.unpack_int4(packed, groups, supers, n)


class Int6Linear(BlockLinear):
    """int6 weights as Q6_K stores them, in gemm6.c's layout (kernels.pack_int6): packed (ceil(N/16), K/32,
    6, 16) int32 words, scales (ceil(N/16), K/32, 2, 16) int8, supers (ceil(N/16), ceil(K/256), 16) float16."""

    FIELDS = ("packed", "scales", "supers")

    @classmethod
    def from_fields(cls, fields: Q6Fields, bias: torch.Tensor | None = None) -> "Int6Linear":
        n, k = fields.shape
        return cls(k, n, *kernels.pack_int6(fields.q, fields.sc, fields.d), None if bias is None else bias.detach().float())

    @classmethod
    def empty(cls, linear: nn.Linear) -> "Int6Linear":
        k, b = linear.in_features, kernels.BLOCK
        return cls._shell(linear, ((k // GROUP, 6, b), (k // GROUP, 2, b), (-(-k // SUPER), b)),
                          (torch.int32, torch.int8, torch.float16))

    @staticmethod
    def _gemm(x, packed, scales, supers):
        return kernels.int6_gemm(x, packed, scales, supers)

    @staticmethod
    def _unpack(packed, scales, supers, n):
        return kernels.unpack_int6(packed, scales, supers, n)


class Int4Embedding(nn.Module):
    """Token embeddings in gemm4.c's layout (as Int4Linear's buffers, one row per token): a lookup
    dequantizes only the rows it reads, to exactly the float32 values `dequantized()` gives. The 1.5B's
    Q4_K embeddings take 0.13 GB this way instead of 0.93 GB in float32."""

    def __init__(self, num_embeddings: int, embedding_dim: int, packed: torch.Tensor, groups: torch.Tensor,
                 supers: torch.Tensor):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.register_buffer("packed", packed)
        self.register_buffer("groups", groups)
        self.register_buffer("supers", supers)

    @classmethod
    def from_fields(cls, fields: Q4Fields) -> "Int4Embedding":
        v, c = fields.shape
        return cls(v, c, *kernels.pack_int4(fields.q, fields.sc, fields.m, fields.d, fields.dmin))

    @classmethod
    def empty(cls, embedding: nn.Embedding) -> "Int4Embedding":
        shell = Int4Linear.empty(nn.Linear(embedding.embedding_dim, embedding.num_embeddings, bias=False,
                                           device="meta"))
        return cls(embedding.num_embeddings, embedding.embedding_dim, shell.packed, shell.groups, shell.supers)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (...) -> (..., C) float32."""
        return kernels.int4_rows(self.packed, self.groups, self.supers, ids.cpu()).to(ids.device)

    def dequantized(self) -> torch.Tensor:
        return kernels.unpack_int4(self.packed, self.groups, self.supers, self.num_embeddings)


def _file_fields(fields: dict | None, name: str, weight: torch.Tensor, kinds=(Q4Fields,)) -> Q4Fields | Q6Fields | None:
    """The file's block fields (of one of `kinds`) for a weight, checked against the weight the model
    holds (the first rows dequantize to it exactly), or None when the file has none of those for it."""
    found = fields.get(name) if fields is not None else None
    if not isinstance(found, kinds):
        return None
    first = type(found)(*(getattr(found, f)[:16] for f in found.__dataclass_fields__))
    if found.shape != tuple(weight.shape) or not torch.equal(first.dequantized(), weight.detach()[:16].float()):
        raise ValueError(f"{name}: the file's block-quantized weight {found.shape} is not the model's "
                         f"{tuple(weight.shape)} weight")
    return found


def quantize_linears(model: nn.Module, fmt: str, state: dict | None = None, prefix: str = "",
                     fields: dict[str, Q4Fields] | None = None) -> nn.Module:
    """Swap every nn.Linear (the LM head included) for its quantized form, in place.

    int4 puts a linear in int4 where `fields` (the file's Q4_K and Q6_K tensors, `gguf_blocks.block_fields`)
    holds it as Q4_K, in int6 where it holds it as Q6_K, and in int8 elsewhere; int4-all puts every linear
    in int4, rounding those the file does not hold as Q4_K (where the input size is a multiple of 32; see
    the module docstring). Both keep the token embeddings in int4 the same way
    (`Int4Embedding`; int4 only where the file's are Q4_K, else they stay float). With `state` (a saved
    quantized state dict) the layers are built as empty shells in the saved layout instead."""
    if fmt not in ("int8", "int4", "int4-all"):
        raise ValueError(f"unknown weight format {fmt!r}; choose one of {', '.join(WEIGHT_FORMATS)}")
    four = fmt in ("int4", "int4-all")
    for name, child in list(model.named_children()):
        full = f"{prefix}{name}"
        if isinstance(child, nn.Linear):
            layer, kinds = None, (Q4Fields, Q6Fields) if fmt == "int4" else (Q4Fields,)
            if four and state is not None:
                saved = state.get(f"{full}.packed")
                layer = None if saved is None else (Int6Linear if saved.shape[2] == 6 else Int4Linear).empty(child)
            elif four and (found := _file_fields(fields, f"{full}.weight", child.weight, kinds)) is not None:
                layer = (Int6Linear if isinstance(found, Q6Fields) else Int4Linear).from_fields(found, child.bias)
            elif fmt == "int4-all" and child.in_features % GROUP == 0:
                layer = Int4Linear.from_linear(child)
            int8 = Int8Linear.empty if state is not None else Int8Linear
            setattr(model, name, layer if layer is not None else int8(child))
        elif isinstance(child, nn.Embedding) and four and child.embedding_dim % GROUP == 0:
            if state is not None:
                table = Int4Embedding.empty(child) if f"{full}.packed" in state else None
            elif (found := _file_fields(fields, f"{full}.weight", child.weight)) is not None:
                table = Int4Embedding.from_fields(found)
            else:
                table = Int4Embedding.from_fields(round_to_q4(child.weight.detach())) if fmt == "int4-all" else None
            if table is not None:
                setattr(model, name, table)
        else:
            quantize_linears(child, fmt, state, f"{full}.", fields)
    return model
