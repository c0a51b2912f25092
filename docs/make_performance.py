"""Write docs/PERFORMANCE.md from the measurement files in docs/results/ (never edit it by hand).

    bash docs/reproduce.sh          # runs every measurement, then this script
    python docs/make_performance.py # only regenerates the page from the existing results

Each section names the command that produced its numbers. A missing result file leaves a line
saying which command to run instead of a number.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from verispec.bench.run import machine_line, truncation

DOCS = Path(__file__).parent
RESULTS = DOCS / "results"


def load(name: str) -> dict | None:
    path = RESULTS / name
    return json.loads(path.read_text()) if path.exists() else None


def f(v, fmt="%.2f", none="–"):
    return fmt % v if isinstance(v, (int, float)) else none


def table(head: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)] + \
           ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def same(row: dict, no: str = "**no**") -> str:
    """The "same as plain" cell: greedy output identical to plain decoding."""
    return {True: "yes", False: no}.get(row.get("identical_to_plain"), "–")


def missing(what: str, command: str) -> list[str]:
    return [f"_Not measured yet: run `{command}` ({what})._", ""]


def command_line(result: dict) -> str:
    cmd = result.get("command", "")
    parts = cmd.split()
    if parts and parts[0].endswith("verispec"):
        parts[0] = "verispec"
    return " ".join(parts)


def env_line(result: dict) -> str:
    e = result.get("environment", {})
    return f"verispec {e.get('verispec')}, torch {e.get('torch')}, {e.get('threads')} threads, {machine_line(e)}"


# -- sections -----------------------------------------------------------------------------------

def provenance(result: dict, current: dict | None) -> list[str]:
    """A warning when a result came from another machine kind or kernel build than the page's suite run."""
    if current is None:
        return []
    mine, theirs = result.get("environment", {}), current.get("environment", {})
    key = lambda e: (e.get("cpu_model"), e.get("kernel", e.get("int8_kernel")))
    if key(mine) == key(theirs):
        return []
    return [f"_Measured on another machine or build than the suite above ({machine_line(mine)}) and not rerun "
            "since: compare its ratios, not its absolute figures, with the sections measured today._", ""]


def repeats(bench: dict) -> int:
    return 1 + max((r["repeat"] for r in bench["runs"]), default=0)


def category_table(bench: dict, cell) -> list[str]:
    """One row per (temperature, mode other than plain), one column per category and 'all', batch 1;
    cell(row) renders a summary row (None: the mode has nothing to show there)."""
    cats = sorted({r["category"] for r in bench["summary"] if r["category"] != "all"})
    modes = [m for m in dict.fromkeys(r["mode"] for r in bench["summary"]) if m != "plain"]
    body = []
    for t in sorted({r["temperature"] for r in bench["summary"]}):
        for m in modes:
            cells = {r["category"]: cell(r) for r in bench["summary"]
                     if r["temperature"] == t and r["mode"] == m and r["batch_size"] == 1}
            if any(v is not None for v in cells.values()):
                body.append([t, m] + [cells.get(c) or "–" for c in cats + ["all"]])
    return table(["T", "mode"] + cats + ["all"], body)


def suite_section(bench: dict | None) -> list[str]:
    out = ["## Speculative modes on the bundled suite", ""]
    if bench is None:
        return out + missing("speedup per mode and category", "bash docs/reproduce.sh")
    out += [f"Command: `{command_line(bench)}`  ", f"Environment: {env_line(bench)}. "
            f"Report with every column: [bench-suite.md](results/bench-suite.md).", "",
            "`hybrid+head` drafts with the EAGLE-style head that ships with the package (its own runs: "
            "[bench-eagle.md](results/bench-eagle.md), [HEADS.md](HEADS.md)); `draft` and `hybrid` with the "
            "0.5B in its default format (int4-all) and vocabulary (32,768 tokens).", "",
            f"Speedup = median over the {repeats(bench)} repeat(s) of tokens/s ÷ plain tokens/s on the same prompts "
            "in the same repeat (modes interleaved prompt by prompt, prefill included); decode = the same ratio "
            "over the decode phase alone, as llama.cpp reports its eval speed (the tokens after the first round "
            "over the time after it; prefill and first round left out); "
            "τ = tokens per target pass; same = greedy output identical to plain decoding for every prompt.", ""]
    rows = [r for r in bench["summary"] if r["category"] == "all" and r["batch_size"] == 1]
    out += table(["T", "mode", "tok/s", "speedup", "decode", "acceptance", "τ", "α", "same as plain"],
                 [[r["temperature"], r["mode"], f(r["tokens_per_s"]), f(r["speedup"], "%.2fx"),
                   f(r.get("decode_speedup"), "%.2fx"), f(r.get("acceptance_rate")), f(r.get("tau")),
                   f(r.get("alpha")), same(r)] for r in rows])
    out += ["", "### By category (speedup vs plain)", ""]
    out += category_table(bench, lambda r: f(r["speedup"], "%.2fx"))
    if any(r.get("decode_speedup") for r in bench["summary"]):
        out += ["", "### By category, decode phase (prefill and first round left out, as llama.cpp reports)", ""]
        out += category_table(bench, lambda r: f(r.get("decode_speedup"), "%.2fx"))
    out += ["", "### By category, accounted (speedup from counts: see below)", ""]
    out += category_table(bench, lambda r: f(r["accounted_speedup"], "%.2fx") if r.get("accounted_speedup") else None)
    modes = [m for m in dict.fromkeys(r["mode"] for r in bench["summary"]) if m != "plain"]
    temps = sorted({r["temperature"] for r in bench["summary"]})
    out += ["", "Accounted speedup: plain decoding's c_p(1) for every token the rounds produced, over what the "
            "rounds cost — c_p(K+1) per round from the run's K histogram and its measured pass costs, plus the "
            "proposer's measured seconds (`accounted_speedup` in `bench/costs.py`). The machine's drift between "
            "one run and the next does not enter it, so it resolves the few per cent that the wall-clock ratios "
            "cannot; it leaves out per-round work outside the passes and prices every pass at its 128-token-context "
            "cost, so it reads a little above the wall clock where speculation is frequent.", ""]
    out += ["### `auto` against the rule \"never more than 3 % slower than plain in any category\"", ""]
    body = []
    for t in temps:
        for m in [m for m in modes if m.endswith("k=auto")]:
            cells = [r for r in bench["summary"] if r["temperature"] == t and r["mode"] == m
                     and r["category"] != "all" and r["batch_size"] == 1]
            if not cells:
                continue
            worst = min(cells, key=lambda r: r["speedup"])
            best = max(cells, key=lambda r: r["speedup"])
            counted = [r for r in cells if r.get("accounted_speedup") is not None]
            worst_acct = min(counted, key=lambda r: r["accounted_speedup"]) if counted else None
            spread = ", ".join(f"{x:.2f}" for x in worst.get("speedup_per_repeat", []))
            body.append([t, m, f"{worst['speedup']:.2f}x ({worst['category']})", spread or "–",
                         f"{best['speedup']:.2f}x ({best['category']})",
                         f"{worst_acct['accounted_speedup']:.2f}x ({worst_acct['category']})" if worst_acct else "–",
                         "yes" if worst["speedup"] >= 0.97 else "**no**",
                         "–" if worst_acct is None else "yes" if worst_acct["accounted_speedup"] >= 0.97 else "**no**"])
    out += table(["T", "mode", "worst category (wall clock)", "its repeats", "best category (wall clock)",
                  "worst category (accounted)", "within 3 % (wall clock)", "within 3 % (accounted)"], body) + [""]
    idle = [r["speedup"] for r in bench["summary"] if r["category"] != "all" and r["mode"] != "plain"
            and "tau" in r and r.get("acceptance_rate") is None and r["batch_size"] == 1]
    if idle:
        out += [f"Noise floor of this run: cells where a mode proposed nothing at all (so it did what plain "
                f"did) measured {min(idle):.2f}–{max(idle):.2f}x of plain ({len(idle)} cells) on the wall "
                f"clock: differences smaller than that are not resolved by 2 prompts × {bench['max_tokens']} "
                f"tokens × {repeats(bench)} repeat(s) per category — the accounted figures are. At T > 0 each mode "
                f"also samples its own answers, of their own lengths, so the prefill's share of the time differs "
                f"between modes on the wall clock and not in the accounted figure.", ""]
    return out


def fixedk_section(bench: dict | None, current: dict | None = None) -> list[str]:
    out = ["## Fixed K against `auto`, every proposer", ""]
    if bench is None:
        return out + missing("plain vs each proposer at fixed K vs auto", "bash docs/reproduce.sh")
    out += provenance(bench, current)
    out += [f"Command: `{command_line(bench)}` ([report](results/bench-fixedk.md)). All modes in one run, "
            "interleaved prompt by prompt. Cells: wall-clock speedup / accounted speedup vs plain "
            f"({repeats(bench)} repeat(s): the wall-clock figure moves by several per cent from run to run, "
            "the accounted one does not).", ""]
    return out + category_table(bench, lambda r: f"{f(r['speedup'], '%.2fx')} / {f(r.get('accounted_speedup'), '%.2fx')}") + [""]


def ksweep_section(bench: dict | None, current: dict | None = None) -> list[str]:
    out = ["## Draft model: speedup against K", ""]
    if bench is None:
        return out + missing("draft K sweep", "bash docs/reproduce.sh")
    out += provenance(bench, current)
    out += [f"Command: `{command_line(bench)}` ([report](results/bench-ksweep.md), "
            "[speedup vs K](results/plots-ksweep/speedup_vs_k.png), "
            "[acceptance by position](results/plots-ksweep/acceptance_by_position.png)).", ""]
    rows = [r for r in bench["summary"] if r["category"] == "all" and r["mode"] != "plain"]
    out += table(["T", "mode", "speedup", "predicted speedup", "τ", "predicted τ (from α)", "acceptance", "α"],
                 [[r["temperature"], r["mode"], f(r["speedup"], "%.2fx"), f(r.get("predicted_speedup"), "%.2fx"),
                   f(r.get("tau")), f(r.get("predicted_tau")), f(r.get("acceptance_rate")), f(r.get("alpha"))]
                  for r in rows]) + [""]
    return out


def costs_section(profile: dict | None) -> list[str]:
    out = ["## What a target pass costs", ""]
    if profile is None:
        return out + missing("c_p(n) and c_q", "verispec profile --json docs/results/profile.json")
    c_p = {int(n): v for n, v in profile["c_p"].items()}
    base = c_p[1]
    out += ["Command: `verispec profile --json docs/results/profile.json` (one 1.5B pass over n new tokens "
            f"after 128 cached, median of repeats; format {profile.get('dtype')}, the CPU default int4). "
            f"{machine_line(profile.get('environment', {}))}.", ""]
    ns = [n for n in (1, 2, 3, 4, 5, 6, 8, 9, 12, 16) if n in c_p]
    out += ["A 1-token pass is bound by reading the weights from memory; a wider pass by integer multiply "
            "throughput (the int4 and int6 layers: one `vpdpbusd` — 64 multiply-adds of 4-bit weights and 8-bit "
            "activations — per 16 columns, 4 k and row on AVX-512 VNNI; `vpmaddubsw` + `vpmaddwd` on AVX2), so "
            "c_p(n) grows with n once the multiplies outlast the memory reads. Passes of more than 6 rows take a "
            "second sweep over each weight tile. `--k auto` prices rounds with these costs (calibrated once per "
            "machine, then learned on the fly).", ""]
    out += table(["n"] + [str(n) for n in ns],
                 [["c_p(n) ms"] + [f(c_p[n] * 1e3, "%.0f") for n in ns],
                  ["c_p(n) / c_p(1)"] + [f(c_p[n] / base) for n in ns]])
    cq = profile["c_q"]
    cost = lambda name, label: (f"{label} {cq[name] * 1e3:.1f} ms ({cq[name] / base:.2f} × c_p(1))"
                                if name in cq else None)
    truncated = next((name for name in cq if name.startswith("draft/")), None)
    parts = [cost("draft", "draft model, whole vocabulary"),
             truncated and cost(truncated, f"over its {truncated.split('/')[1]} commonest tokens (the default)"),
             cost("head", "the shipped heads"), f"prompt lookup {cq['ngram'] * 1e3:.2f} ms"]
    out += ["", "Proposer cost per drafted token: " + "; ".join(p for p in parts if p) + ".", ""]
    if "c_p1_and_matmuls" in profile:
        pass1, matmuls = profile["c_p1_and_matmuls"]
        out += ["A 1-token pass against its matmuls alone (the same model's linears: every layer's q/k/v, o, "
                "gate/up and down and the LM head, each called once from Python — a native call with its own "
                f"thread start-up — alternated with 1-token passes): {pass1 * 1e3:.1f} ms against "
                f"{matmuls * 1e3:.1f} ms, c_p(1) = {pass1 / matmuls:.2f} × its matmuls. The pass is one native "
                "call for every layer with one set of threads, so it can take less than its matmuls called one "
                "by one.", ""]
    return out


def sampling_section(result: dict | None) -> list[str]:
    out = ["### Choosing the token after the pass", ""]
    if result is None:
        return out + missing("what greedy and sampled token choice cost", "python docs/measure_sampling.py")
    out += [f"Command: `python docs/measure_sampling.py --out docs/results/sampling.json` ({env_line(result)}). "
            f"The 1.5B's logits at each of {result['positions']} positions of a fixed text ({result['vocab']:,} each) through what a round does "
            "after its pass, timed alone: greedy takes the argmax; sampling warps the logits (temperature, top-k, "
            "top-p) and draws from them; a verify round does either over K + 1 = "
            f"{result['verify_k'] + 1} rows of logits with {result['verify_k']} drafts, all accepted. Medians of "
            "alternated repeats, milliseconds.", ""]
    rows = result["settings"]
    out += table(["setting", "per token ms", "per verify round ms"],
                 [[name, f(r["token_ms"], "%.2f"), f(r["verify_round_ms"], "%.2f")] for name, r in rows.items()])
    return out + [""]


def batch_section(bench: dict | None, current: dict | None = None) -> list[str]:
    out = ["## Batches", ""]
    if bench is None:
        return out + missing("batch > 1", "bash docs/reproduce.sh")
    out += provenance(bench, current)
    out += [f"Command: `{command_line(bench)}` ([report](results/bench-batch.md)). Tokens/s count every "
            "sequence of the batch.", ""]
    rows = [r for r in bench["summary"] if r["category"] == "all"]
    out += table(["T", "batch", "mode", "tok/s", "speedup", "acceptance", "τ", "same as plain"],
                 [[r["temperature"], r["batch_size"], r["mode"], f(r["tokens_per_s"]), f(r["speedup"], "%.2fx"),
                   f(r.get("acceptance_rate")), f(r.get("tau")), same(r)] for r in rows]) + [""]
    return out


def peer_section(bench: dict | None, current: dict | None = None) -> list[str]:
    out = ["## Peers in the same run", ""]
    if bench is None:
        return out + missing("Hugging Face transformers peer", "bash docs/reproduce.sh")
    out += provenance(bench, current)
    out += [f"Command: `{command_line(bench)}` ([report](results/bench-peer.md)). transformers runs the "
            "same GGUF weights dequantized to float32 (its CPU default); verispec runs its default "
            "(int8). Ratios are tokens/s measured in the same run on the same prompts.", ""]
    rows = {(r["temperature"], r["mode"]): r for r in bench["summary"] if r["category"] == "all"}
    body = []
    for (t, mode), r in rows.items():
        hf = rows.get((t, "hf plain"))
        body.append([t, mode, f(r["tokens_per_s"]), f(r["speedup"], "%.2fx"),
                     f(r["tokens_per_s"] / hf["tokens_per_s"] if hf else None, "%.2fx"),
                     same(r, no="no")])
    out += table(["T", "mode", "tok/s", "vs verispec plain", "vs hf plain", "same as verispec plain"], body)
    return out + [""]


def llamacpp_build_note(build: str | None) -> str:
    """' llama.cpp's build: <package/version; the CPU features it was compiled for>.' where the record names it."""
    return f" llama.cpp's build: {build}." if build else ""


def llamacpp_section(bench: dict | None, current: dict | None = None) -> list[str]:
    out = ["## llama.cpp on the same files", ""]
    if bench is None:
        return out + missing("llama.cpp peer", "bash docs/reproduce.sh (needs pip install -e '.[llamacpp]')")
    out += provenance(bench, current)
    out += [f"Command: `{command_line(bench)}` ([report](results/bench-llamacpp.md)). llama.cpp "
            "(llama-cpp-python, built from source for the machine's CPU) runs the same GGUF file with "
            "the same thread count: its own Q4_K/Q6_K kernels with 8-bit activations, where verispec runs its "
            "default format (Q4_K tensors in int4 with activations rounded to 8 bits per group of 32 as "
            "llama.cpp does — 16 bits in runs made before kernel ABI 12 — Q6_K tensors in int6 the same way, "
            "and the rest int8 with 16-bit activations). Its prompt-lookup mode is `LlamaPromptLookupDecoding` "
            "(10 tokens), the only speculative mode the Python package has. Tokens/s include prefill; "
            "ratios are measured in the same run on the same prompts. Greedy outputs of llama.cpp differ "
            "from ours where the two numerics pick different tokens."
            + llamacpp_build_note(bench["environment"].get("peers", {}).get("llama.cpp plain")), ""]
    for t in sorted({r["temperature"] for r in bench["summary"]}):
        rows = [r for r in bench["summary"] if r["temperature"] == t and r["batch_size"] == 1]
        cats = sorted({r["category"] for r in rows if r["category"] != "all"}) + ["all"]
        modes = list(dict.fromkeys(r["mode"] for r in rows))
        ref = {r["category"]: r["tokens_per_s"] for r in rows if r["mode"] == "llama.cpp plain"}
        body = []
        for m in modes:
            cells = {r["category"]: r for r in rows if r["mode"] == m}
            body.append([m] + [f"{f(cells[c]['tokens_per_s'])} ({f(cells[c]['tokens_per_s'] / ref[c], '%.2fx')})"
                               if c in cells and ref.get(c) else "–" for c in cats])
        setting = f"T = {t}" + (f", {truncation(bench)}" if t > 0 and truncation(bench) else "")
        out += [f"{setting}: tokens/s (× llama.cpp plain)", ""] + table(["mode"] + cats, body) + [""]
    return out


def formats_section(formats: dict | None) -> list[str]:
    out = ["## Weight formats", ""]
    if formats is None:
        return out + missing("decode speed, quality, peak RSS", "python docs/measure_formats.py")
    avx512 = "avx512f" in formats.get("environment", {}).get("cpu_flags", [])
    if formats.get("read_gb_s"):                 # recorded with the run: a torch sum over 1 GiB
        bandwidth = formats["read_gb_s"] * 1e9
        floor = (f"{bandwidth / 1e9:.1f} GB/s (the machine's read bandwidth, recorded with the run: a torch sum "
                 f"over 1 GiB, {formats.get('environment', {}).get('threads', 2)} threads)")
    else:                                        # older files: the machine kind's usual 2-thread read bandwidth
        bandwidth = 35e9 if avx512 else 20e9     # Zen 4 ~25–45 GB/s, Zen 3 ~20 GB/s
        floor = f"~{bandwidth / 1e9:.0f} GB/s (this machine kind's 2-thread read bandwidth)"
    out += [f"Command: `python docs/measure_formats.py`. Environment: {env_line(formats)}. Decode tok/s: plain "
            "greedy, 64 tokens, prefill excluded, median of 5, the formats alternated. Quality: against fp32 on a fixed "
            "150-token text. Load: `LLM(...)` with the format's cache file already written (files made before "
            "2026-12-07 may count writing it: tens of seconds). "
            f"Bandwidth floor: bytes of weights read per token ÷ {floor}.", ""]
    bytes_per_param = {"float32": 4, "bfloat16": 2, "int8": 1, "int4": 0.60, "int4-all": 0.58}  # older files: no step_mb
    params = {"qwen2.5-coder-0.5b-instruct": 0.494e9 + 0.136e9, "qwen2.5-coder-1.5b-instruct": 1.54e9 + 0.233e9}
    body = []
    for name, entry in formats["models"].items():
        for fmt, m in entry.items():
            step_bytes = m["step_mb"] * 1e6 if m.get("step_mb") else params.get(name, 0) * bytes_per_param[fmt]
            floor_ms = step_bytes / bandwidth * 1e3
            step_ms = 1e3 / m["tok_s"] if m.get("tok_s") else None
            body.append([name, fmt, f(m.get("tok_s")), ", ".join(str(x) for x in m.get("tok_s_runs", [])),
                         f(floor_ms, "%.0f"), f(floor_ms / step_ms * 100 if step_ms else None, "%.0f %%"),
                         f(m.get("top1_agreement"), "%.3f", "1 (reference)" if fmt == "float32" else "–"),
                         f(m.get("mean_kl"), "%.4f", "0" if fmt == "float32" else "–"), f(m.get("load_s"), "%.1f s")])
    out += table(["model", "format", "decode tok/s", "runs", "floor ms/token", "of floor", "top-1 vs fp32",
                  "KL(fp32‖fmt)", "load"], body)
    over = [row for row in body if row[5].endswith("%") and float(row[5].split()[0]) > 100]
    if over:
        out += ["", f"Above 100 % of the floor: memory read faster in that run than the {bandwidth / 1e9:.0f} GB/s the floor assumes "
                "(the machine's bandwidth moves with its neighbours; the kernels alone, below, are the closer gauge)."]
    rss = formats.get("pair_peak_rss_mb", {})
    out += ["", "Peak RSS of a process running the pair (1.5B target + 0.5B draft, draft proposer, 32 tokens; "
            "`default`: int4 target, int4-all draft): "
            + ", ".join(f"{fmt} {mb / 1024:.2f} GiB" for fmt, mb in rss.items()) + ".", ""]
    for name, kv in formats.get("kv_cache", {}).items():
        out += [f"KV cache formats (`--kv-dtype`, `python docs/measure_formats.py --kv-only`), {name} with its "
                f"default weights: quality against the float32 cache on the same text (scored in the engine's "
                f"exact prefill passes, so by the native pass as decode steps are); plain decode after a "
                f"{kv['prompt_tokens']}-token prompt, median of 5 alternated runs; positions one GiB of cache holds.", ""]
        out += table(["KV format", "top-1 vs float32 cache", "KL", "decode tok/s", "runs", "positions / GiB"],
                     [[fmt, f(e["top1_agreement"], "%.4g"), f(e["mean_kl"], "%.4f"), f(e["tok_s"]),
                       ", ".join(str(x) for x in e["tok_s_runs"]), f"{e['positions_per_gib']:,}"]
                      for fmt, e in kv.items() if isinstance(e, dict)])
        variant = formats.get("environment", {}).get("kernel_variant") or "?"
        out += ["", "The native pass reads and writes all three in place. Over a bfloat16 cache, the `avx512bf16` "
                "and `amx` kernels multiply with `vdpbf16ps`, the query and the softmax weights rounded to bf16; other "
                f"kernels widen the stored values to float32 (this machine's: `{variant}`). `auto` is bfloat16 "
                "wherever the native pass runs.", ""]
    return out


def kernel_section(kernel: dict | None) -> list[str]:
    out = ["## The matmul kernels alone", ""]
    if kernel is None:
        return out + missing("kernels by row count", "python docs/measure_kernel.py --out docs/results/kernel.json")
    if "fused" in next(iter(kernel["rows"].values())):
        return out + ["_Measured with an earlier version of the script; rerun `python docs/measure_kernel.py`._", ""]
    command = command_line(kernel) or "python docs/measure_kernel.py --out docs/results/kernel.json"
    out += [f"Command: `{command}` ({kernel['threads']} threads, "
            f"{machine_line(kernel)}). Matmuls only: random weights at the 1.5B's shapes streamed from memory, "
            "milliseconds for 28 layers (q/k/v, o, gate/up, down) + the LM head (int8, or int6 with the int6 "
            "layers), each instruction-set variant and format timed alternately in one process.", ""]
    rows = kernel["rows"]
    combos = list(next(iter(rows.values())))
    base = rows[min(rows, key=int)]
    out += table(["rows M"] + [f"{c} ms (× M = 1)" for c in combos],
                 [[m] + [f"{r[c] * 1e3:.1f} ({r[c] / base[c]:.2f})" for c in combos] for m, r in rows.items()]) + [""]
    return out


def variants_section(result: dict | None) -> list[str]:
    """Whole passes by kernel variant (docs/measure_variants.py); nothing where not measured (a CPU with one
    variant has nothing to compare)."""
    if result is None:
        return []
    out = ["### Whole passes by kernel variant", ""]
    out += [f"Command: `{command_line(result)}` ({result['threads']} threads, {machine_line(result)}). One "
            f"{result['model']} pass over n new tokens after 128 cached, default format, {result.get('kv_dtype', 'float32')} "
            f"cache; medians of {result['rounds']} rounds in which every variant this CPU runs times every width, "
            "the variants taking turns. The first column is the variant verispec runs here; the others are what a "
            "CPU without its extensions would run on this core and memory.", ""]
    variants = result["variants"]
    widths = list(next(iter(variants.values())))
    out += table(["n"] + [f"`{v}` ms (× n = 1)" for v in variants],
                 [[n] + [f"{t[n] * 1e3:.1f} ({t[n] / t['1']:.2f})" for t in variants.values()] for n in widths]) + [""]
    swept = {v: d for v, d in result.get("sweeps", {}).items() if d}
    if swept:
        out += ["Sweep schedules of the variants whose 16-column blocks are two 8-lane vectors, as this machine's "
                "whole passes chose them (kernels/sweeps.py) and, in a column marked \"compiled sweeps\", as built: "
                + "; ".join(f"`{v}` {d}" for v, d in swept.items()) + ".", ""]
    return out


def ttft_section(result: dict | None) -> list[str]:
    out = ["### Prefill and decode apart", ""]
    if result is None:
        return out + missing("time to first token and decode speed vs llama.cpp",
                             "python docs/measure_llamacpp.py --out docs/results/llamacpp-ttft.json")
    rows = result["rows"]
    out += [f"Command: `python docs/measure_llamacpp.py` ({result['environment']['threads']} threads, "
            f"{machine_line(result['environment'])}). Plain greedy decoding in verispec's default format; "
            f"time to first token (prefill) and tokens/s over the next {result['new_tokens']} tokens, each the "
            "median of 3 alternated runs per prompt." + llamacpp_build_note(result["environment"].get("llama_cpp")), ""]
    out += table(["prompt", "tokens", "TTFT llama.cpp s", "TTFT verispec s", "prefill × llama.cpp",
                  "decode llama.cpp tok/s", "decode verispec tok/s", "decode × llama.cpp"],
                 [[r["prompt"], r["prompt_tokens"], f(r["llama.cpp_ttft_s"], "%.3f"), f(r["verispec_ttft_s"], "%.3f"),
                   f(r["llama.cpp_ttft_s"] / r["verispec_ttft_s"], "%.2fx"), f(r["llama.cpp_decode_tok_s"], "%.1f"),
                   f(r["verispec_decode_tok_s"], "%.1f"), f(r["verispec_decode_tok_s"] / r["llama.cpp_decode_tok_s"], "%.2fx")]
                  for r in rows])
    suite = [r for r in rows if r["prompt"] != "long-copy"]
    if suite:
        geo = lambda xs: 2 ** (sum(__import__("math").log2(x) for x in xs) / len(xs))
        out += ["", f"Bundled suite, geometric means: prefill {geo([r['llama.cpp_ttft_s'] / r['verispec_ttft_s'] for r in suite]):.2f}x "
                f"llama.cpp's speed, decode {geo([r['verispec_decode_tok_s'] / r['llama.cpp_decode_tok_s'] for r in suite]):.2f}x "
                "(above 1: verispec faster).", ""]
    return out + [""]


def llamacpp_cli_section(result: dict | None) -> list[str]:
    out = ["### llama.cpp's own programs and its n-gram mode, answers in full", ""]
    if result is None:
        return out + missing("llama.cpp's command-line plain and n-gram modes on the code-editing prompts and the long copy",
                             "python docs/measure_llamacpp_cli.py --bin LLAMA_CPP/build/bin")
    programs = [k for k, v in result["summary"][0].items() if isinstance(v, dict)]
    out += [f"Command: `{result['command']}` ({env_line(result)}). llama.cpp's `llama-completion` (plain) and "
            "`llama-speculative-simple --spec-type ngram-simple --spec-draft-n-max 48` (12-token matches, drafts of up "
            "to 48), built on the same machine for its CPU, run the same GGUF file with the same threads, "
            "greedy, beside verispec's plain decoding and its default mode; the four take turns. Each cell: decode "
            "tokens/s as the program counts them (× llama.cpp's plain decode), the prefill in seconds, and the tokens "
            "generated; medians over repeats. \"same\": the answers equal the same program's plain ones (llama.cpp's "
            "answers may differ from verispec's, since the two compute with different numerics)."
            + llamacpp_build_note(result["llama_cpp"].get("build")), ""]
    body = []
    for s in result["summary"]:
        base = s["llama.cpp plain"]["decode_tok_s"]
        body.append([s["prompt"], s["prompt_tokens"]] + [
            f"{f(s[p]['decode_tok_s'], '%.1f')} ({f(s[p]['decode_tok_s'] / base if base and s[p]['decode_tok_s'] else None, '%.2fx')}), "
            f"{f(s[p]['prefill_s'], '%.1f')} s, {s[p]['generated_tokens']:.0f} tok"
            + ("" if p.endswith("plain") else f", {'same' if s[p]['same_text_as_own_plain'] else '**differs**'}")
            for p in programs])
    out += table(["prompt", "prompt tokens"] + programs, body)
    return out + [""]

def longcopy_section(bench: dict | None) -> list[str]:
    out = ["## A long copy: rewriting a 300-line file with one change", ""]
    if bench is None:
        return out + missing("long-copy prompt", "bash docs/reproduce.sh")
    out += [f"Command: `{command_line(bench)}` ([report](results/bench-longcopy.md)). Environment: "
            f"{env_line(bench)}. The prompt ([docs/prompts/long-copy.jsonl](prompts/long-copy.jsonl)) asks for "
            "a 301-line Python file back with one function renamed; tokens/s include the prefill of the "
            "~3,000-token prompt; the decode columns leave out the prefill and the first round, as llama.cpp "
            "reports its eval speed.", ""]
    rows = [r for r in bench["summary"] if r["category"] == "all"]
    out += table(["mode", "tok/s", "speedup", "decode tok/s", "decode speedup", "acceptance", "τ", "same as plain"],
                 [[r["mode"], f(r["tokens_per_s"]), f(r["speedup"], "%.2fx"), f(r.get("decode_tokens_per_s")),
                   f(r.get("decode_speedup"), "%.2fx"), f(r.get("acceptance_rate")),
                   f(r.get("tau")), same(r)] for r in rows])
    for run in (r for r in bench["runs"] if r["mode"] != "plain"):
        hist = run["spec"].get("k_histogram", {})
        out += ["", f"K per round ({run['mode']}): " + ", ".join(f"K = {k}: {n}" for k, n in
                                                                 sorted(hist.items(), key=lambda kv: int(kv[0]))), ""]
        by = run["spec"].get("by_source")
        if by:
            out += [f"Rounds by source ({run['mode']}, `spec.by_source`): " + ", ".join(
                f"{name}: {v['rounds']} rounds, K {v['proposed'] / v['rounds']:.1f} on average, "
                f"{f(v['acceptance_rate'])} accepted" for name, v in by.items())]
    return out + [""]


def serving_section(load: dict | None, current_kernel: str | None = None) -> list[str]:
    out = ["## Serving under load", ""]
    if load is None:
        return out + missing("TTFT/TPOT/throughput", "bash docs/reproduce.sh")
    env = load.get("environment", {})
    theirs = env.get("kernel", env.get("int8_kernel"))
    if current_kernel and theirs != current_kernel:
        out += [f"Measured with an earlier build of verispec than the sections above (kernel: {theirs or 'not recorded'}; "
                f"above: {current_kernel}) and not rerun since — its absolute figures are slower than today's.", ""]
    out += [f"Command: `{command_line(load)}` ([report](results/loadtest.md)). Streaming chat requests from the "
            f"bundled suite, greedy, max_tokens {load['max_tokens']}, closed loop; goodput = tokens of requests "
            f"with TTFT ≤ {load['slo']['ttft_s']} s and TPOT ≤ {load['slo']['tpot_s']} s, per second.", ""]

    def ms(stat):
        return f"{f(stat['median'] and stat['median'] * 1e3, '%.0f')} / {f(stat['p99'] and stat['p99'] * 1e3, '%.0f')}"

    out += table(["server", "concurrency", "ok", "TTFT ms med / p99", "TPOT ms med / p99", "ITL ms med / p99",
                  "E2E s med / p99", "throughput tok/s", "goodput tok/s", "acceptance"],
                 [[r["server"] or "default", r["concurrency"], f"{r['ok']}/{r['requests']}", ms(r["ttft_s"]),
                   ms(r["tpot_s"]), ms(r["itl_s"]),
                   f"{f(r['e2e_s']['median'], '%.1f')} / {f(r['e2e_s']['p99'], '%.1f')}",
                   f(r["throughput_tok_s"]), f(r["goodput_tok_s"]), f(r.get("acceptance_rate"))]
                  for r in load["rows"]]) + [""]
    plain = {r["concurrency"]: r["throughput_tok_s"] for r in load["rows"] if r["server"] == "--proposer none"}
    idle = [r["throughput_tok_s"] / plain[r["concurrency"]] for r in load["rows"]
            if r["server"] != "--proposer none" and r.get("acceptance_rate") is None and plain.get(r["concurrency"])]
    if idle:
        out += [f"The servers run one after the other, not interleaved, so their ratios carry the machine's drift: "
                f"rows where the speculative server never speculated (acceptance –, the same work as plain) "
                f"measured {min(idle):.2f}–{max(idle):.2f}x of plain throughput.", ""]
    out += ["At concurrency 16 both servers are bound by prefilling 16 prompts on 2 cores (TTFT of tens of "
            "seconds, so goodput under the default objectives is 0); those rows move by tens of percent between "
            "runs. Under `--k auto` a batch shares one K, which falls to 0 when the batch is wide enough that "
            "speculation stops paying ([SERVING.md](SERVING.md)).", ""]
    return out


def verify_section(report: dict | None, current: dict | None = None) -> list[str]:
    out = ["## Losslessness certificate on the real pair", ""]
    if report is None:
        return out + missing("verify", "bash docs/reproduce.sh")
    out += provenance(report, current)
    out += [f"Command: `{command_line(report)}`.", "",
            f"Verdict: **{report['verdict']}** (Bonferroni threshold p < {report['threshold']:.2g}; the run "
            f"detects biases of total variation ≳ {report['resolution_tv']:.3f}).", ""]
    out += table(["prompt", "token", "source", "samples", "cells", "TV to exact", "p-value"],
                 [[repr(c["prompt"])[:40].replace("|", "\\|"), c["position"], c["source"], c["samples"], c["cells"],
                   f(c["tv"], "%.4f"), f(c["chi2_p"], "%.3g")] for c in report["checks"]]) + [""]
    return out


# Other machine kinds: the same measurements in docs/results/<kind>/, rendered with the same sections.
OTHER_KINDS = {"avx2": "An AVX2-only machine", "zen1": "A Zen/Zen+ EPYC: AVX2 on 128-bit units",
               "xeon": "An Intel Xeon with AVX-512 VNNI, AVX512_BF16 and AMX",
               "avxvnni": "The same Xeon as an AVX2 + AVX-VNNI machine (Intel cores since Alder Lake)"}

# How a kind was measured, where that differs from running the commands on a machine of the kind.
KIND_NOTES = {"avxvnni": "Measured on the Xeon of the section above with `VERISPEC_KERNEL_ISA=avxvnni` before each "
              "command (the `avxvnni` kernels: AVX2 with AVX-VNNI, no AVX-512 or AMX), beside a llama.cpp built "
              "there with AVX2 and AVX_VNNI but without AVX-512 and AMX (`-DGGML_NATIVE=OFF -DGGML_AVX512=OFF "
              "-DGGML_AVX_VNNI=ON …`): the instructions an Intel Core since Alder Lake has, on the same core "
              "design as its performance cores (Golden Cove); such a machine's memory and efficiency cores differ."}


def for_kind(lines: list[str], kind: str) -> list[str]:
    """A section rendered for docs/results/<kind>/: its headings one level down, its paths into <kind>/
    where that kind has the file (a command recorded with the <kind>/ path already in it keeps it; a
    report measured only on the reference machine, such as the heads' runs, stays linked there)."""
    into = re.compile(rf"(docs/results/|\(results/)(?!{re.escape(kind)}/)([\w.-]+)")

    def move(m: re.Match) -> str:
        return f"{m[1]}{kind}/{m[2]}" if (RESULTS / kind / m[2]).exists() else m[0]

    return [into.sub(move, "#" + line if line.startswith("#") else line) for line in lines]


def kind_section(kind: str, title: str) -> list[str]:
    """Every measurement made on another machine kind: costs, prefill and decode against llama.cpp,
    whole answers against llama.cpp, the suite, the long copy, the weight formats, the matmul kernels."""
    loaded = [(fn, load(f"{kind}/{name}")) for fn, name in (
        (costs_section, "profile.json"), (variants_section, "variants.json"), (sampling_section, "sampling.json"), (ttft_section, "llamacpp-ttft.json"), (llamacpp_section, "bench-llamacpp.json"),
        (llamacpp_cli_section, "llamacpp-cli.json"),
        (suite_section, "bench-suite.json"), (longcopy_section, "bench-longcopy.json"), (formats_section, "formats.json"),
        (kernel_section, "kernel.json"))]
    found = [(fn, result) for fn, result in loaded if result is not None]
    if not found:
        return []
    out = [f"## {title}", "",
           f"The same commands on another machine kind, results in `docs/results/{kind}/` (each section names "
           "its CPU, vector extensions and kernel build). Ratios compare programs measured in the same run on "
           "that machine; absolute figures do not compare with the sections above." +
           (f" {KIND_NOTES[kind]}" if kind in KIND_NOTES else ""), ""]
    for fn, result in found:
        out += for_kind(fn(result), kind)
    return out


def main() -> None:
    out = ["# Performance", "",
           "Generated by `python docs/make_performance.py` from the files in `docs/results/` — do not edit "
           "by hand. `bash docs/reproduce.sh` reruns every measurement (about an hour and a half on the reference "
           "machine) and then this script. The history of changes and what each did is in "
           "[PERFORMANCE_LOG.md](PERFORMANCE_LOG.md).", "",
           "Machines: 2 cores, 24 GiB, no GPU, 2 threads — a Zen 4 EPYC with AVX-512 VNNI (the reference), a Zen 2 "
           "EPYC with AVX2 only, a Zen/Zen+ EPYC whose AVX2 runs on 128-bit units, or an Intel Xeon with AVX-512 VNNI, "
           "AVX512_BF16 and AMX, also measured with AVX-512 and AMX set aside (the last four sections); every section names the CPU, its vector extensions and the kernel build that "
           "made it, and sections measured on another machine kind or an earlier build say so. Timings on "
           "shared machines are noisy: compare ratios measured in one run, not absolute times across runs.", ""]
    suite = load("bench-suite.json")
    out += suite_section(suite)
    out += fixedk_section(load("bench-fixedk.json"), suite)
    out += costs_section(load("profile.json"))
    out += variants_section(load("variants.json"))
    out += sampling_section(load("sampling.json"))
    out += ksweep_section(load("bench-ksweep.json"), suite)
    out += batch_section(load("bench-batch.json"), suite)
    out += peer_section(load("bench-peer.json"), suite)
    out += llamacpp_section(load("bench-llamacpp.json"), suite)
    out += ttft_section(load("llamacpp-ttft.json"))
    out += llamacpp_cli_section(load("llamacpp-cli.json"))
    out += longcopy_section(load("bench-longcopy.json"))
    out += formats_section(load("formats.json"))
    out += kernel_section(load("kernel.json"))
    out += serving_section(load("loadtest.json"), suite and suite.get("environment", {}).get("kernel", suite.get("environment", {}).get("int8_kernel")))
    out += verify_section(load("verify.json"), suite)
    for kind, title in OTHER_KINDS.items():
        out += kind_section(kind, title)
    (DOCS / "PERFORMANCE.md").write_text("\n".join(out).rstrip() + "\n")
    print(f"wrote {DOCS / 'PERFORMANCE.md'}")


if __name__ == "__main__":
    main()
