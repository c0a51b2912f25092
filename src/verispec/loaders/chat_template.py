"""A model's chat template: a stranger's Jinja code, compiled once and rendered in a bounded sandbox.

Jinja's sandbox stops attribute tricks and ranges over 100,000, but not a template that multiplies a
string by 10**10, pads it to a billion columns or loops for an hour. Rendering here is bounded on
every axis a template can blow up: numbers handed to calls and operators, the size of what `*`
builds, the text produced, and the time taken. Every failure is an InvalidRequest (the server's 400):
the template refused or could not render these messages.
"""

from __future__ import annotations

import re
import sys
import time

import jinja2
from jinja2.compiler import CodeGenerator
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from verispec.errors import InvalidRequest, UnsupportedModel

MAX_NUMBER = 100_000            # the largest integer a template may pass to a call or operator
MAX_TEXT = 4 << 20              # characters a rendering (or one `*`) may build
MAX_SECONDS = 2.0               # wall time a rendering may take


class TemplateRejected(Exception):
    """raise_exception(...) called by a chat template."""


class _TemplateLimit(Exception):
    """A rendering went past one of the bounds above."""


def _raise(message: str):
    raise TemplateRejected(one_line(message))


def one_line(err) -> str:
    text = " ".join(str(err).split())
    return "".join(c if c.isprintable() else "?" for c in text)[:300]


def _check_number(value) -> None:
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_NUMBER:
        raise _TemplateLimit(f"the number {str(value)[:20]} is beyond what a template may use ({MAX_NUMBER})")


_WIDE_FORMAT = re.compile(r"\d{7,}")       # a field width or precision of a million or more


class _BoundedCodeGenerator(CodeGenerator):
    """`a ~ b` compiles to a join the environment bounds (Jinja's own join is not interceptable)."""

    def visit_Concat(self, node, frame) -> None:
        self.write("environment.bounded_join((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset(["*", "**", "%", "+"])
    code_generator_class = _BoundedCodeGenerator

    @staticmethod
    def bounded_join(parts) -> str:
        parts = [str(p) for p in parts]
        if sum(map(len, parts)) > MAX_TEXT:
            raise _TemplateLimit("a concatenation builds more text than a prompt may hold")
        return "".join(parts)

    def call_binop(self, context, op, left, right):
        for value in (left, right):
            _check_number(value)
            if isinstance(value, tuple):
                for v in value:
                    _check_number(v)
        if op == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > MAX_TEXT:
                    raise _TemplateLimit("a repetition builds more text than a prompt may hold")
        if op == "%" and isinstance(left, str) and _WIDE_FORMAT.search(left):
            raise _TemplateLimit("a format field is wider than a prompt may hold")
        if op == "+" and isinstance(left, (str, list)) and isinstance(right, (str, list)) \
                and len(left) + len(right) > MAX_TEXT:
            raise _TemplateLimit("a concatenation builds more text than a prompt may hold")
        return super().call_binop(context, op, left, right)

    def call(self, __context, __obj, *args, **kwargs):
        for value in (*args, *kwargs.values()):
            _check_number(value)
        return super().call(__context, __obj, *args, **kwargs)

    def wrap_str_format(self, value):
        wrapped = super().wrap_str_format(value)
        if wrapped is not None and _WIDE_FORMAT.search(value.__self__):
            def refuse(*args, **kwargs):
                raise _TemplateLimit("a format field is wider than a prompt may hold")
            return refuse
        return wrapped


def compile_template(source: object):
    """The compiled template; UnsupportedModel when it is not a string or does not compile."""
    if not isinstance(source, str):
        raise UnsupportedModel("the model's chat template is not a string")
    env = _BoundedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    for name in ("center", "indent", "truncate", "wordwrap", "format"):     # filters that take widths
        env.filters[name] = _checked_filter(env.filters[name])
    try:
        return env.from_string(source)
    except (jinja2.TemplateError, RecursionError, MemoryError, ValueError, TypeError) as err:
        raise UnsupportedModel(f"the model's chat template does not compile: {one_line(err)}") from None


def _checked_filter(f):
    def checked(*args, **kwargs):
        for value in (*args, *kwargs.values()):
            _check_number(value)
            if isinstance(value, str) and f.__name__ == "do_format" and _WIDE_FORMAT.search(value):
                raise _TemplateLimit("a format field is wider than a prompt may hold")
        return f(*args, **kwargs)
    for attr in ("jinja_pass_arg",):                # keep how Jinja passes context/environment
        if hasattr(f, attr):
            setattr(checked, attr, getattr(f, attr))
    checked.__name__ = f.__name__
    return checked


def render(template, messages: list[dict], add_generation_prompt: bool) -> str:
    """Render within MAX_TEXT characters and MAX_SECONDS; InvalidRequest on any failure."""
    deadline = time.monotonic() + MAX_SECONDS
    ticks = [0]

    def tracer(frame, event, arg):                 # checks the clock every 1,000 lines the template runs
        ticks[0] += 1
        if ticks[0] % 1000 == 0 and time.monotonic() > deadline:
            raise _TemplateLimit(f"rendering took longer than {MAX_SECONDS:.0f} s")
        return tracer

    parts, size = [], 0
    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        for piece in template.generate(messages=messages, add_generation_prompt=add_generation_prompt, tools=None):
            size += len(piece)
            if size > MAX_TEXT:
                raise _TemplateLimit("the rendering is longer than a prompt may be")
            parts.append(piece)
    except TemplateRejected as err:
        raise InvalidRequest(f"the chat template rejected the messages: {err}", param="messages") from None
    except _TemplateLimit as err:
        raise InvalidRequest(f"the chat template went past a limit: {err}", param="messages") from None
    except (jinja2.TemplateError, SecurityError, TypeError, ValueError, KeyError, AttributeError, IndexError,
            RecursionError, OverflowError, MemoryError, ZeroDivisionError, UnicodeError) as err:
        raise InvalidRequest(f"the chat template failed on these messages: {one_line(err)}",
                             param="messages") from None
    finally:
        sys.settrace(previous)
    return "".join(parts)
