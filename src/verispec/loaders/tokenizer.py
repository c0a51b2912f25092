"""Tokenizer and chat template, built with the `tokenizers` library (no hand-written BPE).

From a GGUF file the byte-level BPE is rebuilt from `tokenizer.ggml.*` metadata; from a model
directory `tokenizer.json` is read as is. Building from GGUF takes seconds, so the prepared-model
cache stores the result as `tokenizer.json`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from verispec.errors import InvalidRequest, UnsupportedModel

# Pre-tokenizer split patterns by `tokenizer.ggml.pre` (as in the models' own tokenizer.json files).
_SPLIT_PATTERNS = {
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "llama-bpe": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}
_STOP_TEXTS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>")
_CONTROL, _USER_DEFINED = 3, 4


def _string_array(reader, key: str) -> list[str]:
    f = reader.get_field(key)
    return [] if f is None else [bytes(f.parts[i]).decode("utf-8") for i in f.data]


def _int_array(reader, key: str) -> list[int]:
    f = reader.get_field(key)
    return [] if f is None else [int(f.parts[i][0]) for i in f.data]


def tokenizer_from_gguf(reader) -> tuple[Tokenizer | None, dict]:
    """Rebuild the BPE tokenizer from GGUF metadata. Returns (tokenizer or None, extra info)."""
    from verispec.loaders.gguf_loader import field as meta

    info = {"chat_template": meta(reader, "tokenizer.chat_template"),
            "eos_token_id": meta(reader, "tokenizer.ggml.eos_token_id"),
            "bos_token_id": meta(reader, "tokenizer.ggml.bos_token_id"),
            "add_bos_token": bool(meta(reader, "tokenizer.ggml.add_bos_token", False))}
    kind = meta(reader, "tokenizer.ggml.model")
    if kind is None:
        return None, info
    if kind != "gpt2":
        raise UnsupportedModel(f"tokenizer type {kind!r} is not supported (byte-level BPE 'gpt2' only); "
                               "pass token ids instead of text")
    pre = meta(reader, "tokenizer.ggml.pre", "qwen2")
    tokens = _string_array(reader, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in _string_array(reader, "tokenizer.ggml.merges")]
    types = _int_array(reader, "tokenizer.ggml.token_type")

    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                               fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_SPLIT_PATTERNS.get(pre, _SPLIT_PATTERNS["qwen2"])), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.add_tokens([AddedToken(tokens[i], special=types[i] == _CONTROL, normalized=False)
                    for i in range(len(tokens)) if types[i] in (_CONTROL, _USER_DEFINED)])
    return tok, info


@dataclass
class TextTokenizer:
    """Encode/decode text, render the chat template, and know which tokens stop generation."""

    tokenizer: Tokenizer
    chat_template: str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    add_bos_token: bool = False
    _template: object = field(default=None, init=False, repr=False, compare=False)   # compiled chat template

    @classmethod
    def from_files(cls, tokenizer_json: Path, info: dict) -> "TextTokenizer":
        tok = Tokenizer.from_file(str(tokenizer_json))
        stops = set(int(i) for i in info.get("stop_token_ids", []))
        eos = info.get("eos_token_id")
        for e in (eos if isinstance(eos, list) else [eos]):
            if e is not None:
                stops.add(int(e))
        for text in _STOP_TEXTS:
            tid = tok.token_to_id(text)
            if tid is not None:
                stops.add(tid)
        return cls(tok, info.get("chat_template"), sorted(stops), info.get("bos_token_id"),
                   bool(info.get("add_bos_token")))

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if self.add_bos_token and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special: bool = False) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special)

    def compiled_template(self):
        """The chat template compiled once in a sandbox; UnsupportedModel when there is none or it does
        not compile (a model file's template is a stranger's code)."""
        if not self.chat_template:
            raise UnsupportedModel("this model has no chat template; use --raw to send the prompt as is")
        if self._template is None:
            if not isinstance(self.chat_template, str):
                raise UnsupportedModel("the model's chat template is not a string")
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise
            try:
                self._template = env.from_string(self.chat_template)
            except jinja2.TemplateError as err:
                raise UnsupportedModel(f"the model's chat template does not compile: {_one_line(err)}") from None
        return self._template

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The conversation rendered by the model's template. A template that rejects the messages (its
        raise_exception, say, on a wrong role order) or fails on them is an InvalidRequest."""
        template = self.compiled_template()
        try:
            text = template.render(messages=messages, add_generation_prompt=add_generation_prompt, tools=None)
        except TemplateRejected as err:
            raise InvalidRequest(f"the chat template rejected the messages: {err}", param="messages") from None
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError, IndexError,
                RecursionError) as err:
            raise InvalidRequest(f"the chat template failed on these messages: {_one_line(err)}",
                                 param="messages") from None
        if not isinstance(text, str):
            raise InvalidRequest("the chat template did not produce text", param="messages")
        return text


class TemplateRejected(Exception):
    """raise_exception(...) called by a chat template."""


def _raise(message: str):
    raise TemplateRejected(_one_line(message))


def _one_line(err) -> str:
    text = " ".join(str(err).split())
    return "".join(c if c.isprintable() else "?" for c in text)[:300]


class IncrementalDecoder:
    """Turns a growing list of token ids into text deltas that never split a UTF-8 character.

    Byte-level BPE tokens can end inside a multi-byte character; the decoder then yields "\ufffd".
    We hold such a tail back until the character completes. Only a short window of recent ids is
    decoded per push (it starts at a character boundary), so streaming stays linear in length.
    """

    def __init__(self, tokenizer: TextTokenizer, skip_special: bool = True):
        self.tok = tokenizer
        self.skip = skip_special
        self.ids: list[int] = []
        self.prefix = 0      # window start: every id before it has been fully emitted
        self.read = 0        # ids[prefix:read] decode to text already emitted

    def push(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        done = self.tok.decode(self.ids[self.prefix:self.read], skip_special=self.skip)
        text = self.tok.decode(self.ids[self.prefix:], skip_special=self.skip)
        if text.endswith("\ufffd") or len(text) <= len(done):
            return ""                                  # wait for the character to complete
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(done):]

    def flush(self) -> str:
        done = self.tok.decode(self.ids[self.prefix:self.read], skip_special=self.skip)
        text = self.tok.decode(self.ids[self.prefix:], skip_special=self.skip)
        self.prefix = self.read = len(self.ids)
        return text[len(done):]
