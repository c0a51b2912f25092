"""Two heads files side by side: wall-clock speedup over plain decoding and first-draft acceptance.

    python docs/measure_heads.py HEADS_A HEADS_B [--categories code_writing,explanation,code_editing]
                                 [--repeats 3] [--max-tokens 64] [--out FILE.json]

Each file drafts with `--proposer head` at K = auto and at a fixed K (1 for Medusa heads, 3 for an
EAGLE-style head); every mode and plain decoding run the same bundled-suite prompts, greedy,
interleaved prompt by prompt (the order reversed on alternate prompts) in one process. speedup =
the median over prompts and repeats of plain's wall time / the mode's on the same prompt.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from verispec import LLM, SamplingParams
from verispec.kernels import machine
from verispec.bench.suites import load_suite
from verispec.engine.loading import load_model
from verispec.heads import EagleHead, load_heads


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("heads", nargs=2)
    ap.add_argument("--categories", default="code_writing,explanation,code_editing")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    target = load_model("qwen2.5-coder-1.5b-instruct", "auto", "cpu")
    prompts = [p for p in load_suite(None) if p.category in args.categories.split(",")]
    modes = {"plain": LLM(target, proposer="none")}
    for path in args.heads:
        kind = "eagle" if isinstance(load_heads(path, target.config.hidden_size, target.config.vocab_size),
                                     EagleHead) else "medusa"
        for k in ("auto", 3 if kind == "eagle" else 1):
            modes[f"{kind} k={k} ({path.rsplit('/', 1)[-1]})"] = LLM(target, proposer="head", head=path, k=k)
    texts = [p.render(modes["plain"]) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    for llm in modes.values():                       # warm-up
        llm.generate([texts[0]], SamplingParams(temperature=0, max_tokens=4))
    ratios: dict = {}
    first: dict = {}
    for rep in range(args.repeats):
        for i, (p, text) in enumerate(zip(prompts, texts)):
            order = list(modes) if (rep + i) % 2 == 0 else list(reversed(modes))
            wall = {}
            for name in order:
                t = time.perf_counter()
                out = modes[name].generate([text], params)[0]
                wall[name] = time.perf_counter() - t
                acc = out.spec.get("per_position_acceptance") if name != "plain" else None
                if acc:
                    first.setdefault((p.category, name), []).append(acc[0])
            for name in modes:
                if name != "plain":
                    ratios.setdefault((p.category, name), []).append(wall["plain"] / wall[name])
    rows = []
    for (cat, name), r in sorted(ratios.items()):
        a = first.get((cat, name), [0.0])
        rows.append({"category": cat, "mode": name, "speedup": round(statistics.median(r), 3),
                     "first_acceptance": round(statistics.mean(a), 3)})
        print(f"{cat:14s} {name:60s} {statistics.median(r):.2f}x  first-draft acceptance {statistics.mean(a):.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"environment": machine(), "args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
