"""llama.cpp's own command-line programs against verispec on the same GGUF file, threads and prompts: plain
decoding (`llama-completion`) and llama.cpp's n-gram speculative mode (`llama-speculative-simple
--spec-type ngram-simple`: 12-token matches, drafts of up to 48) beside verispec's plain decoding and its
default mode, greedy, every answer in full (up to --max-tokens, 4,000 for the long copy).

    python docs/measure_llamacpp_cli.py --bin LLAMA_CPP/build/bin --out docs/results/llamacpp-cli.json

LLAMA_CPP/build/bin is a llama.cpp build of your own (e.g. `cmake -B build -DGGML_NATIVE=ON && cmake --build
build --target llama-completion llama-speculative-simple`); nothing here builds it. The prompts: the bundled
code-editing prompts (a file returned with a change: what an n-gram drafter is for), --repeats times each, and
the long copy of docs/prompts/long-copy.jsonl (a 301-line file back with one rename) once. The four programs
take turns, the first of them rotating from prompt to prompt and repeat to repeat. Each reports its prefill
(prompt processing) and its decode speed the way it counts them: llama.cpp's own timing lines (a fresh
process per answer; loading the file is not counted) and verispec's `prefill_s` and `tokens_per_s`.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

import torch

from verispec import LLM, SamplingParams
from verispec.bench.peers import system_info_features
from verispec.bench.run import environment
from verispec.bench.suites import load_suite
from verispec.loaders.builtin import DEFAULT_TARGET, ensure_assembled

PROGRAMS = ("llama.cpp plain", "llama.cpp ngram", "verispec plain", "verispec default")
LONG_COPY = Path(__file__).parent / "prompts" / "long-copy.jsonl"


def number(pattern: str, text: str, what: str) -> float:
    m = re.search(pattern, text)
    if m is None:
        sys.exit(f"no {what} in llama.cpp's output (pattern {pattern!r}); its last lines:\n" + "\n".join(text.splitlines()[-15:]))
    return float(m[1])


def answer_tokens(decoded: int, max_tokens: int) -> int:
    """llama-speculative-simple's count without the end-of-text token, which it counts when it stops on one (it
    stops on the limit only once past it)."""
    return decoded - 1 if decoded <= max_tokens else decoded


def llama(binary: Path, gguf: str, text: str, max_tokens: int, threads: int, ngram: bool) -> dict:
    # The prompt as given: -p, not -f (llama.cpp drops a prompt file's last newline, and a chat prompt ends in
    # "assistant\n"), and --no-escape (by default it turns the two characters \n of the code in a prompt into a newline).
    cmd = [str(binary), "-m", gguf, "-p", text, "--no-escape", "-n", str(max_tokens), "-t", str(threads), "-tb",
           str(threads), "--temp", "0", "-c", "8192", "-b", "4096", "-ub", "512"]
    cmd += ["--spec-type", "ngram-simple", "--spec-draft-n-max", "48"] if ngram else ["-no-cnv", "--no-display-prompt", "--no-warmup"]
    done = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        sys.exit(f"{binary.name} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    err = done.stderr
    if ngram:           # encoded / decoded lines of llama-speculative-simple (the decode starts at the prompt's last token)
        return {"prompt_tokens": int(number(r"encoded\s+(\d+) tokens", err, "prompt count")),
                "prefill_s": number(r"encoded\s+\d+ tokens in\s+([\d.]+) seconds", err, "prompt time"),
                "generated_tokens": answer_tokens(int(number(r"decoded\s+(\d+) tokens", err, "token count")), max_tokens),
                "decode_tok_s": number(r"decoded\s+\d+ tokens in\s+[\d.]+ seconds, speed:\s+([\d.]+)", err, "decode speed"),
                "drafted": int(number(r"n_drafted\s*=\s*(\d+)", err, "draft count")),
                "accepted": int(number(r"n_accept\s*=\s*(\d+)", err, "accept count")),
                "text": done.stdout.split(text, 1)[1].rstrip() if text in done.stdout else None}   # after its echo of the prompt
    prompt_ms = number(r"prompt eval time\s*=\s*([\d.]+) ms", err, "prompt time")
    decode = err.replace("prompt eval time", "")           # the generated tokens' "eval time" line alone
    eval_ms = number(r"\beval time\s*=\s*([\d.]+) ms", decode, "eval time")
    runs = int(number(r"\beval time\s*=\s*[\d.]+ ms /\s*(\d+) runs", decode, "eval runs"))
    return {"prompt_tokens": int(number(r"prompt eval time\s*=\s*[\d.]+ ms /\s*(\d+) tokens", err, "prompt count")),
            # every sampled token but the last is evaluated once: the last is the end-of-text token (not counted) or the
            # one that reached -n
            "prefill_s": prompt_ms / 1e3, "generated_tokens": runs if "[end of text]" in done.stdout else runs + 1,
            "decode_tok_s": runs / (eval_ms / 1e3) if eval_ms > 0 else None,
            "text": done.stdout.replace("[end of text]", "").rstrip("\n")}


def llama_build(binary: Path, gguf: str, threads: int) -> str:
    """'<version line>; <the CPU features it was built with>', from a one-token run (which also brings the file
    into the page cache before the timed runs)."""
    done = subprocess.run([str(binary), "-m", gguf, "-p", "def f(x):", "-n", "1", "-t", str(threads), "-no-cnv", "--no-warmup"],
                          capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        sys.exit(f"{binary.name} failed ({done.returncode}) on a one-token run; a build using AMX_INT8 may crash in its "
                 f"AMX matmul on some Xeons (ggml-org/llama.cpp#20824):\n{done.stderr[-3000:]}")
    info = re.search(r"system_info:.*?\|(.*)", done.stderr)
    features = system_info_features(info[1] if info else "")
    told = subprocess.run([str(binary), "--version"], capture_output=True, text=True, stdin=subprocess.DEVNULL)
    version = re.search(r"version: (.+)", told.stdout + told.stderr)
    return f"{version[1].strip() if version else 'version not reported'}; {' '.join(features) or 'features not reported'}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin", required=True, type=Path, help="directory holding llama-completion and llama-speculative-simple")
    ap.add_argument("--out", default="docs/results/llamacpp-cli.json")
    ap.add_argument("--max-tokens", type=int, default=512, help="per code-editing answer (the long copy: 4000)")
    ap.add_argument("--repeats", type=int, default=2, help="per code-editing prompt (the long copy: once)")
    ap.add_argument("--no-long-copy", action="store_true")
    args = ap.parse_args()
    binaries = {name: args.bin / name for name in ("llama-completion", "llama-speculative-simple")}
    for path in binaries.values():
        if not path.is_file():
            sys.exit(f"{path} not found: --bin names the directory of a llama.cpp build holding {', '.join(binaries)}")
    if args.max_tokens < 1 or args.repeats < 1:
        sys.exit("--max-tokens and --repeats must be at least 1")

    gguf = str(ensure_assembled(DEFAULT_TARGET))
    threads = torch.get_num_threads()
    plain, default = LLM(proposer="none"), LLM()
    jobs = [(p, args.max_tokens, args.repeats) for p in load_suite(None) if p.category == "code_editing"]
    if not args.no_long_copy:
        jobs.append((load_suite(str(LONG_COPY))[0], 4000, 1))

    def verispec(llm: LLM, ids: list[int], max_tokens: int) -> dict:
        llm.clear_prefix_cache()
        o = llm.generate([ids], SamplingParams(temperature=0, max_tokens=max_tokens))[0]
        return {"prompt_tokens": o.prompt_tokens, "prefill_s": o.prefill_s, "generated_tokens": o.generated_tokens,
                "decode_tok_s": o.tokens_per_s, "text": o.text, "spec": {k: o.spec.get(k) for k in ("rounds", "proposed", "accepted")}}

    build = llama_build(binaries["llama-completion"], gguf, threads)
    print(f"llama.cpp: {build}", flush=True)
    for llm in (plain, default):                 # first-use costs (kernel builds, the draft's load) outside the timings
        llm.generate([plain.encode("def f(x):")], SamplingParams(temperature=0, max_tokens=8))
    runs, turn = [], 0
    for prompt, max_tokens, repeats in jobs:
        text = prompt.render(plain)
        ids = plain.encode(text)
        for rep in range(repeats):
            calls = {"llama.cpp plain": lambda: llama(binaries["llama-completion"], gguf, text, max_tokens, threads, False),
                     "llama.cpp ngram": lambda: llama(binaries["llama-speculative-simple"], gguf, text, max_tokens, threads, True),
                     "verispec plain": lambda: verispec(plain, ids, max_tokens),
                     "verispec default": lambda: verispec(default, ids, max_tokens)}
            order = PROGRAMS[turn % 4:] + PROGRAMS[:turn % 4]
            turn += 1
            for name in order:
                r = calls[name]()
                if r["prompt_tokens"] != len(ids) or r["text"] is None:
                    print(f"warning: {name} read {r['prompt_tokens']} prompt tokens where verispec has {len(ids)}"
                          + (", and its output does not echo the prompt" if r["text"] is None else ""), flush=True)
                    r["text"] = r["text"] or ""
                runs.append({"prompt": prompt.id, "repeat": rep, "program": name, "max_tokens": max_tokens, **r})
                print(f"{prompt.id:12s} rep {rep} {name:17s} prompt {r['prompt_tokens']:5d} tok in {r['prefill_s']:7.2f} s, "
                      f"{r['generated_tokens']:5d} tokens at {r['decode_tok_s'] or 0:6.2f} tok/s", flush=True)

    summary = []
    for prompt, _, _ in jobs:
        mine = [r for r in runs if r["prompt"] == prompt.id]
        def median(name: str, key: str) -> float | None:   # None: no decode phase to time (a one-token answer)
            values = [r[key] for r in mine if r["program"] == name and r[key] is not None]
            return statistics.median(values) if values else None
        med = {name: {key: median(name, key) for key in ("prefill_s", "decode_tok_s", "generated_tokens")}
               for name in PROGRAMS}
        # Each program's answers against its own plain decoding's first one (llama.cpp's numerics differ from
        # verispec's); one may extend the other, as the n-gram mode can run past --max-tokens.
        for name in PROGRAMS:
            own = next(r["text"].strip() for r in mine if r["program"] == name.split()[0] + " plain")
            texts = [r["text"].strip() for r in mine if r["program"] == name]
            med[name]["same_text_as_own_plain"] = all(t.startswith(own) or own.startswith(t) for t in texts)
        ours = next(r["text"].strip() for r in mine if r["program"] == "verispec plain")
        med["llama.cpp plain"]["same_text_as_verispec_plain"] = all(
            r["text"].strip() == ours for r in mine if r["program"] == "llama.cpp plain")
        summary.append({"prompt": prompt.id, "prompt_tokens": next(r["prompt_tokens"] for r in mine if r["program"] == "verispec plain"),
                        **med})
    for s in summary:
        base = s["llama.cpp plain"]["decode_tok_s"]
        print(f"{s['prompt']:12s} decode × llama.cpp plain: " + ", ".join(
            f"{name} {s[name]['decode_tok_s'] / base:.2f}x" for name in PROGRAMS if base and s[name]["decode_tok_s"]))
    with open(args.out, "w") as f:
        options = [f"--out {args.out}"] + [f"--{flag} {value}" for flag, value, default in (
            ("max-tokens", args.max_tokens, 512), ("repeats", args.repeats, 2)) if value != default]
        json.dump({"command": " ".join(["python docs/measure_llamacpp_cli.py --bin LLAMA_CPP/build/bin", *options]
                                       + ["--no-long-copy"] * args.no_long_copy),
                   "environment": environment(),
                   "llama_cpp": {"plain": "llama-completion -no-cnv --no-display-prompt --no-warmup --temp 0", "ngram": "llama-speculative-simple "
                                 "--spec-type ngram-simple --spec-draft-n-max 48 --temp 0",
                                 "common": "-p PROMPT --no-escape -t THREADS -tb THREADS -c 8192 -b 4096 -ub 512",
                                 "build": build},
                   "summary": summary, "runs": runs}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
