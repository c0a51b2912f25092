"""Weight formats of the embedded pair: plain decode speed, quality against fp32, peak memory.

    python docs/measure_formats.py [--out docs/results/formats.json]

- decode tok/s: plain greedy decoding, 64 new tokens after a chat prompt, prefill excluded,
  median of 5 runs after one warm-up (`RequestOutput.tokens_per_s`), the formats alternated;
- load: seconds to `LLM(...)` the format, its cache file already written (a first load, untimed, writes it
  on a machine's first use of the format);
- quality: top-1 agreement and mean KL(fp32 ‖ format) of the next-token distributions at every
  position of a fixed 150-token text (code and prose);
- KV cache formats (default weights, `--kv-dtype`): quality against the float32 cache, decode
  speed after a ~2,000-token prompt (alternated), positions per GiB;
- peak RSS: a fresh process loads the pair (1.5B target + 0.5B draft) in the format (`default`: the
  target in int4, the draft in int4-all, as with no flags) and generates 32 tokens with the draft proposer; its peak resident set size (VmHWM — not ru_maxrss, which
  Linux carries over from the parent across fork + exec);
- read bandwidth: a torch sum over 1 GiB of float32 with the run's threads, median of 5 — the floor the
  page divides each format's bytes per token by.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
FORMATS = ["float32", "bfloat16", "int8", "int4", "int4-all"]
PROMPT = "Write a Python function that checks whether a number is prime."
TEXT = '''def merge_intervals(intervals):
    """Merge overlapping intervals and return them sorted by start."""
    if not intervals:
        return []
    intervals = sorted(intervals, key=lambda pair: pair[0])
    merged = [list(intervals[0])]
    for start, end in intervals[1:]:
        if start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged

Speculative decoding lets a small model propose tokens that a large model verifies in one pass.
The output distribution is exactly the large model's, because rejected proposals are resampled
from the residual distribution max(0, p - q), normalised.'''


def decode_speeds(name: str, rounds: int = 5) -> dict:
    """Every format loaded side by side, then `rounds` rounds of one 64-token run each, the formats'
    order rotating every round: the machine's drift (its speed moves by ±20 % over minutes) hits
    every format alike instead of whichever ran during a slow minute."""
    from verispec import LLM, SamplingParams

    llms, load = {}, {}
    for fmt in FORMATS:
        LLM(name, proposer="none", dtype=fmt)    # a machine's first use of a format writes its cache file: not timed
        t = time.perf_counter()
        llms[fmt] = LLM(name, proposer="none", dtype=fmt)
        load[fmt] = time.perf_counter() - t
    prompt = llms[FORMATS[0]].chat_prompt([{"role": "user", "content": PROMPT}])
    for llm in llms.values():
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8))
    rates: dict[str, list[float]] = {fmt: [] for fmt in FORMATS}
    for r in range(rounds):
        for fmt in FORMATS[r % len(FORMATS):] + FORMATS[:r % len(FORMATS)]:
            out = llms[fmt].generate([prompt], SamplingParams(temperature=0, max_tokens=64))[0]
            rates[fmt].append(out.tokens_per_s)
    return {fmt: {"load_s": round(load[fmt], 2), "tok_s_runs": [round(x, 2) for x in rates[fmt]],
                  "tok_s": round(statistics.median(rates[fmt]), 2), "step_mb": step_mb(llms[fmt].target.model)}
            for fmt in FORMATS}


def step_mb(model) -> float:
    """MB of weights a decode step reads: every linear's buffers (the LM head included; the token table
    is read a row at a time)."""
    from torch import nn

    total = 0
    for name, mod in model.named_modules():
        if name.endswith("embed_tokens") or not (isinstance(mod, nn.Linear) or type(mod).__name__.endswith("Linear")):
            continue
        total += sum(t.numel() * t.element_size() for t in (*mod.parameters(recurse=False), *mod.buffers(recurse=False)))
    return round(total / 1e6, 1)


def all_logits(model, ids):
    from verispec.models import KVCache

    t = ids.shape[1]
    cache = KVCache.for_model(model.config, 1, t, model.dtype)
    pos = torch.arange(t)[None]
    return model.logits(model(ids, pos, cache.view([0], pos)), pos)[0].float()      # (T, V)


def quality(name: str) -> dict:
    from verispec.engine.loading import load_model

    ref = load_model(name, dtype="float32")
    ids = torch.tensor([ref.tokenizer.encode(TEXT)])
    base = torch.log_softmax(all_logits(ref.model, ids), -1)
    del ref
    out = {}
    for fmt in FORMATS[1:]:
        other = torch.log_softmax(all_logits(load_model(name, dtype=fmt).model, ids), -1)
        out[fmt] = {"positions": ids.shape[1],
                    "top1_agreement": round((base.argmax(-1) == other.argmax(-1)).float().mean().item(), 4),
                    "mean_kl": round((base.exp() * (base - other)).sum(-1).mean().item(), 5)}
    return out


def kv_formats(name: str, rounds: int = 5) -> dict:
    """The default weights with each KV cache format: quality against the float32 cache (the same
    150-token text, in passes as long as the engine's exact prefill passes, so that the native pass and
    its attention score it as they score a decode step), decode speed after a long prompt (alternated,
    like decode_speeds) and positions per GiB of cache."""
    from verispec import LLM, SamplingParams
    from verispec.engine.loading import load_model
    from verispec.models import KVCache
    from verispec.models.kv_cache import KV_DTYPES, KVStore

    loaded = load_model(name)
    ids = torch.tensor([loaded.tokenizer.encode(TEXT)])
    t = ids.shape[1]
    pos = torch.arange(t)[None]

    def logits(kv_dtype):
        model = loaded.model
        cache = KVCache.for_model(model.config, 1, t, torch.float32, kv_dtype=kv_dtype)
        step = model.exact_pass_rows(cache.store) or t
        out = []
        for s in range(0, t, step):
            p = pos[:, s:s + step]
            out.append(model.logits(model(ids[:, s:s + step], p, cache.view([0], p)), p - s)[0].float())
            cache.set_length(0, s + p.shape[1])
        return torch.log_softmax(torch.cat(out), -1)

    base = logits(None)
    llms = {kv: LLM(loaded, proposer="none", kv_dtype=kv) for kv in ("float32", "int8", "bfloat16")}
    prompt = llms["float32"].chat_prompt([{"role": "user", "content": "Summarise this code:\n\n" + TEXT * 12}])
    rates: dict[str, list[float]] = {kv: [] for kv in llms}
    for llm in llms.values():
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4))
    for r in range(rounds):
        order = list(llms)[r % len(llms):] + list(llms)[:r % len(llms)]
        for kv in order:
            llms[kv].clear_prefix_cache()
            rates[kv].append(llms[kv].generate([prompt], SamplingParams(temperature=0, max_tokens=48))[0].tokens_per_s)
    out = {"prompt_tokens": len(llms["float32"].encode(prompt))}
    for kv in llms:
        other = logits(KV_DTYPES[kv])
        out[kv] = {"top1_agreement": round((base.argmax(-1) == other.argmax(-1)).float().mean().item(), 4),
                   "mean_kl": round((base.exp() * (base - other)).sum(-1).mean().item(), 6),
                   "positions_per_gib": int(2**30 // KVStore.bytes_per_position(loaded.model.config, KV_DTYPES[kv])),
                   "tok_s_runs": [round(x, 2) for x in rates[kv]], "tok_s": round(statistics.median(rates[kv]), 2)}
    return out


def peak_rss_child(fmt: str) -> None:
    from verispec import LLM, SamplingParams

    formats = {} if fmt == "default" else {"dtype": fmt, "draft_dtype": fmt}      # default: int4 + int4-all draft
    llm = LLM(TARGET, draft=DRAFT, proposer="draft", k=4, **formats)
    llm.generate([llm.chat_prompt([{"role": "user", "content": PROMPT}])], SamplingParams(temperature=0, max_tokens=32))
    hwm = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("VmHWM:"))
    print(json.dumps({"peak_rss_mb": round(int(hwm.split()[1]) / 1024, 1)}))


def peak_rss(fmt: str) -> float:
    out = subprocess.run([sys.executable, __file__, "--rss-child", fmt], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_rss_mb"]


def read_bandwidth(repeats: int = 5) -> float:
    """GB/s of a torch sum over 1 GiB (float32), median of `repeats` after one warm-up."""
    x = torch.ones(2**28)
    x.sum()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t0)
    return round(2**30 / statistics.median(times) / 1e9, 1)


def update(out: Path, key: str, value) -> None:
    """Writes one re-measured part into an existing results file (the --*-only options)."""
    result = json.loads(out.read_text())
    result[key] = value
    print(key, json.dumps(value), flush=True)
    out.write_text(json.dumps(result, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="docs/results/formats.json")
    ap.add_argument("--rss-child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--rss-only", action="store_true", help="only re-measure peak RSS into an existing --out file")
    ap.add_argument("--kv-only", action="store_true", help="only (re-)measure the KV cache formats into --out")
    ap.add_argument("--bandwidth-only", action="store_true", help="only (re-)measure the read bandwidth into --out")
    args = ap.parse_args()
    if args.rss_child:
        peak_rss_child(args.rss_child)
        return
    if (args.kv_only or args.bandwidth_only or args.rss_only) and not Path(args.out).is_file():
        sys.exit(f"{args.out} not found: the --*-only options update a file that a full run wrote")
    if args.kv_only:
        update(Path(args.out), "kv_cache", {TARGET: kv_formats(TARGET)})
        return
    if args.bandwidth_only:
        update(Path(args.out), "read_gb_s", read_bandwidth())
        return
    if args.rss_only:
        update(Path(args.out), "pair_peak_rss_mb", {fmt: peak_rss(fmt) for fmt in [*FORMATS, "default"]})
        return
    from verispec.bench.run import environment

    result = {"command": " ".join(["python docs/measure_formats.py", *sys.argv[1:]]), "environment": environment(), "models": {},
              "read_gb_s": read_bandwidth()}
    for name in (DRAFT, TARGET):
        entry = decode_speeds(name)
        for fmt, q in quality(name).items():
            entry[fmt] |= q
        result["models"][name] = entry
        print(name, json.dumps(entry), flush=True)
    result["pair_peak_rss_mb"] = {fmt: peak_rss(fmt) for fmt in [*FORMATS, "default"]}
    print("peak RSS", result["pair_peak_rss_mb"], flush=True)
    result["kv_cache"] = {TARGET: kv_formats(TARGET)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
