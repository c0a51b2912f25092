"""Whole 1.5B passes with each kernel variant this CPU runs: c_p(n), one target pass over n new tokens after
128 cached, in the default format, the variants taking turns in one process (every round times each width with
each variant, the variants' order rotating from round to round), so a slow spell of a shared machine falls on
all of them alike.

    python docs/measure_variants.py [--widths 1,2,3,4,5,6,8,12,16] [--rounds 10] [--out docs/results/variants.json]

What a variant's wider vector instructions buy in a whole pass (attention, norms and the rest included), where
`docs/measure_kernel.py` times the matmuls alone: the best variant is the one verispec runs; the others are what
a CPU without its extensions would run, on this core and memory. Each AVX2-class variant runs the sweep schedule
this machine chose for it (timed first if none is kept: kernels/sweeps.py); where that differs from the compiled
one, a column "<variant>, compiled sweeps" times the compiled schedule beside it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from verispec import kernels
from verispec.engine.calibrate import pass_costs, tune_sweeps
from verispec.engine.loading import kv_auto_dtype, load_model
from verispec.loaders.builtin import DEFAULT_TARGET


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--widths", default="1,2,3,4,5,6,8,12,16")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--variants", default=None, help="comma-separated (default: every one this CPU runs)")
    ap.add_argument("--out", default=None, help="write the numbers as JSON here")
    args = ap.parse_args()
    try:
        widths = sorted({int(w) for w in args.widths.split(",")} | {1})
    except ValueError:
        raise SystemExit(f"--widths takes integers separated by commas, not {args.widths!r}")
    if not 1 <= args.rounds <= 1000 or min(widths) < 1 or max(widths) > 65:
        raise SystemExit("--rounds must be 1 … 1000 and widths 1 … 65 (a verify pass of K = 64)")
    names = args.variants.split(",") if args.variants else kernels.supported_variants()
    try:
        variants = {name: kernels.load_variant(name) for name in names}
    except RuntimeError as err:
        raise SystemExit(str(err))
    if not variants:
        raise SystemExit(f"no native kernel variant runs here: {kernels.kernel_status()}")
    model = load_model(DEFAULT_TARGET, "auto", "cpu").model
    kv = kv_auto_dtype(model)                         # the cache format a pass runs with by default
    runs = {}                                         # column -> (kernels, sweep schedule or None)
    for name, native in variants.items():             # each variant's sweep schedules, as verispec runs it
        with kernels.using(native):
            tune_sweeps(model, kv_dtype=kv)
        runs[name] = (native, native.schedule())
        if native.defaults is not None and native.schedule() != native.defaults:
            runs[f"{name}, compiled sweeps"] = (native, native.defaults)     # what the tuning changed
    times = {label: {n: [] for n in widths} for label in runs}
    order = list(runs)
    for r in range(args.rounds + 1):                  # round 0 warms every variant up
        for label in order[r % len(order):] + order[:r % len(order)]:
            native, schedule = runs[label]
            for fmt, one in (schedule or {}).items():
                native.set_schedule(fmt, one)
            with kernels.using(native):
                costs = pass_costs(model, widths, repeats=1, kv_dtype=kv)
            if r:
                for n in widths:
                    times[label][n].append(costs[n])
        print(f"round {r}/{args.rounds}", file=sys.stderr, flush=True)
    for name, native in variants.items():             # each variant back on the schedule verispec runs
        for fmt, one in (runs[name][1] or {}).items():
            native.set_schedule(fmt, one)
    result = {"command": " ".join(["python docs/measure_variants.py", *sys.argv[1:]]), "threads": torch.get_num_threads(),
              **kernels.machine(), "model": DEFAULT_TARGET, "kv_dtype": str(kv).replace("torch.", ""),
              "rounds": args.rounds,
              "sweeps": {label: kernels.sweeps.describe(schedule) for label, (_, schedule) in runs.items()},
              "variants": {label: {str(n): statistics.median(v) for n, v in by.items()} for label, by in times.items()}}
    print(f"{'n':>3} " + " ".join(f"{label + ' ms (× n = 1)':>26}" for label in runs))
    for n in widths:
        print(f"{n:>3} " + " ".join(f"{t[str(n)] * 1e3:>14.1f} ({t[str(n)] / t['1']:.2f})".rjust(26)
                                     for t in result["variants"].values()))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
