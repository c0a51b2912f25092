"""Model architecture configuration, read from checkpoint metadata (never guessed from names)."""

from __future__ import annotations

from dataclasses import dataclass

from verispec.errors import UnsupportedModel

SUPPORTED_ARCHITECTURES = ("qwen2", "llama")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str          # "qwen2" | "llama"
    vocab_size: int            # rows of the embedding / LM head (may exceed the tokenizer's vocab)
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool       # QKV bias (Qwen2: True)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModel(
                f"unsupported architecture {self.architecture!r}; verispec runs {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise UnsupportedModel(f"model config has non-positive {name}={getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModel(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise UnsupportedModel(f"head_dim={self.head_dim} must be even for RoPE")

    @classmethod
    def from_hf_dict(cls, d: dict) -> "ModelConfig":
        """Build from a Hugging Face `config.json` dict."""
        model_type = d.get("model_type", "")
        hidden = d["hidden_size"]
        heads = d["num_attention_heads"]
        return cls(
            architecture=model_type,
            vocab_size=d["vocab_size"],
            hidden_size=hidden,
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or hidden // heads,
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            rope_theta=float(d.get("rope_theta", (d.get("rope_parameters") or {}).get("rope_theta", 10000.0))),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", model_type == "qwen2")),
        )
