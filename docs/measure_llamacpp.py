"""Time to first token (prefill) and decode speed, llama.cpp against verispec's plain decoding in its
default format, on the same GGUF file with the same threads, each prompt alternating which runs first:
every bundled prompt plus the long-copy prompt (docs/prompts/long-copy.jsonl), 3 repeats, medians.

    pip install -e '.[llamacpp]' && python docs/measure_llamacpp.py --out docs/results/llamacpp-ttft.json

`verispec bench --peer llamacpp` compares whole answers (prefill included); this separates the two
halves: llama.cpp's time to its first generated token vs verispec's `prefill_s`, and tokens per
second after it (32 tokens, greedy, end-of-sequence ignored).
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from verispec import LLM, SamplingParams, kernels
from verispec.bench.peers import llamacpp_build, probe_llamacpp
from verispec.bench.suites import load_suite
from verispec.loaders.builtin import DEFAULT_TARGET, ensure_assembled

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--out", default="docs/results/llamacpp-ttft.json")
args = ap.parse_args()
import llama_cpp  # noqa: E402  (the optional peer)

path = str(ensure_assembled(DEFAULT_TARGET))
threads = torch.get_num_threads()
probe_llamacpp(Path(path), threads)          # a build that crashes on this CPU: an error, not a dead process
L = llama_cpp.Llama(model_path=path, n_ctx=4096, n_batch=512, n_threads=threads, n_threads_batch=threads, verbose=False)
v = LLM(proposer="none")
prompts = [(p.id, v.encode(p.render(v))) for p in load_suite(None)]
prompts.append(("long-copy", v.encode(load_suite("docs/prompts/long-copy.jsonl")[0].render(v))))
N = 32
def llama_run(ids):
    L.reset()
    t0 = time.perf_counter(); first = None; n = 0
    for tok in L.generate(ids, temp=0, top_k=0, top_p=1.0, min_p=0.0, typical_p=1.0, repeat_penalty=1.0):
        n += 1
        if first is None: first = time.perf_counter()
        if n >= N: break
    end = time.perf_counter()
    return first - t0, (n - 1) / (end - first)
def vs_run(ids):
    v.clear_prefix_cache()                     # a cold prompt each time, as llama.cpp's reset() gives it
    out = v.generate([ids], SamplingParams(temperature=0, max_tokens=N, ignore_eos=True))[0]
    return out.prefill_s, out.tokens_per_s
rows = []
for pid, ids in prompts:
    res = {"llama.cpp": [], "verispec": []}
    for r in range(3):
        for name, fn in ((("llama.cpp", llama_run), ("verispec", vs_run)) if r % 2 else (("verispec", vs_run), ("llama.cpp", llama_run))):
            res[name].append(fn(ids))
    med = {k: (statistics.median(x[0] for x in rs), statistics.median(x[1] for x in rs)) for k, rs in res.items()}
    rows.append({"prompt": pid, "prompt_tokens": len(ids), **{f"{k}_ttft_s": m[0] for k, m in med.items()},
                 **{f"{k}_decode_tok_s": m[1] for k, m in med.items()}})
    print(f"{pid:16s} {len(ids):5d} tok  TTFT llama.cpp {med['llama.cpp'][0]:.3f}s verispec {med['verispec'][0]:.3f}s "
          f"({med['llama.cpp'][0] / med['verispec'][0]:.2f}x)  decode {med['llama.cpp'][1]:.1f} vs {med['verispec'][1]:.1f} tok/s "
          f"({med['verispec'][1] / med['llama.cpp'][1]:.2f}x)", flush=True)
with open(args.out, "w") as f:
    json.dump({"command": " ".join(["python docs/measure_llamacpp.py", *sys.argv[1:]]), "environment": {"threads": threads, **kernels.machine(),
                                                                   "llama_cpp": llamacpp_build()},
               "new_tokens": N, "rows": rows}, f, indent=1)
