"""The embedded Qwen2.5-Coder pair: our loader, tokenizer and speculation on real weights.

Marked `real`: `pytest -m "not real"` skips them for a quick local run; CI runs everything.
One loaded pair per session (conftest.real_pair); the transformers reference is loaded once here.
"""

from __future__ import annotations

import pytest
import torch

from verispec import LLM, SamplingParams, kernels
from verispec.models import KVCache

pytestmark = pytest.mark.real

DRAFT = "qwen2.5-coder-0.5b-instruct"
CODE_PROMPTS = [
    "def quicksort(arr):",
    "# Return the n-th Fibonacci number\ndef fib(n):",
    "class Stack:\n    def __init__(self):",
]


@pytest.fixture(scope="module")
def hf_reference():
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from verispec.loaders.builtin import ensure_assembled

    path = ensure_assembled(DRAFT, progress=False)
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                              dtype=torch.float32).eval()
    return tok, model


def test_logits_match_transformers_gguf_loading(real_pair, hf_reference):
    _, draft = real_pair
    tok, hf = hf_reference
    ids = torch.tensor([tok.encode("def add(a, b):\n    return a + b\n\nprint(add(2, 3))")])
    with torch.no_grad():
        ref = hf(ids).logits
    t = ids.shape[1]
    cache = KVCache.for_model(draft.config, 1, t + 4, torch.float32)
    pos = torch.arange(t)[None]
    ours = draft.model.logits(draft.model(ids, pos, cache.view([0], pos)), pos)
    assert (ours - ref).abs().max() < 2e-3 * ref.abs().max()
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


def test_greedy_continuations_match_transformers(real_pair, hf_reference):
    _, draft = real_pair
    tok, hf = hf_reference
    llm = LLM(draft, proposer="none")
    for prompt in CODE_PROMPTS[:2]:
        ids = tok.encode(prompt)
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids):].tolist()
        ours = llm.generate([ids], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].token_ids
        assert ours == ref


@pytest.mark.parametrize("text", [
    "Hello, world!",
    "def f(x):\n\treturn x**2  # squares\n",
    "naïve café — 日本語のテキスト, emoji 🙂 and Ünïcödé",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "   leading spaces and trailing   \n\n\n",
    "<tool_call>{\"name\": \"x\"}</tool_call><|fim_prefix|>a<|fim_suffix|>b<|fim_middle|>",
])
def test_tokenizer_matches_transformers_and_round_trips(real_pair, hf_reference, text):
    _, draft = real_pair
    tok, _ = hf_reference
    ours = draft.tokenizer.encode(text)
    assert ours == tok.encode(text, add_special_tokens=False)
    assert draft.tokenizer.decode(ours) == text


def test_incremental_decoding_never_splits_characters(real_pair):
    from verispec.loaders.tokenizer import IncrementalDecoder
    _, draft = real_pair
    text = "日本語 🙂 ünïcode"
    dec = IncrementalDecoder(draft.tokenizer)
    pieces = [dec.push([t]) for t in draft.tokenizer.encode(text)]
    assert "".join(pieces) + dec.flush() == text
    assert all("\ufffd" not in p for p in pieces)


def test_chat_template_and_stop_tokens(real_pair):
    target, _ = real_pair
    tok = target.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt.endswith("<|im_start|>assistant\n") and "<|im_start|>user\nhi<|im_end|>" in prompt
    names = {tok.decode([i]) for i in tok.stop_token_ids}
    assert {"<|im_end|>", "<|endoftext|>"} <= names


def test_greedy_speculative_equals_plain_on_the_real_pair(real_pair):
    target, draft = real_pair
    params = SamplingParams(temperature=0, max_tokens=20)
    plain = LLM(target, proposer="none").generate(CODE_PROMPTS, params)
    spec_llm = LLM(target, draft=draft, proposer="draft", k=4)
    batched = spec_llm.generate(CODE_PROMPTS, params)
    for prompt, p, s in zip(CODE_PROMPTS, plain, batched):
        assert s.token_ids == p.token_ids, prompt
        assert spec_llm.generate([prompt], params)[0].token_ids == p.token_ids
    assert sum(o.spec["accepted"] for o in batched) > 0
    ngram = LLM(target, proposer="ngram", k=4).generate(CODE_PROMPTS, params)
    assert [o.token_ids for o in ngram] == [o.token_ids for o in plain]
    heads = LLM(target, proposer="head", k=3).generate(CODE_PROMPTS, params)     # the shipped heads
    assert [o.token_ids for o in heads] == [o.token_ids for o in plain]
    assert sum(o.spec["accepted"] for o in heads) > 0


def test_lookup_copies_a_renamed_variable_through_its_edit():
    """The 1.5B in its default format renames `tmp` to `total` while re-emitting a function: after the
    first rename the lookup proposes the new name at the later uses (it learned the edit), the copy runs
    through them in fewer rounds than without edits, and greedy output stays the plain one."""
    import verispec.proposers.match_index as match_index
    from verispec.engine.loading import load_model

    target = load_model("qwen2.5-coder-1.5b-instruct")
    code = ("def summarize(orders):\n    tmp = 0\n    for order in orders:\n        if order.status == 'paid':\n"
            "            tmp += order.amount\n        elif order.status == 'refunded':\n            tmp -= order.amount\n"
            "    print('total:', tmp)\n    return tmp\n")
    plain_llm = LLM(target, proposer="none")
    prompt = plain_llm.chat_prompt([{"role": "user", "content": "Rename the variable `tmp` to `total` everywhere in "
                                     f"this code and return the full code:\n\n```python\n{code}```"}])
    params = SamplingParams(temperature=0, max_tokens=72)
    plain = plain_llm.generate([prompt], params)[0]
    assert plain.text.count("total") >= 4 and " tmp" not in plain.text
    with_edits = LLM(target, proposer="ngram").generate([prompt], params)[0]
    learn = match_index.edit_before
    match_index.edit_before = lambda *a: None
    try:
        without = LLM(target, proposer="ngram").generate([prompt], params)[0]
    finally:
        match_index.edit_before = learn
    assert with_edits.token_ids == plain.token_ids == without.token_ids
    assert with_edits.spec["rounds"] < without.spec["rounds"]


@pytest.mark.real
@pytest.mark.skipif(not kernels.available(), reason=f"native kernel {kernels.kernel_status()}")
@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_greedy_speculative_equals_plain_on_the_native_pass(fmt):
    """The CPU formats (int4 the default, with the draft in its default int4-all): every decode and
    verify pass of both models runs in the native decoder (kernels/decoder.c), and greedy speculation
    still changes nothing, with the draft's vocabulary truncated too."""
    from verispec.engine.loading import load_model

    target = load_model("qwen2.5-coder-1.5b-instruct", dtype=fmt)
    draft = load_model("qwen2.5-coder-0.5b-instruct", dtype="int4-all" if fmt == "int4" else fmt)
    params = SamplingParams(temperature=0, max_tokens=24)
    plain = [o.token_ids for o in LLM(target, proposer="none").generate(CODE_PROMPTS, params)]
    assert target.model._native is not None
    from verispec.heads import shipped_heads

    default = LLM(target)                        # lookup, else the paired 0.5B draft (loaded by name), K auto
    assert default.proposer_name == "hybrid" and default.draft is not None and default.heads is None
    for llm in (LLM(target, draft=draft, proposer="draft", k=4), LLM(target, draft=draft, proposer="draft", k=3,
                                                                   draft_vocab=32768),
                LLM(target, draft=draft, proposer="draft", k=4, draft_stop=0),
                LLM(target, proposer="ngram", k=6),
                LLM(target, proposer="head", k=4),
                LLM(target, proposer="hybrid", head=shipped_heads(target.name), k="auto"),
                default):
        assert [o.token_ids for o in llm.generate(CODE_PROMPTS, params)] == plain


@pytest.mark.real
def test_server_with_embedded_model_matches_generate(real_pair):
    """The official openai client against `verispec serve` on the embedded 0.5B (as target, prompt
    lookup): greedy chat equals LLM.generate, streaming equals non-streaming, usage is exact."""
    openai = pytest.importorskip("openai")
    from test_server import LiveServer

    from verispec.serving.api import ServerConfig, create_app

    _, draft = real_pair
    llm = LLM(draft, proposer="ngram", k="auto")
    live = LiveServer(create_app(ServerConfig("qwen2.5-coder-0.5b-instruct"),
                                 lambda: llm.engine(kv_budget_mb=256)))
    try:
        live.wait_ready()
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0, timeout=120)
        messages = [{"role": "user", "content": "Write a Python function that reverses a string."}]
        out = client.chat.completions.create(model="qwen2.5-coder-0.5b-instruct", messages=messages,
                                             max_tokens=24, temperature=0)
        ref = llm.generate([llm.chat_prompt(messages)], SamplingParams(temperature=0, max_tokens=24))[0]
        assert out.choices[0].message.content == ref.text
        assert out.usage.completion_tokens == ref.generated_tokens
        stream = client.chat.completions.create(model="qwen2.5-coder-0.5b-instruct", messages=messages,
                                                max_tokens=24, temperature=0, stream=True,
                                                stream_options={"include_usage": True})
        chunks = list(stream)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
        assert chunks[-1].usage.completion_tokens == ref.generated_tokens
    finally:
        live.stop()


def test_chat_turns_on_the_embedded_model():
    """`verispec chat` with piped input: two turns, the second reusing the first from the cache."""
    import os
    import re
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "verispec.cli.main", "chat", "--max-tokens", "24"],
                          input="What is 2 + 2? Answer with the number only.\nAnd 3 + 3?\n/stats\n",
                          capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr
    assert "4" in proc.stdout.splitlines()[0] and "6" in proc.stdout.splitlines()[1]
    prefilled, reused = map(int, re.search(r"(\d+) tokens prefilled, (\d+) reused", proc.stdout).groups())
    # The history is reused in whole 16-token blocks: the second turn prefills its own ~14 tokens and
    # the rest of the history's last block.
    assert reused > 20 and reused % 16 == 0 and prefilled < 25 + 16
