"""The native decoder pass (kernels/decoder.c via models/native.py) against the torch layers it replaces:
the same hidden states and cache contents within float tolerance on static and paged caches, rows that
never depend on the pass they share, greedy speculation identical to plain decoding on it — and a
deliberately row-dependent variant that the identity test catches."""

from __future__ import annotations

import pytest
import torch

from conftest import advance, int8_model, tiny_model
from conftest import run_pass as run
from verispec import LLM, SamplingParams, kernels
from verispec.models import KVCache
from verispec.models.native import NativeDecoder
from verispec.models.paged_cache import PagedKVCache
from verispec.models.quant import quantize_linears

pytestmark = pytest.mark.skipif(not kernels.available(), reason=f"native kernel {kernels.kernel_status()}")

SHAPES = {
    "qwen2 GQA 2:1": dict(arch="qwen2"),
    "llama GQA 6:1, head 32, odd widths": dict(arch="llama", hidden_size=96, num_heads=6, num_kv_heads=1, head_dim=32,
                                               intermediate_size=200, num_layers=3),
    "qwen2 GQA 7:1, head 128": dict(arch="qwen2", hidden_size=112, num_heads=7, num_kv_heads=1, head_dim=128,
                                    intermediate_size=160),
}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_native_pass_matches_torch_layers_on_a_static_cache(shape):
    model = int8_model(**SHAPES[shape])
    assert NativeDecoder.build(model) is not None
    caches = {n: KVCache.for_model(model.config, 3, 128, torch.float32) for n in (True, False)}
    prompts = [list(range(1, 71)), list(range(20, 92))]                       # > 65 tokens: torch prefill
    for native, cache in caches.items():
        run(model, cache, [0, 2], prompts, native)
        advance(cache, [0, 2], prompts)
    for chunks in ([[5], [7]], [[1, 2, 3, 4, 5], [9, 8]], [[3], [4, 5, 6]]):   # decode, ragged verify passes
        out = {n: run(model, c, [0, 2], chunks, n) for n, c in caches.items()}
        torch.testing.assert_close(out[True], out[False], rtol=1e-3, atol=5e-4 * out[False].abs().max().item())
        for n, c in caches.items():
            advance(c, [0, 2], chunks)
    for store in ("k", "v"):                                                  # written at the same places
        a, b = getattr(caches[True], store), getattr(caches[False], store)
        torch.testing.assert_close(a, b, rtol=1e-3, atol=5e-4 * b.abs().max().item())
    assert getattr(caches[True], "k")[:, 1].abs().sum() == 0                 # slot 1 untouched


def paged(model, tables):
    return PagedKVCache(model.config, num_blocks=48, block_size=4, block_tables=tables, dtype=torch.float32)


def test_native_pass_reads_and_writes_paged_blocks_in_place():
    model = int8_model()
    order = torch.randperm(46, generator=torch.Generator().manual_seed(0)).add(1).tolist()   # scattered blocks
    tables = {7: order[:19], 8: order[19:38]}
    caches = {n: paged(model, tables) for n in (True, False)}
    prompts = [list(range(1, 70)), list(range(10, 76))]                        # torch prefill
    for native, cache in caches.items():
        for s, p in zip([7, 8], prompts):                                    # torch prefill, one sequence each
            run(model, cache, [s], [p], native)
            advance(cache, [s], [p])
    for chunks in ([[5], [7]], [[1, 2, 3], [9, 8, 7]]):
        out = {n: run(model, c, [7, 8], chunks, n) for n, c in caches.items()}
        torch.testing.assert_close(out[True], out[False], rtol=1e-3, atol=5e-4 * out[False].abs().max().item())
        for c in caches.values():
            advance(c, [7, 8], chunks)
    torch.testing.assert_close(caches[True].k, caches[False].k, rtol=1e-3, atol=5e-4 * caches[False].k.abs().max().item())
    for unused in [0, 47, *order[38:]]:                                      # blocks in no table stay empty
        assert caches[True].k[:, unused].abs().sum() == 0


def test_native_rows_do_not_depend_on_the_pass_they_share():
    """A 5-token pass equals five 1-token passes bit for bit, alone or next to another sequence."""
    model = int8_model(**SHAPES["llama GQA 6:1, head 32, odd widths"])
    prompt, more = list(range(1, 20)), [4, 8, 15, 16, 23]
    rows = {}
    for name in ("together", "one by one"):
        cache = KVCache.for_model(model.config, 2, 64, torch.float32)
        for s in (0, 1):
            run(model, cache, [s], [prompt], True)
            advance(cache, [s], [prompt])
        if name == "together":
            rows[name] = run(model, cache, [0, 1], [more, more[:2]], True)[0]
        else:
            steps = []
            for tok in more:
                steps.append(run(model, cache, [0], [[tok]], True)[0])
                advance(cache, [0], [[tok]])
            rows[name] = torch.cat(steps)
    assert torch.equal(rows["together"], rows["one by one"])


def test_a_wide_pass_runs_in_row_chunks_that_see_every_row_of_the_pass():
    """A pass wider than the decoder's row chunks (kernels/decoder.c CHUNK_ROWS): its first row needs
    keys that rows after it in the same pass write, and chunk edges fall inside rows. Its rows equal
    those of narrow passes run one piece at a time, bit for bit, and so do the caches."""
    model = int8_model(**SHAPES["llama GQA 6:1, head 32, odd widths"])
    tokens = [(7 * i) % 89 + 1 for i in range(150)]
    pieces = [(0, 100), (0, 0), (0, 50), (1, 0)]                    # (slot, start): 4 rows of 50 = 200 rows
    model.native_pass = True
    wide = KVCache.for_model(model.config, 2, 160, torch.float32)
    ids = torch.tensor([tokens[a:a + 50] for _, a in pieces])
    positions = torch.tensor([a for _, a in pieces])[:, None] + torch.arange(50)[None, :]
    together = model(ids, positions, wide.view([s for s, _ in pieces], positions))
    narrow = KVCache.for_model(model.config, 2, 160, torch.float32)
    alone = {}
    for s, a in sorted(pieces):
        alone[(s, a)] = run(model, narrow, [s], [tokens[a:a + 50]], True)[0]
        advance(narrow, [s], [tokens[a:a + 50]])
    for b, piece in enumerate(pieces):
        assert torch.equal(together[b], alone[piece]), piece
    assert torch.equal(wide.k[:, :, :150], narrow.k[:, :, :150]) and torch.equal(wide.v[:, :, :150], narrow.v[:, :, :150])


@pytest.mark.parametrize("kind", ["static", "paged"])
def test_a_pass_that_keeps_some_rows_gives_those_rows_and_the_cache_of_a_full_pass(kind):
    """`keep` (the rows a caller reads): the last layer's o_proj and MLP run on those rows alone. The
    kept rows equal a full pass's bit for bit and every key and value is written as before — for
    none kept (a prefill piece), rows packed near the front (a scatter back in the wrong order
    overwrites them), rows across the decoder's row chunks, and all."""
    model = int8_model(**SHAPES["llama GQA 6:1, head 32, odd widths"])
    model.native_pass = True
    tokens = [(11 * i) % 89 + 1 for i in range(180)]
    starts = [0, 60, 120]                                             # 3 pieces of 60: 180 rows > CHUNK_ROWS
    ids = torch.tensor([tokens[a:a + 60] for a in starts])
    positions = torch.tensor(starts)[:, None] + torch.arange(60)[None, :]
    slots = [0, 0, 0]

    def cache():
        if kind == "static":
            return KVCache.for_model(model.config, 1, 180, torch.float32)
        blocks = torch.randperm(46, generator=torch.Generator().manual_seed(1)).add(1).tolist()
        return PagedKVCache(model.config, num_blocks=47, block_size=4, dtype=torch.float32, block_tables={0: blocks})

    full_cache = cache()
    full = model(ids, positions, full_cache.view(slots, positions)).reshape(180, -1).clone()
    for keep in ([], [0], [1, 2, 3, 5, 8], [0, 59, 60, 71, 72, 119, 130, 179], list(range(180))):
        c = cache()
        out = model(ids, positions, c.view(slots, positions), keep=torch.tensor(keep, dtype=torch.long))
        assert torch.equal(out.reshape(180, -1)[keep], full[keep]), keep
        assert torch.equal(c.k, full_cache.k) and torch.equal(c.v, full_cache.v), keep
    for bad in ([5, 3], [4, 4], [180], [-1]):
        with pytest.raises(ValueError, match="ascending"):
            model(ids, positions, cache().view(slots, positions), keep=torch.tensor(bad))


def test_bf16_blocks_of_16_give_the_rows_of_one_contiguous_cache():
    """The one-row attention sweep reads 16-position blocks two at a time and keeps its sums across
    blocks; a paged bf16 cache of scattered 16- or 32-position blocks gives the hidden states of a
    static bf16 cache, bit for bit. (Odd block sizes pair positions within each block, so their
    last bits differ.)"""
    model = int8_model(**SHAPES["qwen2 GQA 7:1, head 128"])
    model.native_pass = True
    tokens = [(5 * i) % 89 + 1 for i in range(130)]
    out = {}
    for name in ("static", 16, 32):
        if name == "static":
            cache = KVCache.for_model(model.config, 1, 160, torch.float32, kv_dtype=torch.bfloat16)
        else:
            blocks = torch.randperm(12, generator=torch.Generator().manual_seed(name)).add(1).tolist()[:160 // name]
            cache = PagedKVCache(model.config, num_blocks=13, block_size=name, block_tables={0: blocks},
                                 kv_dtype=torch.bfloat16)
        rows = []
        for a, b in ((0, 60), (60, 120), (120, 121), (121, 126), (126, 130)):     # prefill, decode, verify
            rows.append(run(model, cache, [0], [tokens[a:b]], True)[0])
            advance(cache, [0], [tokens[a:b]])
        out[name] = torch.cat(rows)
    assert torch.equal(out[16], out["static"]) and torch.equal(out[32], out["static"])


def test_greedy_speculation_on_the_native_pass_equals_plain():
    target, draft = int8_model(0), int8_model(1, num_layers=1)
    prompts = [[1, 5, 9, 2, 7], [3, 3], [11, 4, 8, 15, 16, 23, 42, 8, 1]]
    params = SamplingParams(temperature=0, max_tokens=24)
    plain = [o.token_ids for o in LLM(target, proposer="none").generate(prompts, params)]
    assert target._native is not None                                        # the pass ran natively
    for k in (1, 3, 6):
        spec = LLM(target, draft=draft, proposer="draft", k=k).generate(prompts, params)
        assert [o.token_ids for o in spec] == plain


def test_a_row_dependent_pass_is_caught_by_the_identity_test(monkeypatch):
    """Broken on purpose: a pass whose rows shift with the pass width. Greedy speculative output then
    differs from plain — the check above can fail."""
    target = int8_model(0)
    prompts = [[1, 5, 9, 2, 7], [11, 4, 8, 15, 16, 23, 42, 8, 1]]
    params = SamplingParams(temperature=0, max_tokens=24)
    plain = [o.token_ids for o in LLM(target, proposer="none").generate(prompts, params)]
    honest, honest_pass = NativeDecoder.__call__, NativeDecoder.model_pass

    def broken(self, x, rotary, cache, keep=None):
        out = honest(self, x, rotary, cache, keep)
        return out if out is None or out.shape[1] == 1 else out * (1 + 0.5 * torch.randn(out.shape[-1]))

    def broken_pass(self, input_ids, rotary, cache, rows, head):
        out = honest_pass(self, input_ids, rotary, cache, rows, head)
        if out is None or input_ids.shape[1] == 1:
            return out
        logits, states = out
        return logits * (1 + 0.5 * torch.randn(logits.shape[-1])), states

    monkeypatch.setattr(NativeDecoder, "__call__", broken)
    monkeypatch.setattr(NativeDecoder, "model_pass", broken_pass)
    spec = LLM(target, draft=target, proposer="draft", k=4).generate(prompts, params)
    assert [o.token_ids for o in spec] != plain


def int4_embedded_model(seed: int = 0):
    """int4_mixed_model with its token embeddings in int4 too (`Int4Embedding`, as a Q4_K file's)."""
    from test_kernels import on_q4, on_q6
    from verispec.models.quant import round_to_q4

    model = tiny_model(seed, scale=1.5)
    fields = on_q4(model, lambda name, mod: name.endswith(("gate_up_proj", "o_proj")))
    fields |= on_q6(model, lambda name, mod: name.endswith(("down_proj", "lm_head")))
    table = model.model.embed_tokens.weight
    with torch.no_grad():
        fields["model.embed_tokens.weight"] = round_to_q4(table)
        table.copy_(fields["model.embed_tokens.weight"].dequantized())
    return quantize_linears(model, "int4", fields=fields)


@pytest.mark.parametrize("kind", ["int8, float embeddings", "int4 and int6, int4 embeddings"])
@pytest.mark.parametrize("paged_cache", [False, True])
def test_one_call_pass_gives_the_bits_of_the_separate_steps(kind, paged_cache, monkeypatch):
    """Embeddings, decoder layers, final norm and LM head in one native call (verispec_pass) give the
    logits, final-normed states and cache entries of the separate steps bit for bit: ragged rows read
    twice, the full head and a truncated vocabulary (37 tokens: a partial block of columns)."""
    from verispec.models.quant import Int4Embedding

    model = int8_model(3) if kind.startswith("int8") else int4_embedded_model(3)
    assert isinstance(model.model.embed_tokens, Int4Embedding) == kind.endswith("int4 embeddings")
    used = []
    honest = kernels.model_pass
    monkeypatch.setattr(kernels, "model_pass", lambda *a: used.append(1) or honest(*a))
    vocab = torch.tensor(sorted(torch.randperm(96, generator=torch.Generator().manual_seed(1))[:37].tolist()))
    out = {}
    for one_call in (True, False):
        if paged_cache:
            cache = PagedKVCache(model.config, num_blocks=40, block_size=4, block_tables={3: list(range(1, 20)),
                                 5: list(range(20, 39))}, dtype=torch.float32)
        else:
            cache = KVCache.for_model(model.config, 6, 80, torch.float32)
        if not one_call:
            monkeypatch.setattr(NativeDecoder, "model_pass", lambda *a: None)
        prompts = [list(range(1, 31)), list(range(40, 52))]
        run(model, cache, [3, 5], prompts, True)
        advance(cache, [3, 5], prompts)
        results = []
        for chunks, rows in (([[7], [9]], [[0], [0]]), ([[1, 2, 3, 4, 5], [6, 7]], [[0, 2, 4], [1, 1, 1]]),
                             ([[8, 9, 10], [11]], [[2]])):
            t = max(len(c) for c in chunks)
            ids = torch.tensor([c + [0] * (t - len(c)) for c in chunks])
            positions = torch.tensor([[cache.lengths[s] + j for j in range(t)] for s in (3, 5)])
            for v in (None, vocab):
                results.append(model.forward_logits(ids, positions, cache.view([3, 5], positions),
                                                    torch.tensor(rows), v))
            advance(cache, [3, 5], chunks)
        out[one_call] = (results, cache.k.clone(), cache.v.clone())
    assert len(used) == 6                                                    # every pass was one call
    for (logits, states), (logits2, states2) in zip(out[True][0], out[False][0]):
        assert torch.equal(logits, logits2) and torch.equal(states, states2)
    assert logits.shape == (1, 1, 37) and out[True][0][2][0].shape == (2, 3, 96)
    assert torch.equal(out[True][1], out[False][1]) and torch.equal(out[True][2], out[False][2])


def test_a_token_id_outside_the_embedding_table_is_refused_before_anything_is_written():
    model = int8_model()
    model.native_pass = True
    cache = KVCache.for_model(model.config, 1, 64, torch.float32)
    positions = torch.arange(4)[None]
    for bad in (96, -1):
        with pytest.raises(IndexError, match="token id"):
            model.forward_logits(torch.tensor([[3, 1, bad, 1]]), positions, cache.view([0], positions),
                                 torch.tensor([[3]]))
    assert cache.k.abs().sum() == 0 and cache.v.abs().sum() == 0
    decoder = NativeDecoder.build(model)
    for rows in ([[4]], [[0], [1]], [[-1]]):          # past the pass's tokens, past its batch, negative
        with pytest.raises(IndexError, match="row outside"):
            decoder.model_pass(torch.tensor([[3, 1, 4, 1]]), model.rotary, cache.view([0], positions),
                               torch.tensor(rows), model.lm_head)
    assert cache.k.abs().sum() == 0


@pytest.mark.parametrize("native", [True, False])
def test_a_pass_whose_positions_do_not_match_its_tokens_is_refused(native):
    """Positions shorter than the tokens would send the native pass past the end of their array."""
    model = int8_model()
    model.native_pass = native
    cache = KVCache.for_model(model.config, 1, 128, torch.float32)
    ids, positions = torch.ones(1, 64, dtype=torch.long), torch.arange(56)[None]
    with pytest.raises(ValueError, match="must both be"):
        model(ids, positions, cache.view([0], positions))
    assert cache.k.abs().sum() == 0                                          # nothing written


def test_a_position_past_the_rotary_table_is_refused_before_anything_is_written():
    """The kernel reads each row's angles at its position: a table too short for one is an error, with
    the hidden states and the cache untouched."""
    model = int8_model()
    decoder = NativeDecoder.build(model)
    cache = KVCache.for_model(model.config, 1, 64, torch.float32)
    positions = torch.arange(10, 14)[None]
    x = model.model.embed_tokens(torch.tensor([[3, 1, 4, 1]]))
    before = x.clone()
    cos, sin = model.rotary.table(int(positions.max()) + 1, positions.device)
    with pytest.raises(IndexError, match="rotary table"):
        kernels.decoder(x, decoder.weights, decoder.dims, cos[:12].contiguous(), sin[:12].contiguous(), positions,
                        cache.view([0], positions).layout())
    assert torch.equal(x, before) and cache.k.abs().sum() == 0
    with pytest.raises(ValueError, match="tables"):
        kernels.decoder(x, decoder.weights, decoder.dims, cos[:, :-1], sin, positions,
                        cache.view([0], positions).layout())

def test_models_that_do_not_qualify_keep_the_torch_layers():
    assert NativeDecoder.build(tiny_model(0)) is None                         # fp32 weights
    int4ish = int8_model()
    int4ish.model.layers[0].mlp.down_proj = torch.nn.Linear(128, 64, bias=False)
    assert NativeDecoder.build(int4ish) is None                              # one layer not int8


def test_every_kernel_variant_gives_the_same_native_pass():
    """The decoder pass built for each instruction set this CPU runs gives the same result, to float
    rounding (attention sums in 16 lanes on AVX-512, 8 on AVX2); each is row-exact on its own."""
    names = kernels.supported_variants()
    if len(names) < 2:
        pytest.skip(f"this CPU runs only {names}: nothing to compare")
    model = int8_model(**SHAPES["qwen2 GQA 7:1, head 128"])
    decoder = NativeDecoder.build(model)
    outs = []
    for name in names:
        cache = KVCache.for_model(model.config, 2, 64, torch.float32)
        run(model, cache, [1], [list(range(1, 21))], False)
        advance(cache, [1], [list(range(1, 21))])
        positions = torch.arange(20, 24)[None]
        x = model.model.embed_tokens(torch.tensor([[3, 1, 4, 1]]))
        cos, sin = model.rotary.table(int(positions.max()) + 1, positions.device)      # (P, D) each
        view = cache.view([1], positions)
        kernels.load_variant(name).decoder(x, decoder.weights, decoder.dims, cos, sin, positions, view.layout())
        outs.append((x, cache.k.clone()))
    for x, k in outs[1:]:
        torch.testing.assert_close(x, outs[0][0], rtol=1e-3, atol=1e-3 * outs[0][0].abs().max().item())
        torch.testing.assert_close(k, outs[0][1], rtol=1e-3, atol=1e-3 * outs[0][1].abs().max().item())


def int4_mixed_model(seed: int = 0, **kw):
    """int4 where the file would hold Q4_K fields (gate/up and o here), int6 where it would hold Q6_K
    (down and the LM head), int8 elsewhere."""
    from test_kernels import on_q4, on_q6

    model = tiny_model(seed, scale=1.5, **kw)
    fields = on_q4(model, lambda name, mod: name.endswith(("gate_up_proj", "o_proj")))
    fields |= on_q6(model, lambda name, mod: name.endswith(("down_proj", "lm_head")))
    return quantize_linears(model, "int4", fields=fields)


def test_native_pass_runs_int4_layers_like_the_torch_layers():
    from verispec.models.quant import Int4Linear, Int6Linear

    model = int4_mixed_model()
    formats = {type(m).__name__ for m in model.modules() if type(m).__name__.endswith("Linear")}
    assert {"Int4Linear", "Int6Linear", "Int8Linear"} <= formats and NativeDecoder.build(model) is not None
    assert isinstance(model.model.layers[0].mlp.gate_up_proj, Int4Linear)
    assert isinstance(model.model.layers[0].mlp.down_proj, Int6Linear)
    caches = {n: KVCache.for_model(model.config, 2, 128, torch.float32) for n in (True, False)}
    prompts = [list(range(1, 71)), list(range(20, 90))]
    for native, cache in caches.items():
        run(model, cache, [0, 1], prompts, native)
        advance(cache, [0, 1], prompts)
    for chunks in ([[5], [7]], [[1, 2, 3, 4, 5], [9, 8]]):
        out = {n: run(model, c, [0, 1], chunks, n) for n, c in caches.items()}
        # The two passes differ in RMSNorm's last bits; an int4 linear rounds its activations to 8 bits
        # per group, so such a difference can move a rounding by one step (~0.4 % of the group's
        # largest value) — the outputs agree in norm, not element by element.
        assert (out[True] - out[False]).norm() < 1e-2 * out[False].norm()
        for c in caches.values():
            advance(c, [0, 1], chunks)


def test_greedy_speculation_with_int4_layers_equals_plain():
    target, draft = int4_mixed_model(0), int4_mixed_model(1, num_layers=1)
    prompts = [[1, 5, 9, 2, 7], [3, 3], [11, 4, 8, 15, 16, 23, 42, 8, 1]]
    params = SamplingParams(temperature=0, max_tokens=24)
    plain = [o.token_ids for o in LLM(target, proposer="none").generate(prompts, params)]
    assert target._native is not None
    for k in (2, 5):
        spec = LLM(target, draft=draft, proposer="draft", k=k).generate(prompts, params)
        assert [o.token_ids for o in spec] == plain
