"""The matmul kernels alone at the 1.5B's shapes: milliseconds for a whole model's linears (28 layers'
q/k/v, o, gate/up and down, plus the LM head) by row count M, for each instruction-set variant this
CPU runs and each weight format (int8; int4 for the layers, int8 for the LM head; int6 for all, as
Q6_K tensors are), timed alternately in one process (the order rotates every round).

    python docs/measure_kernel.py [--layers 8] [--repeats 9] [--out docs/results/kernel.json]

Random weights in the kernels' packed layouts, `--layers` layers' worth (more than the L3 cache, so
every pass streams its weights from memory as a real decode step does); the median over `--repeats`
passes, scaled to 28 layers. Attention, norms and the rest of a pass are excluded (`verispec
profile` measures whole passes).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from verispec import kernels

HIDDEN, INTER, KV, VOCAB, LAYERS = 1536, 8960, 256, 151936, 28
SHAPES = [(HIDDEN + 2 * KV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER)]


def layer_weights(fmt: str, layers: int, gen: torch.Generator) -> list:
    out = []
    for _ in range(layers):
        for n, k in SHAPES:
            if fmt == "int8":
                out.append(("int8", kernels.pack_int8(torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)),
                            torch.rand(n, generator=gen), k))
            elif fmt == "int6":
                out.append(int6_weight(n, k, gen))
            else:
                q = torch.randint(0, 16, (n, k), generator=gen)
                mult = lambda: torch.randint(0, 64, (n, k // 32), generator=gen)
                factor = lambda: (torch.rand(n, -(-k // 256), generator=gen) * 1e-3).half().float()
                out.append(("int4", *kernels.pack_int4(q, mult(), mult(), factor(), factor()), k))
    return out


def int6_weight(n: int, k: int, gen: torch.Generator) -> tuple:
    q = torch.randint(0, 64, (n, k), generator=gen)
    sc = torch.randint(-128, 128, (n, k // 16), generator=gen).to(torch.int8)
    return ("int6", *kernels.pack_int6(q, sc, (torch.rand(n, -(-k // 256), generator=gen) * 1e-3).half().float()), k)


def run(native, weights, x) -> None:
    for w in weights:
        if w[0] == "int8":
            native.int8_gemm(x[w[3]], w[1], w[2])
        elif w[0] == "int6":
            native.int6_gemm(x[w[4]], w[1], w[2], w[3])
        else:
            native.int4_gemm(x[w[4]], w[1], w[2], w[3])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--rows", default="1,2,3,5,8,16")
    ap.add_argument("--out", default=None, help="write the numbers as JSON here")
    args = ap.parse_args()
    if not kernels.available():
        raise SystemExit(f"the native kernel is not available here: {kernels.kernel_status()}")
    gen = torch.Generator().manual_seed(0)
    weights = {fmt: layer_weights(fmt, args.layers, gen) for fmt in ("int8", "int4", "int6")}
    head8 = ("int8", kernels.pack_int8(torch.randint(-127, 128, (VOCAB, HIDDEN), dtype=torch.int8, generator=gen)),
             torch.rand(VOCAB), HIDDEN)
    heads = {"int8": head8, "int4": head8, "int6": int6_weight(VOCAB, HIDDEN, gen)}
    variants = {v: kernels.load_variant(v) for v in kernels.supported_variants()}
    combos = [(v, f) for v in variants for f in weights]
    result = {"command": " ".join(["python docs/measure_kernel.py", *sys.argv[1:]]), "threads": torch.get_num_threads(),
              **kernels.machine(), "rows": {}}
    print(f"{'M':>3} " + " ".join(f"{v + ' ' + f:>18}" for v, f in combos) + "   (ms, 28 layers + LM head)")
    for m in [int(r) for r in args.rows.split(",")]:
        x = {HIDDEN: torch.randn(m, HIDDEN), INTER: torch.randn(m, INTER)}
        times = {c: [] for c in combos}
        for r in range(args.repeats):
            for c in combos[r % len(combos):] + combos[:r % len(combos)]:
                native = variants[c[0]]
                t = time.perf_counter()
                run(native, weights[c[1]], x)
                layers = (time.perf_counter() - t) / args.layers
                t = time.perf_counter()
                run(native, [heads[c[1]]], x)
                times[c].append(LAYERS * layers + time.perf_counter() - t)
        med = {f"{v} {f}": statistics.median(times[(v, f)]) for v, f in combos}
        result["rows"][m] = med
        print(f"{m:>3} " + " ".join(f"{med[f'{v} {f}'] * 1e3:>18.1f}" for v, f in combos))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
