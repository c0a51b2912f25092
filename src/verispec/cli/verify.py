"""`verispec verify`: certify on your machine and models that speculation samples the target."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from verispec.cli import invocation
from verispec.cli.generate import add_model_args, build_llm
from verispec.errors import VerispecError


def add_parser(sub) -> None:
    p = sub.add_parser("verify", help="statistically certify that speculative sampling is lossless",
                       description="Sample many two-token continuations of short prompts with speculative "
                                   "decoding and with plain sampling, and test both against the target's "
                                   "exact distribution (first token, and second given first). Exit status 1 "
                                   "when the verdict is 'biased'.")
    add_model_args(p)
    p.add_argument("--temperature", type=float, default=0.8, help="sampling temperature (default 0.8)")
    p.add_argument("--top-k", type=int, default=0, help="top-k (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="top-p (1 = off)")
    p.add_argument("--samples", type=int, default=2000, help="continuations per prompt and source (default 2000)")
    p.add_argument("--prompt", action="append", default=None,
                   help="prompt to test (repeatable; default: two short built-in prompts)")
    p.add_argument("--seed", type=int, default=0, help="seed (default 0)")
    p.add_argument("--json", dest="json_file", default=None, help="write the full report to this file")
    p.set_defaults(run=run)


def run(args) -> int:
    from verispec import LLM, SamplingParams
    from verispec.certify import DEFAULT_PROMPTS, certify

    if args.samples < 100:
        raise VerispecError("--samples must be at least 100 for a meaningful test")
    if args.temperature <= 0:
        raise VerispecError("verify tests sampling: --temperature must be > 0 (greedy equality is tested by bench)")
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    spec = build_llm(args)
    spec.max_batch = 64
    plain = LLM(spec.target, proposer="none", max_batch=64)
    prompts = args.prompt or DEFAULT_PROMPTS[:2]
    print(f"verify: target {spec.target.name}, proposer {spec.proposer_name} k={spec.k}"
          + (f", draft {spec.draft.name}" if spec.draft else "") + f", T={args.temperature} top-k={args.top_k} "
          f"top-p={args.top_p}, {args.samples} samples per prompt and source", file=sys.stderr)
    report = certify(spec, plain, prompts, params, args.samples,
                     progress=lambda p, s: print(f"  sampled {s:<11} {p!r:.40}", file=sys.stderr))
    print(f"{'prompt':<32} {'pos':>3} {'source':<11} {'cells':>5} {'TV':>7} {'p-value':>9}")
    for c in report["checks"]:
        print(f"{repr(c['prompt'])[:32]:<32} {c['position']:>3} {c['source']:<11} {c['cells']:>5} "
              f"{c['tv']:>7.4f} {c['chi2_p']:>9.3g}")
    print(f"verdict: {report['verdict']} (Bonferroni threshold p < {report['threshold']:.2g}; "
          f"this run detects biases of total variation ≳ {report['resolution_tv']:.3f})")
    if args.json_file:
        report["command"] = invocation()
        Path(args.json_file).write_text(json.dumps(report, indent=1, default=str))
    return 1 if report["verdict"] == "biased" else 0
