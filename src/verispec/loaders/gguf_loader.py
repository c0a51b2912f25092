"""GGUF → ModelConfig + state dict (Hugging Face names), through the `gguf` package.

Every tensor is validated (name, shape, type, bounds) before any is dequantized, so a truncated
or inconsistent file fails fast with one `InvalidModelFile` naming the file and the problem.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from verispec.config import SUPPORTED_ARCHITECTURES, ModelConfig
from verispec.errors import InvalidModelFile, UnsupportedModel
from verispec.loaders.checkpoint import expected_shapes

try:
    import gguf
    from gguf import GGMLQuantizationType as Q
except ImportError as exc:  # pragma: no cover - a hard dependency
    raise ImportError("verispec needs the 'gguf' package: pip install gguf") from exc

SUPPORTED_TYPES = {
    Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0,
    Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K,
}

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def hf_name(gguf_name: str) -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None for tensors we skip."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    if gguf_name.startswith("blk."):
        _, layer, rest = gguf_name.split(".", 2)
        if rest in _LAYER_NAMES:
            return f"model.layers.{layer}.{_LAYER_NAMES[rest]}"
    return None


def open_reader(path: str | Path) -> "gguf.GGUFReader":
    path = Path(path)
    if not path.is_file():
        raise InvalidModelFile(path, "file does not exist")
    try:
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise InvalidModelFile(path, "not a GGUF file (bad magic)")
        return gguf.GGUFReader(path, "r")
    except InvalidModelFile:
        raise
    except Exception as exc:  # the reader raises assorted errors on truncation/corruption
        raise InvalidModelFile(path, f"cannot parse header ({type(exc).__name__}: {exc})") from None


def field(reader: "gguf.GGUFReader", key: str, default: Any = None) -> Any:
    f = reader.get_field(key)
    if f is None:
        return default
    value = f.contents()
    return value


def read_config(reader: "gguf.GGUFReader", path: Path) -> ModelConfig:
    arch = field(reader, "general.architecture")
    if arch is None:
        raise InvalidModelFile(path, "missing general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModel(
            f"{path}: unsupported architecture {arch!r}; verispec runs {', '.join(SUPPORTED_ARCHITECTURES)}"
        )

    def need(key: str) -> Any:
        value = field(reader, f"{arch}.{key}")
        if value is None:
            raise InvalidModelFile(path, f"missing metadata {arch}.{key}")
        return value

    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise InvalidModelFile(path, "missing tensor token_embd.weight")
    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    vocab = int(tensors["token_embd.weight"].shape[1]) if len(tensors["token_embd.weight"].shape) > 1 else 0
    return ModelConfig(
        architecture=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_layers=int(need("block_count")),
        num_heads=heads,
        num_kv_heads=int(field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(field(reader, f"{arch}.attention.key_length", hidden // heads)),
        max_position_embeddings=int(field(reader, f"{arch}.context_length", 4096)),
        rope_theta=float(field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
    )


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE pairs -> rotate-half halves)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_gguf(path: str | Path, dtype: torch.dtype = torch.float32,
              on_tensor: Callable[[int, int], None] | None = None) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read, validate and dequantize a GGUF model file. Returns (config, HF-named state dict)."""
    path = Path(path)
    reader = open_reader(path)
    cfg = read_config(reader, path)
    want = expected_shapes(cfg)
    file_size = path.stat().st_size

    chosen = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            continue
        if name not in want:
            raise InvalidModelFile(path, f"unexpected tensor {t.name} for a {cfg.num_layers}-layer {cfg.architecture}")
        shape = tuple(int(s) for s in reversed(t.shape.tolist()))
        shape = tuple(s for s in shape if s != 1) if len(want[name]) == 1 else shape
        if shape != want[name]:
            raise InvalidModelFile(path, f"tensor {t.name} has shape {shape}, expected {want[name]}")
        if t.tensor_type not in SUPPORTED_TYPES:
            raise UnsupportedModel(f"{path}: tensor {t.name} uses type {t.tensor_type.name}, which verispec cannot dequantize")
        if t.data_offset + t.n_bytes > file_size:
            raise InvalidModelFile(path, f"tensor {t.name} extends past the end of the file (truncated?)")
        chosen[name] = t
    missing = sorted(set(want) - set(chosen))
    if missing:
        raise InvalidModelFile(path, f"missing {len(missing)} tensor(s), e.g. {missing[0]}")

    state = {}
    for i, (name, t) in enumerate(chosen.items()):
        try:
            w = gguf.quants.dequantize(t.data, t.tensor_type).reshape(want[name])
        except Exception as exc:
            raise InvalidModelFile(path, f"cannot dequantize {t.name} ({type(exc).__name__}: {exc})") from None
        if not np.isfinite(w).all():
            raise InvalidModelFile(path, f"tensor {t.name} holds NaN or infinite values")
        if cfg.architecture == "llama" and ("q_proj" in name or "k_proj" in name):
            w = _unpermute(w, cfg.num_heads if "q_proj" in name else cfg.num_kv_heads)
        state[name] = torch.from_numpy(np.array(w, dtype=np.float32)).to(dtype)
        if on_tensor:
            on_tensor(i + 1, len(chosen))
    return cfg, state
