"""Tokenizer and chat template, built with the `tokenizers` library (no hand-written BPE).

From a GGUF file the byte-level BPE is rebuilt from `tokenizer.ggml.*` metadata; from a model
directory `tokenizer.json` is read as is. Building from GGUF takes seconds, so the prepared-model
cache stores the result as `tokenizer.json`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import gguf
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from verispec.errors import InvalidModelFile, UnsupportedModel
from verispec.loaders.chat_template import compile_template, render

# Pre-tokenizer split patterns by `tokenizer.ggml.pre` (as in the models' own tokenizer.json files).
_SPLIT_PATTERNS = {
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "llama-bpe": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}
_STOP_TEXTS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>")
_CONTROL, _USER_DEFINED = 3, 4


class _Meta:
    """Typed reads of one GGUF file's tokenizer metadata; InvalidModelFile on a wrong type or value."""

    def __init__(self, reader, path: Path):
        self.reader, self.path = reader, path

    def fail(self, key: str, problem: str):
        raise InvalidModelFile(self.path, f"metadata {key} {problem}")

    def _field(self, key: str, types: tuple):
        f = self.reader.get_field(key)
        if f is not None and tuple(f.types[:len(types)]) != types:
            self.fail(key, f"has type {'/'.join(t.name for t in f.types)}, expected {'/'.join(t.name for t in types)}")
        return f

    def string(self, key: str) -> str | None:
        f = self._field(key, (gguf.GGUFValueType.STRING,))
        return None if f is None else self._text(key, bytes(f.parts[f.data[0]]))

    def strings(self, key: str) -> list[str] | None:
        f = self._field(key, (gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING))
        return None if f is None else [self._text(key, bytes(f.parts[i])) for i in f.data]

    def integers(self, key: str) -> list[int] | None:
        f = self.reader.get_field(key)
        if f is None:
            return None
        if len(f.types) != 2 or f.types[0] != gguf.GGUFValueType.ARRAY or f.types[1] not in _INTEGER_TYPES:
            self.fail(key, "must be an array of integers")
        return [int(f.parts[i][0]) for i in f.data]

    def integer(self, key: str, lo: int, hi: int) -> int | None:
        f = self.reader.get_field(key)
        if f is None:
            return None
        value = int(f.parts[f.data[0]][0]) if len(f.types) == 1 and f.types[0] in _INTEGER_TYPES else None
        if value is None or not lo <= value < hi:
            self.fail(key, f"must be an integer in {lo} … {hi - 1}")
        return value

    def flag(self, key: str) -> bool:
        f = self._field(key, (gguf.GGUFValueType.BOOL,))
        return False if f is None else bool(f.parts[f.data[0]][0])

    def _text(self, key: str, raw: bytes) -> str:
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            self.fail(key, "holds a string that is not valid UTF-8")


_INTEGER_TYPES = tuple(getattr(gguf.GGUFValueType, n) for n in
                       ("UINT8", "INT8", "UINT16", "INT16", "UINT32", "INT32", "UINT64", "INT64"))
_NORMAL = 1


def tokenizer_from_gguf(reader, path: Path, vocab_size: int) -> tuple[Tokenizer | None, dict]:
    """Rebuild the BPE tokenizer from GGUF metadata, every value type- and range-checked against the
    model's `vocab_size` embedding rows. Returns (tokenizer or None, extra info)."""
    m = _Meta(reader, path)
    kind = m.string("tokenizer.ggml.model")
    tokens = m.strings("tokenizer.ggml.tokens") if kind is not None else None
    n = len(tokens) if tokens is not None else vocab_size
    info = {"chat_template": m.string("tokenizer.chat_template"),
            "eos_token_id": m.integer("tokenizer.ggml.eos_token_id", 0, n),
            "bos_token_id": m.integer("tokenizer.ggml.bos_token_id", 0, n),
            "add_bos_token": m.flag("tokenizer.ggml.add_bos_token")}
    if kind is None:
        return None, info
    if kind != "gpt2":
        raise UnsupportedModel(f"tokenizer type {kind[:40]!r} is not supported (byte-level BPE 'gpt2' only); "
                               "pass token ids instead of text")
    if not tokens or len(tokens) > vocab_size:
        m.fail("tokenizer.ggml.tokens", f"holds {len(tokens or [])} tokens for {vocab_size} embedding rows")
    pre = m.string("tokenizer.ggml.pre") or "qwen2"
    types = m.integers("tokenizer.ggml.token_type")                  # optional, as in llama.cpp: normal
    if types is None:
        types = [_NORMAL] * len(tokens)
    elif len(types) != len(tokens):
        m.fail("tokenizer.ggml.token_type", f"holds {len(types)} types for {len(tokens)} tokens")
    vocab = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)                                       # a repeated string keeps its first id
    merges = []
    for text in m.strings("tokenizer.ggml.merges") or []:
        pair = tuple(text.split(" ", 1))
        if len(pair) != 2 or pair[0] not in vocab or pair[1] not in vocab:
            m.fail("tokenizer.ggml.merges", f"holds {_printable(text)!r}, not two known tokens")
        merges.append(pair)
    try:
        tok = _build(tokens, vocab, merges, types, pre)
    except Exception as exc:              # the tokenizers library refuses what it cannot build
        raise InvalidModelFile(path, f"the tokenizer metadata does not build a tokenizer "
                                     f"({type(exc).__name__}: {_printable(str(exc))})") from None
    return tok, info


def _printable(text: str, limit: int = 60) -> str:
    return "".join(c if c.isprintable() else "?" for c in text[:limit])


def _build(tokens: list[str], vocab: dict[str, int], merges: list[tuple[str, str]], types: list[int],
           pre: str) -> Tokenizer:
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_SPLIT_PATTERNS.get(pre, _SPLIT_PATTERNS["qwen2"])), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.add_tokens([AddedToken(tokens[i], special=types[i] == _CONTROL, normalized=False)
                    for i in range(len(tokens)) if types[i] in (_CONTROL, _USER_DEFINED)])
    return tok


@dataclass
class TextTokenizer:
    """Encode/decode text, render the chat template, and know which tokens stop generation."""

    tokenizer: Tokenizer
    chat_template: str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    add_bos_token: bool = False
    _template: object = field(default=None, init=False, repr=False, compare=False)   # compiled chat template
    # sha256 of the tokenizer.json it was read from ("" when built otherwise): equal files, equal vocabularies
    source_digest: str = field(default="", repr=False, compare=False)

    @classmethod
    def from_files(cls, tokenizer_json: Path, info: dict) -> "TextTokenizer":
        raw = Path(tokenizer_json).read_bytes()
        tok = Tokenizer.from_str(raw.decode("utf-8"))
        stops = set(int(i) for i in info.get("stop_token_ids", []))
        eos = info.get("eos_token_id")
        for e in (eos if isinstance(eos, list) else [eos]):
            if e is not None:
                stops.add(int(e))
        for text in _STOP_TEXTS:
            tid = tok.token_to_id(text)
            if tid is not None:
                stops.add(tid)
        made = cls(tok, info.get("chat_template"), sorted(stops), info.get("bos_token_id"),
                   bool(info.get("add_bos_token")))
        made.source_digest = hashlib.sha256(raw).hexdigest()
        return made

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
        """The chat template compiled once in a bounded sandbox (a model file's template is a stranger's
        code); UnsupportedModel when there is none or it does not compile."""
        if not self.chat_template:
            raise UnsupportedModel("this model has no chat template; use --raw to send the prompt as is")
        if self._template is None:
            self._template = compile_template(self.chat_template)
        return self._template

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The conversation rendered by the model's template. A template that rejects the messages (its
        raise_exception, say, on a wrong role order), fails on them or goes past the rendering limits
        is an InvalidRequest."""
        return render(self.compiled_template(), messages, add_generation_prompt)


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
