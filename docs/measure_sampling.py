"""What choosing the next token costs besides the target pass, per token, on the 1.5B's own logits.

    python docs/measure_sampling.py [--out docs/results/sampling.json]

The 1.5B (default format) scores the formats' fixed text (~150 tokens) once; every position's logits (151,936 of
them) then go through what a round does after its pass, timed alone:
- greedy: `accept_greedy` with nothing drafted (the argmax);
- sampled: `warp_probs` (temperature, top-k, top-p) then `accept_sampling` with nothing drafted (plain
  sampling: the token drawn from the warped target);
- a verify round: the same over 5 rows of logits with 4 point-mass drafts (prompt lookup's K = 4).
Each setting runs every position in turn, the settings alternated, 7 repeats; medians per token.

It calls nothing else of verispec's, so the same file times an older commit on the same machine:
`PYTHONPATH=<a checkout of that commit>/src python docs/measure_sampling.py --out old.json`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

TARGET = "qwen2.5-coder-1.5b-instruct"
SETTINGS = {                                     # name: (temperature, top_k, top_p); temperature 0 = greedy
    "greedy": (0.0, 0, 1.0),
    "T 0.7": (0.7, 0, 1.0),
    "T 0.7, top_p 0.95": (0.7, 0, 0.95),
    "T 0.7, top_k 40": (0.7, 40, 1.0),
    "T 0.7, top_k 40, top_p 0.95": (0.7, 40, 0.95),
}
VERIFY_K = 4


def position_logits() -> torch.Tensor:
    """(T, V) float32: the target's next-token logits at every position of the formats' fixed text."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from measure_formats import TEXT, all_logits

    from verispec.engine.loading import load_model

    loaded = load_model(TARGET)
    ids = torch.tensor([loaded.tokenizer.encode(TEXT)])
    with torch.inference_mode():
        return all_logits(loaded.model, ids)


def choose(logits: torch.Tensor, drafts: torch.Tensor, setting: tuple, generator: torch.Generator):
    """What a round does after its pass: logits (1, K+1, V), drafts (1, K)."""
    from verispec.sampling import accept_greedy, accept_sampling, warp_probs

    temperature, top_k, top_p = setting
    num_draft = torch.tensor([drafts.shape[1]])
    if temperature == 0:
        return accept_greedy(logits, drafts, num_draft)
    p = warp_probs(logits, torch.tensor([temperature]), torch.tensor([top_k]), torch.tensor([top_p]))
    return accept_sampling(p, drafts, None, num_draft, [generator])


def measure(logits: torch.Tensor, repeats: int) -> dict:
    t = logits.shape[0]
    g = torch.Generator().manual_seed(0)
    nothing = torch.zeros(1, 0, dtype=torch.long)
    rounds = [logits[i:i + VERIFY_K + 1][None] for i in range(t - VERIFY_K)]                 # (1, K+1, V) each
    drafts = [logits[i:i + VERIFY_K].argmax(-1)[None] for i in range(t - VERIFY_K)]          # (1, K): all accepted
    times = {name: {"token": [], "verify": []} for name in SETTINGS}
    for rep in range(repeats):
        order = list(SETTINGS)[rep % len(SETTINGS):] + list(SETTINGS)[:rep % len(SETTINGS)]
        for name in order:
            start = time.perf_counter()
            for i in range(t):
                choose(logits[i:i + 1][None], nothing, SETTINGS[name], g)
            times[name]["token"].append((time.perf_counter() - start) / t)
            start = time.perf_counter()
            for x, d in zip(rounds, drafts):
                choose(x, d, SETTINGS[name], g)
            times[name]["verify"].append((time.perf_counter() - start) / len(rounds))
    return {name: {"temperature": SETTINGS[name][0], "top_k": SETTINGS[name][1], "top_p": SETTINGS[name][2],
                   "token_ms": statistics.median(x["token"]) * 1e3, "verify_round_ms": statistics.median(x["verify"]) * 1e3,
                   "token_ms_repeats": [round(s * 1e3, 4) for s in x["token"]]}
            for name, x in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="docs/results/sampling.json")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    from verispec.bench.run import environment

    logits = position_logits()
    rows = measure(logits, args.repeats)
    for name, r in rows.items():
        print(f"{name:30s} {r['token_ms']:.3f} ms per token, {r['verify_round_ms']:.3f} ms per verify round "
              f"(K = {VERIFY_K})", flush=True)
    result = {"command": " ".join(["python docs/measure_sampling.py", *sys.argv[1:]]), "environment": environment(), "positions": logits.shape[0],
              "vocab": logits.shape[1], "verify_k": VERIFY_K, "settings": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
