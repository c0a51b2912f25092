"""The int8 kernel at the 1.5B's shapes: milliseconds per layer and for the LM head by row count M,
with the projections fused (one q/k/v and one gate/up matmul per layer, as the model runs them)
and apart, timed alternately in one process (each first in every other round).

    python docs/measure_kernel.py [--layers 8] [--repeats 15] [--out docs/results/kernel.json]

Random int8 weights in the kernel's packed layout, `--layers` layers' worth (more than the L3 cache,
so every pass streams its weights from memory as a real decode step does); the median over
`--repeats` passes. A whole-model figure is 28 × layer + LM head (attention, norms and the rest of
the pass excluded: `verispec profile` measures those too).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from verispec import kernels

HIDDEN, INTER, KV, VOCAB, LAYERS = 1536, 8960, 256, 151936, 28
APART = [(HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN), (INTER, HIDDEN), (INTER, HIDDEN), (HIDDEN, INTER)]
FUSED = [(HIDDEN + 2 * KV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER)]


def weights(shapes: list[tuple[int, int]], layers: int, gen: torch.Generator) -> list:
    return [(kernels.pack_int8(torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)), torch.rand(n), k)
            for _ in range(layers) for n, k in shapes]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--rows", default="1,2,3,4,5,6,8")
    ap.add_argument("--out", default=None, help="write the numbers as JSON here")
    args = ap.parse_args()
    if not kernels.available():
        raise SystemExit(f"the native kernel is not available here: {kernels.kernel_status()}")
    gen = torch.Generator().manual_seed(0)
    sets = {"fused": weights(FUSED, args.layers, gen), "apart": weights(APART, args.layers, gen)}
    head = (kernels.pack_int8(torch.randint(-127, 128, (VOCAB, HIDDEN), dtype=torch.int8, generator=gen)),
            torch.rand(VOCAB))
    result = {"threads": torch.get_num_threads(), "kernel": kernels.kernel_status(), "rows": {}}
    print(f"{'M':>3} {'fused ms/layer':>15} {'apart ms/layer':>15} {'LM head ms':>11} {'model ms':>9} {'× M=1':>6}")
    for m in [int(r) for r in args.rows.split(",")]:
        x = {HIDDEN: torch.randn(m, HIDDEN), INTER: torch.randn(m, INTER)}
        times = {"fused": [], "apart": [], "head": []}
        for r in range(args.repeats):
            # Alternate which set runs first: the second of a pair measured 5–8 % faster either way.
            for name, ws in (list(sets.items()) if r % 2 == 0 else list(sets.items())[::-1]):
                t = time.perf_counter()
                for w, s, k in ws:
                    kernels.int8_gemm(x[k], w, s)
                times[name].append((time.perf_counter() - t) / args.layers)
            t = time.perf_counter()
            kernels.int8_gemm(x[HIDDEN], *head)
            times["head"].append(time.perf_counter() - t)
        med = {k: statistics.median(v) for k, v in times.items()}
        model = LAYERS * med["fused"] + med["head"]
        result["rows"][m] = med | {"model": model}
        base = result["rows"][min(result["rows"])]["model"]
        print(f"{m:>3} {med['fused'] * 1e3:>15.2f} {med['apart'] * 1e3:>15.2f} {med['head'] * 1e3:>11.2f} "
              f"{model * 1e3:>9.1f} {model / base:>6.2f}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
