"""A model's chat template is a stranger's code: it renders like Jinja when it is well-behaved and
fails as an InvalidRequest, quickly and without a memory blow-up, when it is not."""

from __future__ import annotations

import resource
import time

import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from verispec.errors import InvalidRequest, UnsupportedModel
from verispec.loaders.chat_template import MAX_SECONDS, compile_template, render

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Sort [3, 1, 2] in Python."},
            {"role": "assistant", "content": "sorted([3, 1, 2])"}, {"role": "user", "content": "And in reverse?"}]

HOSTILE = {
    "repeat": "{{ 'x' * 10**10 }}",
    "repeat-input": "{{ messages[0]['content'] * 10**9 }}",
    "doubling-tilde": "{% set ns = namespace(x='ab') %}{% for i in range(60) %}{% set ns.x = ns.x ~ ns.x %}"
                      "{% endfor %}{{ ns.x }}",
    "doubling-plus": "{% set ns = namespace(x='ab') %}{% for i in range(60) %}{% set ns.x = ns.x + ns.x %}"
                     "{% endfor %}{{ ns.x }}",
    "pad": "{{ 'x'.ljust(10**9) }}",
    "center": "{{ 'x' | center(10**9) }}",
    "percent-format": "{{ '%1000000000s' % 'x' }}",
    "str-format": "{{ '{:>1000000000}'.format('x') }}",
    "format-filter": "{{ '%-1000000000s' | format('x') }}",
    "power": "{{ 10 ** 10 ** 10 }}",
    "long-loop": "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}",
    "long-output": "{% for a in range(100000) %}{{ messages | tojson }}{% endfor %}",
    "recursion": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "sandbox": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "undefined": "{{ undefined_function() }}",
    "rejects": "{{ raise_exception('roles must alternate') }}",
}


def test_a_well_behaved_template_renders_as_jinja_does():
    plain = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(CHATML)
    for add in (True, False):
        assert render(compile_template(CHATML), MESSAGES, add) == \
            plain.render(messages=MESSAGES, add_generation_prompt=add, tools=None)


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_hostile_template_is_a_quick_bounded_invalid_request(name):
    template = compile_template(HOSTILE[name])
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
    start = time.perf_counter()
    with pytest.raises(InvalidRequest) as err:
        render(template, MESSAGES, True)
    assert err.value.param == "messages"
    assert time.perf_counter() - start < MAX_SECONDS + 1
    assert (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10) - peak < 256 << 20


@pytest.mark.parametrize("source", ["{% for m in messages %}{{ m", 42, ["a"]])
def test_a_template_that_is_not_text_or_does_not_compile_is_refused_at_load(source):
    with pytest.raises(UnsupportedModel):
        compile_template(source)


def test_rendering_leaves_the_callers_tracer_in_place():
    import sys
    seen = []

    def tracer(frame, event, arg):
        seen.append(event)
        return None

    sys.settrace(tracer)
    try:
        render(compile_template(CHATML), MESSAGES, True)
        assert sys.gettrace() is tracer
    finally:
        sys.settrace(None)
