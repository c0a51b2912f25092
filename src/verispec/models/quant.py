"""Weight-only quantization as a swapped linear: the model file never sees it (gpt-fast style).

int8: symmetric per-output-channel scales, weights stored int8 in the native kernel's packed layout
(16 output columns per block, k-pair-major; `kernels.pack_int8`). On CPUs with AVX2 + FMA the matmul
runs in verispec's own kernel (verispec/kernels/gemm.c: each activation row rounded to 16-bit
integers with its own scale, integer dot products, each weight read once per pass, row-exact);
elsewhere in `torch.ops.aten._weight_int8pack_mm` with bf16 activations. Everything around the linears (norms, RoPE, attention, residuals) keeps the
model's dtype.

int4 (`--dtype int4`): groups of 32 along K with a scale and a minimum each, w = min + q · scale,
q in 0..15 — an affine 16-level grid per group, which is exactly how Q4_K GGUF weights are stored.
A weight is put in int4 only when every group already lies on such a grid (a Q4_K tensor); any
other weight (Q6_K, fp16, …) stays int8. Scales and minimums are kept in fp16 (5 bits per weight in
all: a decode step reads ~60 % of int8's bytes), which moves a weight by at most ~0.4 % of its
group's step against the file. The matmul is kernels/gemm4.c: activations rounded to 8 bits per row
and group of 32 (as llama.cpp rounds them for its 4-bit formats), integer sums per group, 64
multiply-adds per vector instruction; without the native kernel the layer dequantizes once and runs
in float32.
"""

from __future__ import annotations

import torch
from torch import nn

from verispec import kernels

WEIGHT_FORMATS = ("float32", "bfloat16", "int8", "int4")
GROUP = 32


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


def quantize_int4(weight: torch.Tensor, tol: float = 1e-3) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(N, K) float -> q (N, K) uint8 in 0 … 15, scales and mins (N, K/32) float32 with w = min + q · scale,
    or None when some group of 32 is not (within tol of its step) on a 16-level affine grid, or
    K % 32 != 0.

    A group's step is its smallest gap between distinct values divided by the smallest j = 1, 2, …
    that explains every value: a group whose levels are, say, 0, 2 and 5 steps apart has gaps of 2
    and 3 steps and a step of gap / 2. Exact for groups that came from a 4-bit affine format,
    whichever levels they use."""
    n, k = weight.shape
    if k % GROUP:
        return None
    w = weight.float().reshape(n, k // GROUP, GROUP)                        # (N, G, 32)
    lo = w.amin(-1, keepdim=True)
    span = w.amax(-1, keepdim=True) - lo
    gaps = torch.diff(torch.sort(w, dim=-1).values, dim=-1)                  # (N, G, 31)
    gaps = torch.where(gaps > 1e-6 * span.clamp_min(1e-30), gaps, torch.full_like(gaps, float("inf")))
    gap = gaps.amin(-1, keepdim=True)
    gap = torch.where(torch.isfinite(gap), gap, torch.ones_like(gap))      # constant groups: any step
    step = torch.empty_like(gap)
    todo = torch.ones_like(gap, dtype=torch.bool)[..., 0]                    # (N, G) groups still unexplained
    for j in range(1, 16):
        idx = todo.nonzero(as_tuple=True)
        if not idx[0].numel():
            break
        cand = gap[idx] / j                                                  # (T, 1)
        q = torch.round((w[idx] - lo[idx]) / cand)
        fits = (q.amax(-1) <= 15) & ((lo[idx] + q * cand - w[idx]).abs() <= tol * cand).all(-1)
        step[idx[0][fits], idx[1][fits]] = cand[fits]
        todo[idx[0][fits], idx[1][fits]] = False
    if todo.any():
        return None
    q = torch.round((w - lo) / step).to(torch.uint8).reshape(n, k)
    return q, step[..., 0].contiguous(), lo[..., 0].contiguous()


class Int4Linear(nn.Module):
    """int4 weights in gemm4.c's layout (kernels.pack_int4): packed (ceil(N/16), K/32, 4, 16) int32,
    scales and mins (ceil(N/16), K/32, 16) float16."""

    def __init__(self, in_features: int, out_features: int, packed: torch.Tensor, scales: torch.Tensor,
                 mins: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("packed", packed)
        self.register_buffer("scales", scales)
        self.register_buffer("mins", mins)
        self.register_buffer("bias", bias)
        self._dense: torch.Tensor | None = None

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Int4Linear | None":
        found = quantize_int4(linear.weight.detach())
        if found is None:
            return None
        q, step, low = found                                                # (N, K) 0 … 15; (N, K/32) twice
        bias = None if linear.bias is None else linear.bias.detach().float()
        return cls(linear.in_features, linear.out_features, *kernels.pack_int4(q, step, low), bias)

    @classmethod
    def empty(cls, linear: nn.Linear) -> "Int4Linear":
        """A shell with the right buffer shapes (for loading cached weights)."""
        n, k = linear.out_features, linear.in_features
        blocks = -(-n // kernels.BLOCK)
        bias = None if linear.bias is None else torch.empty(n)
        return cls(k, n, torch.empty(blocks, k // GROUP, 4, kernels.BLOCK, dtype=torch.int32),
                   torch.empty(blocks, k // GROUP, kernels.BLOCK, dtype=torch.float16),
                   torch.empty(blocks, k // GROUP, kernels.BLOCK, dtype=torch.float16), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape                                                     # (..., K)
        x2 = x.reshape(-1, shape[-1]).float().contiguous()                 # (M, K)
        if x2.device.type == "cpu" and kernels.available():
            y = kernels.int4_gemm(x2, self.packed, self.scales, self.mins)[:, : self.out_features]   # (M, N)
        else:
            if self._dense is None:
                self._dense = self.dequantized()
            y = x2 @ self._dense.T
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        return kernels.unpack_int4(self.packed, self.scales, self.mins, self.out_features)


def quantize_linears(model: nn.Module, fmt: str, state: dict | None = None, prefix: str = "") -> nn.Module:
    """Swap every nn.Linear (the LM head included) for its quantized form, in place.

    int4 falls back to int8 per layer (see the module docstring). With `state` (a saved quantized
    state dict) the layers are built as empty shells in the saved layout instead."""
    if fmt not in ("int8", "int4"):
        raise ValueError(f"unknown weight format {fmt!r}; choose one of {', '.join(WEIGHT_FORMATS)}")
    for name, child in list(model.named_children()):
        full = f"{prefix}{name}"
        if isinstance(child, nn.Linear):
            layer = None
            if fmt == "int4":
                if state is not None:
                    layer = Int4Linear.empty(child) if f"{full}.packed" in state else None
                else:
                    layer = Int4Linear.from_linear(child)
            setattr(model, name, layer if layer is not None else Int8Linear(child))
        else:
            quantize_linears(child, fmt, state, f"{full}.")
    return model
