"""How the draft model agrees with the target along an answer, and what `auto` makes of it.

    python docs/measure_draft_agreement.py [--mtbench 20] [--humaneval 20] [--max-tokens 128] [--out FILE]

The 1.5B (default format) answers the bundled suite's prompts and a fixed sample of MT-Bench first turns and of
HumanEval prompts greedily (bench.suites.load_suite's seeded sample; both need requirements/datasets.txt; 0 leaves
a set out). The 0.5B draft, in its default format
and vocabulary, then reads each prompt and answer once; at each answer token it agrees when its own greedy
choice after the text before it is that token (bench/replay.py: draft_agreement). Printed and kept:
- agreement overall, and after runs of 1, 2, 3 … misses and hits (do misses cluster?);
- the draft alone replayed on that agreement through the K policy with each kind of machine's fixed costs
  (bench/replay.py: replay_draft), with the draft's acceptance settling at MODEL_EMA and, for comparison,
  at the lookups' EMA: the accounted speedup over plain decoding, and the rounds left at K = 0.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

from verispec import LLM
from verispec.bench import replay
from verispec.bench.run import environment, machine_line
from verispec.bench.settings import applied
from verispec.bench.suites import load_suite
from verispec.engine import acceptance_rates
from verispec.engine.cost_model import STATIC_AVX2, STATIC_AVX512, STATIC_AVXVNNI
from verispec.engine.ema import EMA

PROFILES = {"avx512": STATIC_AVX512, "avxvnni": STATIC_AVXVNNI, "avx2": STATIC_AVX2}
LONGEST_RUN = 6          # runs this long or longer are counted together


def after_runs(agreements: list[list[bool]]) -> dict[str, list[int]]:
    """'after n misses' / 'after n hits' (n up to LONGEST_RUN, the run just before the token) -> [tokens,
    agreeing]; an answer's first token counts under 'first'."""
    seen, agreed = Counter(), Counter()
    for agree in agreements:
        for t, a in enumerate(agree):
            run = 0
            while run < min(t, LONGEST_RUN) and agree[t - 1 - run] == agree[t - 1]:
                run += 1
            key = "first" if t == 0 else f"after {run}{'+' if run == LONGEST_RUN else ''} {'hits' if agree[t - 1] else 'misses'}"
            seen[key] += 1
            agreed[key] += a
    return {k: [seen[k], agreed[k]] for k in sorted(seen)}


def count(least: int):
    """An argparse type: an integer ≥ least, refused with a message before anything is loaded."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"{value} is below {least}")
        return value
    return parse


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mtbench", type=count(0), default=20, help="MT-Bench first turns (0: none)")
    ap.add_argument("--humaneval", type=count(0), default=20, help="HumanEval prompts (0: none)")
    ap.add_argument("--max-tokens", type=count(1), default=128)
    ap.add_argument("--out", help="write the numbers as JSON here")
    args = ap.parse_args()

    llm = LLM()
    prompts = load_suite(None) + [p for name in ("mtbench", "humaneval") if getattr(args, name)
                                  for p in load_suite(name, limit=getattr(args, name))]
    answers = replay.record(llm, prompts, args.max_tokens)
    agreements = replay.draft_agreement(llm.draft.model, answers, llm.draft_vocab, llm.kv_dtype)

    env = environment()
    print(machine_line(env))
    flat = [a for agree in agreements for a in agree]
    print(f"{len(answers)} answers, {len(flat)} tokens: the draft agrees at {sum(flat) / len(flat):.3f}")
    runs = after_runs(agreements)
    for key, (n, k) in runs.items():
        print(f"  {key:16s} {n:5d} tokens  {k / n:.3f}")
    by_category = {}
    for a, agree in zip(answers, agreements):
        n, k = by_category.get(a.category, (0, 0))
        by_category[a.category] = (n + len(agree), k + sum(agree))

    replayed = {}
    emas = {"MODEL_EMA": acceptance_rates.MODEL_EMA, "EMA": EMA}
    print("the draft alone, replayed (accounted speedup; rounds at K = 0):")
    for kind, costs in PROFILES.items():
        for label, ema in emas.items():
            with applied((("verispec.engine.acceptance_rates.MODEL_EMA", ema),)):
                got = replay.replay_draft(answers, agreements, costs)
            replayed[f"{kind}, {label} {ema}"] = {cat: {"speedup": r.speedup, "rounds": r.rounds,
                                                         "plain_rounds": r.rounds - r.speculative}
                                                   for cat, r in got.items()}
            r = got["all"]
            cats = ", ".join(f"{c} {x.speedup:.3f}" for c, x in sorted(got.items()) if c != "all")
            print(f"  {kind:8s} {label} {ema}: {r.speedup:.3f}x, {r.rounds - r.speculative} of {r.rounds} rounds "
                  f"({cats})")

    if args.out:
        Path(args.out).write_text(json.dumps({
            "command": " ".join(["python", "docs/measure_draft_agreement.py", *sys.argv[1:]]),
            "environment": env, "answers": len(answers), "tokens": len(flat), "agreement": sum(flat) / len(flat),
            "by_category": {c: k / n for c, (n, k) in sorted(by_category.items())},
            "after_runs": runs, "replayed": replayed}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
