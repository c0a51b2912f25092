"""OpenAI request fields → verispec parameters, and verispec results → OpenAI response objects.

Validation is explicit and strict about the fields we use (each error names its `param`);
fields we do not use are accepted and ignored, as OpenAI clients send many.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass

from verispec.engine.params import SamplingParams
from verispec.errors import InvalidRequest

MAX_N = 16
MAX_STOP = 8
MAX_PROMPTS = 64
MAX_DEPTH = 32             # nesting of a request body (OpenAI's bodies need about 6)
MAX_INT_DIGITS = 40        # an integer field with more digits than this is refused, not converted
MAX_CHARS_PER_TOKEN = 32   # a prompt of more characters than context × this cannot fit: refused before tokenizing


def parse_json(text: str):
    """json.loads with the body's nesting and integer lengths checked first: a body nested 100,000 deep
    or a 5,000-digit number is an InvalidRequest, not a RecursionError or a ValueError; so is a string
    holding a lone surrogate (an escaped half of a UTF-16 pair, which no response could encode)."""
    depth = _max_depth(text)
    if depth > MAX_DEPTH:
        raise InvalidRequest(f"request body nested {depth} levels deep (at most {MAX_DEPTH})")
    body = json.loads(text, parse_int=_bounded_int)
    _check_strings(body)
    return body


def _max_depth(text: str) -> int:
    """Deepest nesting of [ and { outside strings."""
    import numpy as np

    bare = _STRINGS.sub('""', text).encode()
    codes = np.frombuffer(bare, dtype=np.uint8)
    opens = (codes == ord("[")) | (codes == ord("{"))
    closes = (codes == ord("]")) | (codes == ord("}"))
    steps = opens.astype(np.int32) - closes.astype(np.int32)
    return int(np.cumsum(steps).max(initial=0))


_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)


def _bounded_int(digits: str) -> int:
    if len(digits.lstrip("-")) > MAX_INT_DIGITS:
        raise InvalidRequest(f"a number in the request has {len(digits)} digits (at most {MAX_INT_DIGITS})")
    return int(digits)


def _check_strings(value) -> None:
    """Every string (keys included) must encode as UTF-8: no lone surrogates."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidRequest("a string in the request holds a lone UTF-16 surrogate (invalid Unicode)") from None
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_strings(k)
            _check_strings(v)
    elif isinstance(value, list):
        for v in value:
            _check_strings(v)


def check_length(texts: list[str], limit: int, param: str) -> None:
    """Refuse text that could not fit the context whatever its tokens, before tokenizing it."""
    total = sum(len(t) for t in texts)
    if total > limit:
        raise InvalidRequest(f"the {param} ({total} characters) cannot fit this model's context", param=param,
                             code="context_length_exceeded")


@dataclass
class ParsedRequest:
    kind: str                        # "completion" | "chat"
    model: str | None
    prompts: list[str | list[int]]   # one or more (completions accept a batch)
    params: SamplingParams
    stream: bool
    include_usage: bool
    messages: list[dict] | None = None     # chat: validated {role, content} messages


def _number(body: dict, name: str, default, kind=float, lo=None, hi=None):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
        raise InvalidRequest(f"'{name}' must be {'a number' if kind is float else 'an integer'}, got {value!r}",
                             param=name)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise InvalidRequest(f"'{name}' must be between {lo} and {hi}, got {value!r}", param=name)
    return kind(value)


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop) or len(stop) > MAX_STOP:
        raise InvalidRequest(f"'stop' must be a string or a list of at most {MAX_STOP} strings", param="stop")
    return stop


def _params(body: dict, default_max_tokens: int) -> SamplingParams:
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    top_k = _number(body, "top_k", 0, int, -1, 1 << 20)          # -1 (vLLM's "off") = 0
    return SamplingParams(
        temperature=_number(body, "temperature", 1.0, float, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, float, 0.0, 1.0) or 1e-9,
        top_k=max(top_k, 0),
        max_tokens=_number({"max_tokens": max_tokens}, "max_tokens", default_max_tokens, int, 1, 1 << 20),
        seed=_number(body, "seed", None, int, -(1 << 63), (1 << 63) - 1),
        stop=_stop(body),
        n=_number(body, "n", 1, int, 1, MAX_N),
        ignore_eos=bool(body.get("ignore_eos", False)),
    )


def _stream_options(body: dict) -> tuple[bool, bool]:
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise InvalidRequest("'stream' must be true or false", param="stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise InvalidRequest("'stream_options' must be an object", param="stream_options")
    return stream, bool(options.get("include_usage", False))


def _model(body: dict) -> str | None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidRequest("'model' must be a string", param="model")
    return model


def parse_completion(body: dict) -> ParsedRequest:
    """A /v1/completions body; max_tokens defaults to 16, as in OpenAI's API."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        prompts: list = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        prompts = [prompt]
    elif (isinstance(prompt, list) and prompt and len(prompt) <= MAX_PROMPTS
          and all(isinstance(p, str) or (isinstance(p, list) and p and all(isinstance(t, int) for t in p))
                  for p in prompt)):
        prompts = list(prompt)
    else:
        raise InvalidRequest("'prompt' must be a non-empty string, a list of token ids, or a list of up to "
                             f"{MAX_PROMPTS} of those", param="prompt")
    if any(isinstance(p, str) and not p for p in prompts):
        raise InvalidRequest("'prompt' must not be empty", param="prompt")
    stream, usage = _stream_options(body)
    echo = body.get("echo", False)
    if echo:
        raise InvalidRequest("'echo' is not supported", param="echo")
    if body.get("logprobs") not in (None, 0, False):
        raise InvalidRequest("'logprobs' is not supported", param="logprobs")
    return ParsedRequest("completion", _model(body), prompts, _params(body, 16), stream, usage)


ROLES = ("system", "user", "assistant", "tool", "developer")


def _content(message: dict, i: int) -> str:
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):            # [{"type": "text", "text": ...}, …]
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidRequest(f"messages[{i}].content: only text parts are supported", param="messages")
            parts.append(part["text"])
        return "".join(parts)
    raise InvalidRequest(f"messages[{i}].content must be a string or a list of text parts", param="messages")


def parse_chat(body: dict, default_max_tokens: int) -> ParsedRequest:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' must be a non-empty list of {role, content} objects", param="messages")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise InvalidRequest(f"messages[{i}] needs a role, one of {', '.join(ROLES)}", param="messages")
        role = "system" if m["role"] == "developer" else m["role"]
        clean.append({"role": role, "content": _content(m, i)})
    stream, usage = _stream_options(body)
    if body.get("logprobs"):
        raise InvalidRequest("'logprobs' is not supported", param="logprobs")
    return ParsedRequest("chat", _model(body), [], _params(body, default_max_tokens), stream, usage, clean)


# -- responses ---------------------------------------------------------------------------------

def new_id(kind: str) -> str:
    return ("cmpl-" if kind == "completion" else "chatcmpl-") + uuid.uuid4().hex


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def response(kind: str, rid: str, model: str, choices: list[dict], usage_: dict, spec: dict) -> dict:
    obj = "text_completion" if kind == "completion" else "chat.completion"
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": choices,
            "usage": usage_, "verispec": spec}


def choice(kind: str, index: int, text: str, finish_reason: str | None) -> dict:
    if kind == "completion":
        return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}
    return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": None,
            "finish_reason": finish_reason}


def chunk(kind: str, rid: str, model: str, created: int, choices: list[dict], usage_: dict | None = None,
          spec: dict | None = None) -> dict:
    obj = "text_completion" if kind == "completion" else "chat.completion.chunk"
    out = {"id": rid, "object": obj, "created": created, "model": model, "choices": choices}
    if usage_ is not None:
        out["usage"] = usage_
    if spec is not None:
        out["verispec"] = spec
    return out


def chunk_choice(kind: str, index: int, text: str | None, finish_reason: str | None, role: bool = False) -> dict:
    if kind == "completion":
        return {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
    delta: dict = {}
    if role:
        delta["role"] = "assistant"
    if text:
        delta["content"] = text
    return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
