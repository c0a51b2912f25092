#!/usr/bin/env bash
# Every measurement behind docs/PERFORMANCE.md, in order, then the page itself.
# About two hours and a quarter on the reference machine (2 cores). Run from the repository root on a quiet machine.
set -euo pipefail
# The reference machine has AVX-512 (docs/results/); on an AVX2-only one run with R=docs/results/avx2 (a Zen/Zen+
# EPYC: docs/results/zen1; an Intel Xeon: docs/results/xeon) — the page renders that directory's profile, sampling,
# llama.cpp, suite, long-copy and formats results as a section of their own (docs/make_performance.py, OTHER_KINDS).
R=${R:-docs/results}
mkdir -p "$R"

# Speculative modes on the bundled suite (12 prompts, 6 categories), greedy and T = 0.7, interleaved,
# four repeats (about 47 minutes).
verispec bench --modes ngram,draft,hybrid,hybrid+head --ks auto --temperatures 0,0.7 --max-tokens 64 --repeats 4 \
    --json $R/bench-suite.json --markdown $R/bench-suite.md --plot $R/plots
# Every proposer at fixed K = 2 and 4 against auto, one repeat (about 27 minutes).
verispec bench --modes ngram,draft,hybrid --ks 2,4,auto --temperatures 0,0.7 --max-tokens 64 --repeats 1 \
    --json $R/bench-fixedk.json --markdown $R/bench-fixedk.md
# the shipped drafting head (docs/HEADS.md)
verispec bench --modes head,hybrid+head,ngram --ks auto,3 --temperatures 0,0.7 --max-tokens 64 --repeats 2 \
    --json $R/bench-eagle.json --markdown $R/bench-eagle.md
# Costs of a target pass by width, and of each proposer.
verispec profile --json $R/profile.json > $R/profile.txt
# What choosing the token costs after the pass: greedy, sampled with top-k / top-p, a verify round.
python docs/measure_sampling.py --out $R/sampling.json
# How the draft model agrees with the target along answers, and the K policy replayed on that agreement.
python docs/measure_draft_agreement.py --out $R/draft-agreement.json
# Draft model K sweep (greedy) on a third of the suite.
verispec bench --modes draft --ks 1,2,4,6 --temperatures 0 --limit 4 --max-tokens 32 \
    --json $R/bench-ksweep.json --markdown $R/bench-ksweep.md --plot $R/plots-ksweep
# Batches of 4 prompts.
verispec bench --modes ngram --ks auto --batch-sizes 1,4 --limit 4 --max-tokens 32 \
    --json $R/bench-batch.json --markdown $R/bench-batch.md
# Hugging Face transformers on the same prompts and weights, in the same run.
verispec bench --peer hf --modes ngram --ks auto --limit 3 --max-tokens 24 \
    --json $R/bench-peer.json --markdown $R/bench-peer.md
# llama.cpp (llama-cpp-python, built from source once) on the same GGUF files and threads, whole suite, greedy and
# sampled as chat front ends sample (T = 0.7, top_p 0.95).
# (On an AMX Xeon a native build may crash in llama.cpp's AMX matmul; the peer then stops with an error that
# gives the rebuild without AMX.)
python -c "import llama_cpp" 2>/dev/null || pip install -e '.[llamacpp]'
verispec bench --peer llamacpp --modes ngram,hybrid --ks auto --temperatures 0,0.7 --top-p 0.95 --max-tokens 64 \
    --json $R/bench-llamacpp.json --markdown $R/bench-llamacpp.md
# llama.cpp's own programs (plain and its n-gram speculative mode) on the code-editing prompts and the long copy,
# answers in full, when LLAMA_CPP_BIN names the bin/ directory of a llama.cpp build of your own (about 40 minutes).
if [ -n "${LLAMA_CPP_BIN:-}" ]; then
    python docs/measure_llamacpp_cli.py --bin "$LLAMA_CPP_BIN" --out $R/llamacpp-cli.json
fi
# A long copy: a 301-line file returned with one rename (about 5 minutes).
verispec bench --prompts docs/prompts/long-copy.jsonl --modes ngram,hybrid --ks auto --temperatures 0 --max-tokens 4000 \
    --json $R/bench-longcopy.json --markdown $R/bench-longcopy.md
# Weight formats: decode speed, quality against fp32, peak RSS of the pair.
python docs/measure_formats.py --out $R/formats.json
# The matmul kernels alone at the 1.5B's shapes, by row count, each ISA variant and format.
python docs/measure_kernel.py --out $R/kernel.json
python docs/measure_variants.py --out $R/variants.json
# Losslessness certificate on the real pair (0.5B drafts for the 1.5B, K = 4, T = 0.8).
verispec verify --draft qwen2.5-coder-0.5b-instruct --k 4 --samples 600 --json $R/verify.json > $R/verify.txt
# The server under load, without and with speculation.
verispec loadtest --spawn '--proposer none' --spawn '--proposer ngram' --concurrency 1,4,16 --max-tokens 32 \
    --json $R/loadtest.json --markdown $R/loadtest.md

python docs/make_performance.py
