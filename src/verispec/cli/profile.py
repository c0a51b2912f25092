"""`verispec profile`: what one target pass over n tokens costs here, what a proposal step costs,
and the speedup those costs predict for each K at a given acceptance α."""

from __future__ import annotations

import json
import statistics
import sys
import time

from verispec.cli.bench import _floats
from verispec.cli.generate import add_model_args
from verispec.errors import VerispecError


def add_parser(sub) -> None:
    p = sub.add_parser("profile", help="measure c_p(n) and c_q here and print the predicted speedup curve",
                       description="Measure c_p(n), one target pass over n new tokens (n = 1 … --max-n), c_p(1) "
                                   "against its matmuls alone, and c_q, one proposal step of the draft model "
                                   "(timed alternately with 1-token target passes, reported as that ratio times "
                                   "c_p(1)), of the heads and of prompt lookup, then print "
                                   "E(K)·c_p(1) / (K·c_q + c_p(K+1)) for each K and α.")
    add_model_args(p)
    p.add_argument("--max-n", type=int, default=16, help="largest pass width to measure (default 16)")
    p.add_argument("--context", type=int, default=128, help="cached tokens before the measured pass (default 128)")
    p.add_argument("--repeats", type=int, default=7, help="rounds over all widths; medians are reported (default 7)")
    p.add_argument("--alphas", default="0.5,0.7,0.9", help="acceptance rates to predict for (default 0.5,0.7,0.9)")
    p.add_argument("--json", dest="json_file", default=None, help="write the measurements to this file")
    p.set_defaults(run=run)


def run(args) -> int:
    from verispec.bench.costs import predicted_speedup
    from verispec.engine.calibrate import (alternated_steps, pass_and_matmul_costs, pass_costs, rounds_line,
                                          tune_sweeps)
    from verispec.bench.run import machine_line
    from verispec.kernels import machine
    from verispec.loaders.builtin import DEFAULT_DRAFT
    from verispec.engine.loading import draft_auto_dtype, kv_auto_dtype, load_model

    if not 2 <= args.max_n <= 64 or args.context < 1 or args.repeats < 1:
        raise VerispecError("--max-n must be in 2 … 64, --context and --repeats positive")
    alphas = _floats(args.alphas)
    if any(not 0 <= a <= 1 for a in alphas):
        raise VerispecError("--alphas must lie in [0, 1]")
    target = load_model(args.model, args.dtype, args.device, progress=True)
    draft = load_model(args.draft or DEFAULT_DRAFT, draft_auto_dtype(args.draft_dtype, args.device), args.device,
                       progress=True)
    from verispec.models.kv_cache import KV_DTYPES

    kv = kv_auto_dtype(target.model) if args.kv_dtype == "auto" else KV_DTYPES[args.kv_dtype]
    tune_sweeps(target.model, on_round=rounds_line("timing the kernels' sweep schedules (once per machine)"),
                kv_dtype=kv)
    c_p = pass_costs(target.model, list(range(1, args.max_n + 1)), args.context, args.repeats,
                     on_round=lambda r, total: print(f"\rmeasuring c_p(1 … {args.max_n}): round {r}/{total}", end="",
                                                     file=sys.stderr, flush=True), kv_dtype=kv)
    print(file=sys.stderr)
    pass1, matmuls = pass_and_matmul_costs(target.model, args.context, args.repeats, kv_dtype=kv)
    from verispec.proposers.draft_vocab import DEFAULT_DRAFT_VOCAB, frequent_tokens

    steps = {"draft": None}                      # draft steps, each alternated with a 1-token target pass
    n = DEFAULT_DRAFT_VOCAB if args.draft_vocab == "auto" else args.draft_vocab
    if 0 < n < draft.config.vocab_size and draft.tokenizer is not None:
        steps[f"draft/{n}"] = frequent_tokens(draft.tokenizer, n, draft.config.vocab_size)
    target_s, draft_s = alternated_steps(target.model, draft.model, steps, args.repeats, args.context, kv)
    c_q = {name: c_p[1] * statistics.median(d / t for d, t in zip(times, target_s))    # each ratio alternated
           for name, times in draft_s.items()}
    heads_path = args.head
    if heads_path is None:
        from verispec.heads import shipped_heads

        heads_path = shipped_heads(target.name)
    if heads_path is not None:
        c_q["head"] = _head_cost(target, heads_path)
    c_q["ngram"] = _lookup_cost(target.tokenizer, args.context)
    print(f"target {target.name} ({args.dtype}), draft {draft.name} ({args.draft_dtype}), context {args.context}")
    print(machine_line(machine()))
    print(f"{'n':>3} {'c_p(n) ms':>10} {'c_p(n)/c_p(1)':>14}")
    for n, v in c_p.items():
        print(f"{n:>3} {v * 1e3:>10.1f} {v / c_p[1]:>14.2f}")
    print(f"c_p(1) against its matmuls alone (every linear called once, alternated with 1-token passes): "
          f"{pass1 * 1e3:.1f} / {matmuls * 1e3:.1f} ms = {pass1 / matmuls:.2f}")
    print("c_q: " + ", ".join(f"{k} {v * 1e3:.2f} ms ({v / c_p[1]:.2f} c_p(1))" for k, v in c_q.items()))
    curves = {}
    for name, cq in c_q.items():
        print(f"\npredicted speedup with {name} proposals")
        print("  K " + "".join(f"{'α=' + str(a):>9}" for a in alphas))
        for k in range(1, args.max_n):
            row = [predicted_speedup(a, k, cq, c_p) for a in alphas]
            curves.setdefault(name, {})[k] = row
            print(f"{k:>3} " + "".join(f"{x:>8.2f}x" for x in row))
    if args.json_file:
        with open(args.json_file, "w") as f:
            json.dump({"c_p": c_p, "c_q": c_q, "c_p1_and_matmuls": [pass1, matmuls], "alphas": alphas,
                       "predicted": curves, "dtype": args.dtype,
                       "environment": machine()}, f, indent=1)
    return 0


def _head_cost(target, path, repeats: int = 30) -> float:
    """Seconds per drafted token of the heads: one propose step at their full depth (Medusa: all H
    residual blocks; EAGLE: the layer over its window, then once per further draft; and the LM head
    over their vocabulary), divided by that depth; the median of `repeats`."""
    import statistics

    import torch

    from verispec.heads import load_heads
    from verispec.proposers.head import head_proposer

    from verispec.engine.params import SamplingParams
    from verispec.engine.sequence import Sequence
    from verispec.engine.metrics import SpecMetrics

    heads = load_heads(path, target.config.hidden_size, target.config.vocab_size)
    proposer = head_proposer(heads, target.model)
    seq = Sequence(0, list(range(100, 164)), SamplingParams(temperature=0, max_tokens=8), None, 1, frozenset(), None,
                   SpecMetrics("head", "auto"))
    seq.recent_states = torch.randn(getattr(heads, "window", 1), target.config.hidden_size)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        proposer.propose([seq], [heads.depth])
        times.append(time.perf_counter() - t)
    return statistics.median(times[3:]) / heads.depth


def _lookup_cost(tokenizer, context: int, rounds: int = 200) -> float:
    """Seconds per round of prompt lookup at `context` tokens, as a round pays it: the sequence's
    index is kept up to date incrementally (a round commits a few tokens), then one search for a
    64-token continuation. The text is Python source repeated (a long copy: every suffix matches,
    the searches run long); the median of `rounds`."""
    import inspect
    import json.decoder
    import json.encoder
    import statistics

    from verispec.proposers.match_index import MatchIndex

    source = inspect.getsource(json.decoder) + inspect.getsource(json.encoder)
    unit = tokenizer.encode(source) if tokenizer is not None else list(range(3000))
    tokens = (unit * ((context + 4 * rounds) // len(unit) + 1))[: context + 4 * rounds]
    seq = tokens[:context]
    index = MatchIndex()
    index.extend(seq)
    times = []
    for r in range(rounds):
        seq.extend(tokens[len(seq): len(seq) + 4])
        t = time.perf_counter()
        index.find(seq, 64)
        times.append(time.perf_counter() - t)
    return statistics.median(times)
