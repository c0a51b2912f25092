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
from verispec.loaders.gguf_header import check_header

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
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{int(parts[1])}.{_LAYER_NAMES[parts[2]]}"
    return None


def open_reader(path: str | Path) -> "gguf.GGUFReader":
    path = Path(path)
    if not path.is_file():
        raise InvalidModelFile(path, "file does not exist")
    try:
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise InvalidModelFile(path, "not a GGUF file (bad magic)")
        check_header(path)                       # bounded: never hand the parser counts the file cannot hold
        return gguf.GGUFReader(path, "r")
    except InvalidModelFile:
        raise
    except Exception as exc:  # the reader raises assorted errors on truncation/corruption
        raise InvalidModelFile(path, f"cannot parse header ({type(exc).__name__}: {exc})") from None


def field(reader: "gguf.GGUFReader", key: str, default: Any = None) -> Any:
    f = reader.get_field(key)
    if f is None:
        return default
    try:
        return f.contents()
    except Exception:                            # invalid UTF-8 and other undecodable values
        return _Undecodable(key)


class _Undecodable:
    def __init__(self, key: str):
        self.key = key


def _integer(value: Any, key: str, path: Path, lo: int, hi: int) -> int:
    """A metadata value that must be an integer in [lo, hi] (not a bool, string, float or NaN)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not lo <= int(value) <= hi:
        raise InvalidModelFile(path, f"metadata {key} must be an integer in {lo} … {hi}, got {_show(value)}")
    return int(value)


def _real(value: Any, key: str, path: Path, lo: float, hi: float) -> float:
    """A metadata value that must be a finite number in (lo, hi]."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) \
            or not np.isfinite(value) or not lo < float(value) <= hi:
        raise InvalidModelFile(path, f"metadata {key} must be a finite number in ({lo}, {hi}], got {_show(value)}")
    return float(value)


def _show(value: Any) -> str:
    if isinstance(value, _Undecodable):
        return "an undecodable value"
    text = repr(value)
    text = "".join(c if c.isprintable() else "?" for c in text)
    return text[:60] + ("…" if len(text) > 60 else "")


def read_config(reader: "gguf.GGUFReader", path: Path) -> ModelConfig:
    """The architecture from the metadata, every value type- and range-checked (and checked against the
    tensors the file holds) before anything is sized from it."""
    arch = field(reader, "general.architecture")
    if arch is None:
        raise InvalidModelFile(path, "missing general.architecture")
    if not isinstance(arch, str):
        raise InvalidModelFile(path, f"general.architecture must be a string, got {_show(arch)}")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModel(
            f"{path}: unsupported architecture {_show(arch)}; verispec runs {', '.join(SUPPORTED_ARCHITECTURES)}"
        )

    def need(key: str) -> Any:
        value = field(reader, f"{arch}.{key}")
        if value is None:
            raise InvalidModelFile(path, f"missing metadata {arch}.{key}")
        return value

    def integer(key: str, lo: int, hi: int, default: Any = None) -> int:
        value = need(key) if default is None else field(reader, f"{arch}.{key}", default)
        return _integer(value, f"{arch}.{key}", path, lo, hi)

    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise InvalidModelFile(path, "missing tensor token_embd.weight")
    layers_present = {int(n.split(".")[1]) for n in tensors if hf_name(n) and n.startswith("blk.")}
    hidden = integer("embedding_length", 1, 1 << 16)
    heads = integer("attention.head_count", 1, 1 << 12)
    kv_heads = integer("attention.head_count_kv", 1, heads, heads)
    if heads % kv_heads:
        raise InvalidModelFile(path, f"{heads} attention heads cannot share {kv_heads} KV heads evenly")
    head_dim = integer("attention.key_length", 2, 1 << 12, hidden // heads if hidden % heads == 0 else 0)
    layers = integer("block_count", 1, 1 << 12)
    if layers > len(layers_present) or any(i >= layers for i in layers_present):
        raise InvalidModelFile(path, f"block_count is {layers} but the file holds tensors of "
                                     f"{len(layers_present)} layers")
    shape = tensors["token_embd.weight"].shape
    vocab = int(shape[1]) if len(shape) > 1 else 0
    return ModelConfig(
        architecture=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=integer("feed_forward_length", 1, 1 << 18),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=integer("context_length", 1, 1 << 24, 4096),
        rope_theta=_real(field(reader, f"{arch}.rope.freq_base", 10000.0), f"{arch}.rope.freq_base", path, 0.0, 1e12),
        rms_norm_eps=_real(need("attention.layer_norm_rms_epsilon"), f"{arch}.attention.layer_norm_rms_epsilon",
                           path, 0.0, 1.0),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
    )


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE pairs -> rotate-half halves)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _check_disjoint(tensors: list, path: Path) -> None:
    """Two tensors that share bytes mean a corrupt offset (each would load the other's weights)."""
    spans = sorted((int(t.data_offset), int(t.data_offset) + int(t.n_bytes), t.name) for t in tensors)
    for (_, end, first), (start, _, second) in zip(spans, spans[1:]):
        if start < end:
            raise InvalidModelFile(path, f"tensors {_show(first)} and {_show(second)} overlap (corrupt offsets)")


def load_gguf(path: str | Path, dtype: torch.dtype = torch.float32,
              on_tensor: Callable[[int, int], None] | None = None) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read, validate and dequantize a GGUF model file. Returns (config, HF-named state dict)."""
    path = Path(path)
    reader = open_reader(path)
    cfg = read_config(reader, path)
    want = expected_shapes(cfg)
    file_size = path.stat().st_size
    alignment = _integer(field(reader, "general.alignment", 32), "general.alignment", path, 1, 1 << 16)

    chosen = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            continue
        if name not in want:
            raise InvalidModelFile(path, f"unexpected tensor {_show(t.name)} for a {cfg.num_layers}-layer {cfg.architecture}")
        shape = tuple(int(s) for s in reversed(t.shape.tolist()))
        shape = tuple(s for s in shape if s != 1) if len(want[name]) == 1 else shape
        if shape != want[name]:
            raise InvalidModelFile(path, f"tensor {_show(t.name)} has shape {shape}, expected {want[name]}")
        if t.tensor_type not in SUPPORTED_TYPES:
            raise UnsupportedModel(f"{path}: tensor {t.name} uses type {t.tensor_type.name}, which verispec cannot dequantize")
        start = int(t.data_offset)
        if start < int(reader.data_offset) or start % alignment or start + int(t.n_bytes) > file_size:
            raise InvalidModelFile(path, f"tensor {_show(t.name)} lies at a misaligned offset or outside the file's "
                                         "data (truncated or corrupt?)")
        if name in chosen:
            raise InvalidModelFile(path, f"tensor {_show(t.name)} appears twice")
        chosen[name] = t
    missing = sorted(set(want) - set(chosen))
    if missing:
        raise InvalidModelFile(path, f"missing {len(missing)} tensor(s), e.g. {missing[0]}")
    _check_disjoint(list(chosen.values()), path)

    state = {}
    for i, (name, t) in enumerate(chosen.items()):
        try:
            w = gguf.quants.dequantize(t.data, t.tensor_type).reshape(want[name])
        except Exception as exc:
            raise InvalidModelFile(path, f"cannot dequantize {t.name} ({type(exc).__name__}: {exc})") from None
        if not np.isfinite(w).all():
            raise InvalidModelFile(path, f"tensor {t.name} holds NaN or infinite values")
        if cfg.architecture == "llama" and ("q_proj" in name or "k_proj" in name):
            w = unpermute(w, cfg.num_heads if "q_proj" in name else cfg.num_kv_heads)
        state[name] = torch.from_numpy(np.array(w, dtype=np.float32)).to(dtype)
        if on_tensor:
            on_tensor(i + 1, len(chosen))
    return cfg, state
