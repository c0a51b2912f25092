"""KV cache formats (`kv_dtype`): int8 with one scale per position and head, bfloat16. The native pass
reads and writes int8 and bfloat16 blocks in place like the torch layers; rows stay independent of the
pass they share, so greedy speculation still equals plain decoding; int8 and bfloat16 cost little against
the float cache (and a deliberately mis-scaled int8 cache, or bf16 values paired with the wrong weights,
are caught by that comparison); capacity per MiB is ≥ 3.5x (int8) and 2x (bfloat16)."""

from __future__ import annotations

import pytest
import torch

from conftest import advance, int8_model, tiny_model
from conftest import run_pass as run
from verispec import LLM, SamplingParams, kernels
from verispec.models import KVCache, kv_cache
from verispec.models.paged_cache import PagedKVCache

native_only = pytest.mark.skipif(not kernels.available(), reason=f"native kernel {kernels.kernel_status()}")


def test_kv_quantize_rounds_per_group_of_32():
    x = torch.tensor([[0.5, -1.0, 0.25, 0.0], [0.0, 0.0, 0.0, 0.0]])
    q, scale = kv_cache.kv_quantize(x)                                         # a head of 4: one group
    assert q.tolist() == [[64, -127, 32, 0], [0, 0, 0, 0]]                   # 63.5 -> 64 (ties to even), 31.75 -> 32
    assert torch.allclose(scale, torch.tensor([[1.0 / 127], [0.0]]))
    wide = torch.cat([torch.full((32,), 0.01), torch.full((32,), 100.0)])[None]    # a head of 64: two groups
    q, scale = kv_cache.kv_quantize(wide)
    assert scale.shape == (1, 2) and (q == 127).all()                          # the small group keeps its precision


HEADS = {"head 32, one scale group": dict(arch="llama", hidden_size=96, num_heads=6, num_kv_heads=1, head_dim=32,
                                          intermediate_size=200, num_layers=3),
         "head 128, four scale groups": dict(arch="qwen2", hidden_size=112, num_heads=7, num_kv_heads=1,
                                             head_dim=128, intermediate_size=160)}


def make_cache(model, kind: str, kv: torch.dtype):
    """(a cache factory, two slots): static, or paged in blocks of 4 or 5 positions (bf16 attention pairs
    positions from each block's start)."""
    if kind == "static":
        return (lambda: KVCache.for_model(model.config, 3, 128, torch.float32, kv_dtype=kv)), [0, 2]
    tables, block = {7: list(range(1, 21)), 8: list(range(42, 21, -1))}, 4 if kind == "paged" else 5
    return (lambda: PagedKVCache(model.config, 48, block, tables, torch.float32, kv_dtype=kv)), [7, 8]


@native_only
@pytest.mark.parametrize("kv", [torch.int8, torch.bfloat16])
@pytest.mark.parametrize("head", list(HEADS))
@pytest.mark.parametrize("kind", ["static", "paged", "paged, odd blocks"])
def test_native_pass_reads_and_writes_quantized_caches_like_the_torch_layers(kind, head, kv):
    model = int8_model(**HEADS[head])
    make, slots = make_cache(model, kind, kv)
    caches = {n: make() for n in (True, False)}
    assert caches[True].view(slots, torch.zeros(2, 1, dtype=torch.long)).layout() is not None   # read natively
    prompts = [list(range(1, 70)), list(range(10, 76))]                        # torch prefill (> 65 tokens)
    for native, cache in caches.items():
        for s, p in zip(slots, prompts):
            run(model, cache, [s], [p], native)
            advance(cache, [s], [p])
    # The native pass's bf16 dot products (AVX512_BF16) round the query and the softmax weights to bf16,
    # where the torch layers multiply in float32: a few per cent apart on this model (measured 2 %).
    dot_bf16 = kv == torch.bfloat16 and kernels.builds_with(kernels.active_variant(), "avx512bf16")
    for chunks in ([[5], [7]], [[1, 2, 3], [9, 8, 7]]):
        out = {n: run(model, c, slots, chunks, n) for n, c in caches.items()}
        assert (out[True] - out[False]).norm() < (4e-2 if dot_bf16 else 1e-2) * out[False].norm()
        for c in caches.values():
            advance(c, slots, chunks)
    assert caches[True].k.dtype == kv
    written = (caches[True].k != 0).sum().item()
    assert written > 0 and abs(written - (caches[False].k != 0).sum().item()) < 0.01 * written
    if kv == torch.int8:
        assert (caches[True].store.ks - caches[False].store.ks).abs().max() < 1e-2 * caches[False].store.ks.abs().max()


@native_only
@pytest.mark.parametrize("kv", [torch.int8, torch.bfloat16])
@pytest.mark.parametrize("kind", ["static", "paged, odd blocks"])
def test_quantized_cache_rows_do_not_depend_on_the_pass_they_share(kind, kv):
    """A 5-token pass equals five 1-token passes bit for bit on an int8 or bf16 cache (native pass)."""
    model = int8_model(**HEADS["head 128, four scale groups"])
    prompt, more = list(range(1, 20)), [4, 8, 15, 16, 23]
    rows = {}
    for name in ("together", "one by one"):
        cache = make_cache(model, kind, kv)[0]()
        slot = 0 if kind == "static" else 7
        run(model, cache, [slot], [prompt], True)
        advance(cache, [slot], [prompt])
        if name == "together":
            rows[name] = run(model, cache, [slot], [more], True)[0]
        else:
            outs = []
            for t in more:
                outs.append(run(model, cache, [slot], [[t]], True)[0, 0])
                advance(cache, [slot], [[t]])
            rows[name] = torch.stack(outs)
    assert torch.equal(rows["together"], rows["one by one"])


@pytest.mark.parametrize("fmt,kv", [("int8", "int8"), ("int8", "bfloat16"), ("float32", "int8"), ("float32", "bfloat16")])
def test_greedy_speculation_equals_plain_on_every_kv_format(fmt, kv):
    """int8 weights run the native pass (int8 and bf16 keys read in place); float32 weights the torch layers."""
    make = int8_model if fmt == "int8" else (lambda seed, **kw: tiny_model(seed, **kw))
    target, draft = make(0), make(1, num_layers=1)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9, 5, 6, 7], list(range(10, 40)), [3, 1, 4, 1, 5, 9, 2, 6]]
    plain = [o.token_ids for o in LLM(target, proposer="none", kv_dtype=kv).generate(prompts, params)]
    for llm in (LLM(target, draft=draft, proposer="draft", k=3, kv_dtype=kv), LLM(target, proposer="ngram", k=5,
                                                                                    kv_dtype=kv)):
        assert [o.token_ids for o in llm.generate(prompts, params)] == plain


def logits_over(model, ids: list[int], kv_dtype) -> torch.Tensor:
    """Next-token logits at every position of ids, fed one token at a time (decode passes)."""
    cache = KVCache.for_model(model.config, 1, len(ids) + 1, torch.float32, kv_dtype=kv_dtype)
    out = []
    for i, t in enumerate(ids):
        pos = torch.tensor([[i]])
        out.append(model.logits(model(torch.tensor([[t]]), pos, cache.view([0], pos)), torch.tensor([[0]]))[0, 0])
        cache.set_length(0, i + 1)
    return torch.stack(out)


def test_int8_cache_stays_close_to_the_float_cache_and_a_mis_scaled_one_does_not(monkeypatch):
    model = tiny_model(0)
    ids = [(7 * i + 3) % 96 for i in range(60)]
    ref = torch.log_softmax(logits_over(model, ids, None), -1)

    def agreement_and_kl():
        got = torch.log_softmax(logits_over(model, ids, torch.int8), -1)
        return (ref.argmax(-1) == got.argmax(-1)).float().mean().item(), (ref.exp() * (ref - got)).sum(-1).mean().item()

    top1, kl = agreement_and_kl()
    assert top1 >= 0.95 and kl < 5e-3                                         # measured: 0.983, 0.0004
    real = kv_cache.kv_quantize
    monkeypatch.setattr(kv_cache, "kv_quantize", lambda x: (lambda q, s: (q, s * 0.9))(*real(x)))   # scales 10 % off
    top1, kl = agreement_and_kl()
    assert top1 < 0.95 or kl > 5e-3                                           # measured: 0.80, 0.026


@native_only
def test_native_bf16_cache_stays_close_to_the_float_cache():
    """The native pass on a bf16 cache (with bf16 dot products where the CPU has them) against the same
    model on a float32 cache: closer than the int8 cache (measured on this model: top-1 0.95–0.98 and KL
    0.0012 with bf16 dot products, 0.97 and 0.0005–0.0009 widened to float32; int8 0.92 and 0.007)."""
    model = int8_model(**HEADS["head 128, four scale groups"])
    ids = [(7 * i + 3) % 96 for i in range(60)]
    ref = torch.log_softmax(logits_over(model, ids, None), -1)
    got = torch.log_softmax(logits_over(model, ids, torch.bfloat16), -1)
    top1 = (ref.argmax(-1) == got.argmax(-1)).float().mean().item()
    kl = (ref.exp() * (ref - got)).sum(-1).mean().item()
    assert top1 >= 0.93 and kl < 3e-3


def test_int8_cache_holds_over_three_and_a_half_times_the_sequences_per_mib():
    """At the embedded pair's head sizes (64 and 128; a scale per head vector costs 4 bytes)."""
    for kw in (dict(head_dim=64, num_heads=4, num_kv_heads=2, hidden_size=128),
               dict(hidden_size=112, num_heads=7, num_kv_heads=1, head_dim=128, intermediate_size=160)):
        model = tiny_model(0, **kw)
        llm = LLM(model, proposer="none")
        blocks = {kv: LLM(model, proposer="none", kv_dtype=kv).engine(kv_budget_mb=8).pool.usable
                  for kv in ("float32", "bfloat16", "int8")}
        assert blocks["int8"] >= 3.5 * blocks["float32"] and blocks["bfloat16"] >= 1.99 * blocks["float32"]
        assert llm.engine(kv_budget_mb=8).pool.usable == blocks["float32"]     # auto: the model's dtype


def test_auto_stores_bf16_where_the_native_pass_reads_it():
    """`auto`: bfloat16 for a model the native pass runs (int8 weights on the CPU with the kernels), the
    model's own dtype for one the torch layers run (they would convert a bf16 cache at every layer)."""
    assert LLM(tiny_model(0), proposer="none").kv_dtype is None
    expected = torch.bfloat16 if kernels.available() else None
    assert LLM(int8_model(0), proposer="none").kv_dtype == expected
    assert LLM(int8_model(0), proposer="none", kv_dtype="float32").kv_dtype == torch.float32


@pytest.mark.parametrize("block", [5, 16, 40])
def test_bf16_store_keeps_positions_in_the_paired_layout_the_kernels_read(block):
    """A bf16 store written at scattered positions reads back position by position (bf16 of what was
    written); its words sit where kernels.h's bf16_key_at / bf16_value_at say; a copy moves positions."""
    from verispec.kernels.abi import KV_KEY_GROUP
    from verispec.models.kv_cache import KVStore

    torch.manual_seed(block)
    store = KVStore((2, 3, 2, block, 8), torch.bfloat16, "cpu")
    assert store.k.shape[3] % KV_KEY_GROUP == 0 and store.k.shape[3] >= block
    i, j = torch.tensor([[0], [2]]), torch.tensor([[block - 1, 0, 3 % block], [1, block - 2, 2]])
    k, v = torch.randn(2, 2, 3, 8), torch.randn(2, 2, 3, 8)               # (B, H_kv, T, D)
    store.write(1, i, j, k, v)
    keys, values = store.read(1, slice(None), torch.float32, block)        # (N, H_kv, S, D)
    for b in range(2):
        for t in range(3):
            assert torch.equal(keys[i[b, 0], :, j[b, t]], k[b, :, t].bfloat16().float())
            assert torch.equal(values[i[b, 0], :, j[b, t]], v[b, :, t].bfloat16().float())
    flat_k, flat_v = store.k[1, 2, 1].flatten(), store.v[1, 2, 1].flatten()   # slot 2, KV head 1
    pos, d = 1, 5
    key_at = 2 * ((pos // 16) * 4 * 16 + (d // 2) * 16 + pos % 16) + d % 2     # bf16_key_at(j, d, D = 8)
    value_at = 2 * ((pos // 2) * 8 + d) + pos % 2                              # bf16_value_at
    assert flat_k[key_at] == k[1, 1, 0, d].bfloat16() and flat_v[value_at] == v[1, 1, 0, d].bfloat16()
    store.copy((torch.tensor([2]), torch.tensor([1])), (torch.tensor([1]), torch.tensor([block - 1])))
    keys, values = store.read(1, slice(None), torch.float32, block)
    assert torch.equal(keys[1, :, block - 1], k[1, :, 0].bfloat16().float())
    assert torch.equal(values[1, :, block - 1], v[1, :, 0].bfloat16().float())
