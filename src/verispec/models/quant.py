"""Weight-only quantization as a swapped linear: the model file never sees it (gpt-fast style).

int8: symmetric per-output-channel scales, weights stored as int8 (N, K). On CPUs with AVX2 + FMA
the matmul runs in verispec's own small-M kernel (verispec/kernels/int8_gemm.c: fp32 activations,
weights read once per group of rows, row-exact); elsewhere in `torch.ops.aten._weight_int8pack_mm`
with bf16 activations. Everything around the linears (norms, RoPE, attention, residuals) keeps the
model's dtype.
"""

from __future__ import annotations

import torch
from torch import nn

from verispec.kernels import int8_gemm, int8_gemm_available

WEIGHT_FORMATS = ("float32", "bfloat16", "int8")


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) float -> int8 (N, K) and per-row scales (N,) float32 with w ≈ q · scale."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-10)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


class Int8Linear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        q, scale = quantize_int8(linear.weight.detach())
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight", q)                                   # (N, K) int8
        self.register_buffer("scales", scale.to(torch.bfloat16))           # (N,)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float())
        self._scales_f32: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape                                                     # (..., K)
        x2 = x.reshape(-1, shape[-1])                                       # (M, K)
        if x2.device.type == "cpu" and int8_gemm_available():
            if self._scales_f32 is None:
                self._scales_f32 = self.scales.float().contiguous()
            y = int8_gemm(x2.float().contiguous(), self.weight, self._scales_f32).to(x.dtype)   # (M, N)
        else:
            y = torch.ops.aten._weight_int8pack_mm(x2.to(torch.bfloat16), self.weight, self.scales).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.reshape(*shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        return self.weight.float() * self.scales.float()[:, None]


def quantize_linears(model: nn.Module, fmt: str) -> nn.Module:
    """Swap every nn.Linear (the LM head included) for its quantized form, in place."""
    if fmt != "int8":
        raise ValueError(f"unknown weight format {fmt!r}; choose one of {', '.join(WEIGHT_FORMATS)}")
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear):
            setattr(model, name, Int8Linear(child))
        else:
            quantize_linears(child, fmt)
    return model
