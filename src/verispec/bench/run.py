"""Run a prompt suite under several modes in one process, interleaved so machine drift hits all
modes alike, and report speedup vs plain decoding measured in the same run."""

from __future__ import annotations

import platform
import statistics
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch

from verispec.bench.costs import accounted_speedup, predicted_speedup
from verispec.bench.settings import Setting, applied, parse_settings
from verispec.engine.calibrate import pass_cost, pass_costs
from verispec.bench.suites import BenchPrompt
from verispec.engine.llm import LLM
from verispec.engine.params import SamplingParams
from verispec.engine.loading import LoadedModel
from verispec.errors import VerispecError


@dataclass(frozen=True)
class Mode:
    proposer: str        # "none" | a registered proposer
    k: int | str         # an integer, or "auto"
    fallback: str = ""   # "head": hybrid falls back on the heads instead of the draft model ("hybrid+head")
    branches: int | str = "auto"   # alternative branches beside a draft ("ngram/b0": chains only, "/b2": up to 2)
    settings: tuple[Setting, ...] = ()   # tuning constants set while this mode runs (bench/settings.py)

    @property
    def label(self) -> str:
        name = f"{self.proposer}+{self.fallback}" if self.fallback else self.proposer
        tail = "" if self.branches == "auto" else f" b={self.branches}"
        if self.settings:
            tail += " [" + ";".join(f"{path.rpartition('.')[2]}={value}" for path, value in self.settings) + "]"
        return "plain" if self.proposer == "none" else f"{name} k={self.k}{tail}"

    @property
    def needs_draft(self) -> bool:
        return self.proposer in ("draft", "hybrid") and self.fallback != "head"

    @property
    def needs_heads(self) -> bool:
        return self.proposer == "head" or self.fallback == "head"


def split_modes(text: str) -> list[str]:
    """--modes' comma-separated list, commas inside a mode's [settings] left alone."""
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    return [m.strip() for m in out + [cur] if m.strip()]


def parse_modes(modes: list[str], ks: list[int | str]) -> list[Mode]:
    """Mode names (draft, ngram, hybrid, head, hybrid+head), each with an optional /bN suffix and an
    optional [module.NAME=value;…] of tuning constants set while it runs (bench/settings.py)."""
    out = [Mode("none", 0)]
    for m in modes:
        if m in ("plain", "none"):
            continue
        settings: tuple[Setting, ...] = ()
        if "[" in m:
            m, _, inner = m.partition("[")
            if not inner.endswith("]"):
                raise VerispecError(f"mode {m + '[' + inner!r}: settings go in one pair of brackets at its end, "
                                    "e.g. hybrid[engine.acceptance_rates.MODEL_EMA=0.2]")
            settings = parse_settings(inner[:-1])
        name, _, tail = m.partition("/")
        proposer, _, fallback = name.partition("+")
        if fallback and (proposer, fallback) != ("hybrid", "head"):
            raise VerispecError(f"unknown mode {m!r}: the one combined mode is hybrid+head")
        branches: int | str = "auto"
        if tail:
            if not (tail.startswith("b") and (tail[1:] == "auto" or tail[1:].isdigit())):
                raise VerispecError(f"unknown mode suffix {tail!r} in {m!r}: /bN (up to N alternative "
                                    "branches, 0 = chains only) or /bauto")
            branches = tail[1:] if tail[1:] == "auto" else int(tail[1:])
        out += [Mode(proposer, k, fallback, branches, settings) for k in ks]
    labels = [mode.label for mode in out]
    if len(set(labels)) < len(labels):
        raise VerispecError(f"--modes names a mode twice ({', '.join(sorted({x for x in labels if labels.count(x) > 1}))})")
    return out


def run_bench(target: LoadedModel, draft: LoadedModel | None, prompts: list[BenchPrompt], modes: list[Mode],
              temperatures: list[float], max_tokens: int, repeats: int, batch_sizes: list[int] = (1,),
              seed: int = 0, progress=True, peers: list | None = None, draft_vocab: int | str = "auto", head: str | None = None,
              kv_dtype: str = "auto", draft_stop: float | str = "auto", top_k: int = 0, top_p: float = 1.0) -> dict:
    """peers: HFPeer-like modes (bench/peers.py) run on the same prompts, interleaved, batch size 1.
    top_k, top_p: the truncation every sampled run (T > 0) applies, verispec's modes and peers alike (0 and 1.0: off).
    progress: True (a line on stderr), False, or a callable (done, total, description).
    draft_vocab: the draft modes' truncated vocabulary ("auto", or N; 0 = full); kv_dtype: every mode's KV cache format;
    draft_stop: the draft model's early stop (proposers/draft.py)."""
    SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p)   # bad values fail before any run
    if head is None and any(m.needs_heads for m in modes):
        from verispec.heads import shipped_heads

        head = shipped_heads(target.name)
    llms = {}
    for m in modes:                     # a mode's settings hold while its LLM is built and while it generates
        with _in_mode(m):
            llms[m] = LLM(target, draft=draft if m.needs_draft else None, proposer=m.proposer, k=m.k,
                          draft_vocab=draft_vocab if m.needs_draft else 0, kv_dtype=kv_dtype,
                          head=head if m.needs_heads else None, branches=m.branches, draft_stop=draft_stop)
    plain_llm = llms[modes[0]]
    texts = [p.render(plain_llm) for p in prompts]
    costs = measure_costs(target, draft, sorted({m.k for m in modes if isinstance(m.k, int)}))
    for mode in modes:          # warm-up: first calls pay one-off costs that would bias the first mode
        with _in_mode(mode):
            llms[mode].generate([texts[0]], SamplingParams(temperature=0, max_tokens=4))
    peers = peers or []
    prompt_ids = [plain_llm.encode(t) for t in texts]
    for peer in peers:
        peer.generate([prompt_ids[0]], 0.0, 4, seed)
    runs = []
    total = len(temperatures) * len(batch_sizes) * repeats * (len(modes) + len(peers)) * len(prompts)
    done = 0
    for temp in temperatures:
        for bs in batch_sizes:
            for rep in range(repeats):
                for start in range(0, len(prompts), bs):
                    group = list(range(start, min(start + bs, len(prompts))))
                    # Rotate which mode runs first from one group to the next, so that whatever a
                    # position in the order costs (allocator, caches, clocks) falls on every mode alike.
                    shift = (start // bs + rep) % len(modes)
                    for mode in modes[shift:] + modes[:shift]:
                        # No seed: sampled runs then use the measured-cost K policy, what users get by default
                        # (a seeded request follows the fixed-cost schedule, see KPolicy.choose).
                        params = SamplingParams(temperature=temp, max_tokens=max_tokens, top_k=top_k, top_p=top_p)
                        llms[mode].clear_prefix_cache()          # every repeat prefills its prompt, as peers do
                        with _in_mode(mode):
                            t = time.perf_counter()
                            outs = llms[mode].generate([texts[i] for i in group], params)
                            wall = time.perf_counter() - t
                        for i, o in zip(group, outs):
                            runs.append({"prompt": prompts[i].id, "category": prompts[i].category,
                                         "mode": mode.label, "proposer": mode.proposer, "k": mode.k,
                                         "temperature": temp, "batch_size": bs, "repeat": rep,
                                         "wall_s": wall / len(group), "batch_wall_s": wall,
                                         "generated_tokens": o.generated_tokens, "token_ids": o.token_ids,
                                         "prefill_s": o.prefill_s, "decode_s": o.decode_s,
                                         "first_tokens": o.first_tokens, "spec": o.spec})
                        done += len(group)
                        _progress(progress, done, total, temp, bs, mode.label, prompts[group[0]].id)
                    for peer in peers:
                        for i in group:
                            t = time.perf_counter()
                            o = peer.generate([prompt_ids[i]], temp, max_tokens, seed + rep, top_k=top_k, top_p=top_p)[0]
                            runs.append({"prompt": prompts[i].id, "category": prompts[i].category,
                                         "mode": peer.label, "proposer": "peer", "k": 0, "temperature": temp,
                                         "batch_size": bs, "repeat": rep, "wall_s": time.perf_counter() - t,
                                         "generated_tokens": o["generated_tokens"], "token_ids": o["token_ids"],
                                         "spec": None})
                            done += 1
                            _progress(progress, done, total, temp, bs, peer.label, prompts[i].id)
    if progress is True:
        print(file=sys.stderr)
    kv = plain_llm.kv_dtype or target.model.dtype                 # what `auto` resolved to, for the record
    env = {**environment(), "kv_cache": str(kv).removeprefix("torch.")}
    if peers:
        env["peers"] = {peer.label: peer.build for peer in peers}
    return {"environment": env, "costs": costs, "runs": runs,
            "summary": summarize(runs, modes + peers, costs), "max_tokens": max_tokens,
            "sampling": {"top_k": top_k, "top_p": top_p}}


@contextmanager
def _in_mode(mode: Mode):
    """The mode's settings in force (bench/settings.py); an error they cause (a value the code refuses, such
    as a probability above 1) ends in a VerispecError that names them instead of a traceback."""
    with applied(mode.settings):
        try:
            yield
        except VerispecError:
            raise
        except (ValueError, TypeError, ZeroDivisionError, IndexError) as exc:
            if not mode.settings:
                raise
            raise VerispecError(f"mode {mode.label!r}: its settings broke it ({type(exc).__name__}: {exc})") from None


def _progress(show, done: int, total: int, temp: float, bs: int, label: str, prompt: str) -> None:
    if callable(show):
        show(done, total, f"T={temp} bs={bs} {label} {prompt}")
    elif show:
        print(f"\r[{done}/{total}] T={temp} bs={bs} {label:<14} {prompt:<16}", end="", file=sys.stderr, flush=True)


def measure_costs(target: LoadedModel, draft: LoadedModel | None, ks: list[int]) -> dict:
    ns = sorted({1, 2, 3, 5, 9} | {k + 1 for k in ks})
    c_p = pass_costs(target.model, ns)
    c_q = pass_cost(draft.model, 1) if draft is not None else None
    return {"c_p": c_p, "c_q_draft": c_q,
            "verify_ratio": {n: c_p[n] / c_p[1] for n in ns},
            "draft_to_target": c_q / c_p[1] if c_q else None}


def summarize(runs: list[dict], modes: list[Mode], costs: dict) -> list[dict]:
    """One row per (temperature, batch size, mode, category | 'all')."""
    rows = []
    keys = sorted({(r["temperature"], r["batch_size"]) for r in runs})
    for temp, bs in keys:
        sel = [r for r in runs if r["temperature"] == temp and r["batch_size"] == bs]
        cats = sorted({r["category"] for r in sel}) + ["all"]
        for cat in cats:
            in_cat = [r for r in sel if cat == "all" or r["category"] == cat]
            for mode in modes:
                mine = [r for r in in_cat if r["mode"] == mode.label]
                if not mine:
                    continue
                rate = _rate(in_cat, mode.label)
                ratios = _paired_ratios(in_cat, mode.label)
                row = {"temperature": temp, "batch_size": bs, "category": cat, "mode": mode.label,
                       "tokens_per_s": rate, "speedup": statistics.median(ratios) if ratios else None,
                       "speedup_per_repeat": ratios}
                if bs == 1:                    # one sequence at a time: its first token splits its time
                    decode = _paired_ratios(in_cat, mode.label, decode=True)
                    row |= {"decode_tokens_per_s": _rate(in_cat, mode.label, decode=True),
                            "decode_speedup": statistics.median(decode) if decode else None}
                if mode.proposer not in ("none", "peer"):
                    row |= _spec_summary(mine, mode, costs)
                unset = replace(mode, settings=()) if getattr(mode, "settings", ()) else None
                if unset in modes:                     # an A/B: against its twin run without the settings
                    ratios = _paired_ratios(in_cat, mode.label, base=unset.label)
                    row |= {"against": unset.label, "against_per_repeat": ratios,
                            "against_speedup": statistics.median(ratios) if ratios else None}
                if mode.proposer != "none" and temp == 0:
                    ref = {(r["prompt"], r["repeat"]): r["token_ids"] for r in in_cat if r["mode"] == "plain"}
                    row["identical_to_plain"] = all(r["token_ids"] == ref.get((r["prompt"], r["repeat"]))
                                                    for r in mine)
                rows.append(row)
    return rows


def _rates_per_repeat(runs: list[dict], label: str, decode: bool = False) -> dict[int, float]:
    """repeat -> tokens / seconds, both summed over that repeat's prompts. decode: the decode phase
    only, as llama.cpp reports its eval speed — the tokens after those of the first round, over the
    time from the first round's end to the last token (prefill and the first round left out);
    nothing for runs that do not record it (peers)."""
    per_repeat = {}
    for r in runs:
        if r["mode"] != label:
            continue
        if decode and r.get("decode_s") is None:
            return {}
        tok, sec = per_repeat.get(r["repeat"], (0, 0.0))
        per_repeat[r["repeat"]] = ((tok + r["generated_tokens"] - r["first_tokens"], sec + r["decode_s"]) if decode
                                   else (tok + r["generated_tokens"], sec + r["wall_s"]))
    return {rep: t / s for rep, (t, s) in per_repeat.items() if s > 0}


def _rate(runs: list[dict], label: str, decode: bool = False) -> float | None:
    """Median over repeats of (tokens / seconds) summed over the prompts of that repeat."""
    rates = list(_rates_per_repeat(runs, label, decode).values())
    return statistics.median(rates) if rates else None


def _paired_ratios(runs: list[dict], label: str, decode: bool = False, base: str = "plain") -> list[float]:
    """Per repeat, this mode's rate ÷ the base mode's (plain's) rate over the same prompts of the same
    repeat (the two ran interleaved, prompt by prompt): a pair shares the machine's state at that time,
    so drift between repeats cancels. The reported speedup is the median of these."""
    mine, other = _rates_per_repeat(runs, label, decode), _rates_per_repeat(runs, base, decode)
    return [mine[rep] / other[rep] for rep in sorted(mine) if rep in other]


def _spec_summary(runs: list[dict], mode: Mode, costs: dict) -> dict:
    s = [r["spec"] for r in runs]
    proposed = sum(x["proposed"] for x in s)
    accepted = sum(x["accepted"] for x in s)
    rounds = sum(x["rounds"] for x in s)
    emitted = sum(r["generated_tokens"] for r in runs)
    alphas = [(x["alpha"], x["rounds"]) for x in s if x["alpha"] is not None]
    alpha = sum(a * w for a, w in alphas) / sum(w for _, w in alphas) if alphas else None
    k = mode.k if isinstance(mode.k, int) else _mean_k(s)
    width = max((len(x["per_position_acceptance"]) for x in s), default=0)
    per_pos = []
    for i in range(width):
        vals = [(x["per_position_acceptance"][i], x["rounds"]) for x in s
                if i < len(x["per_position_acceptance"]) and x["per_position_acceptance"][i] is not None]
        per_pos.append(sum(v * w for v, w in vals) / sum(w for _, w in vals) if vals else None)
    out = {"acceptance_rate": accepted / proposed if proposed else None,
           "tau": emitted / rounds if rounds else None, "alpha": alpha,
           "predicted_tau": None if alpha is None else (k + 1.0 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)),
           "per_position_acceptance": per_pos,
           "draft_s": sum(x["draft_s"] for x in s), "verify_s": sum(x["verify_s"] for x in s),
           "other_s": sum(x["other_s"] for x in s)}
    if runs[0]["batch_size"] == 1:             # c_p is measured for one sequence
        out["accounted_speedup"] = accounted_speedup(s, costs.get("c_p", {}))
    c_q = costs["c_q_draft"] if mode.proposer in ("draft", "hybrid") else 0.0
    if alpha is not None and isinstance(mode.k, int) and (k + 1) in costs["c_p"] and c_q is not None:
        out["predicted_speedup"] = predicted_speedup(alpha, k, c_q, costs["c_p"])
    return out


def _mean_k(specs: list[dict]) -> int:
    hist: dict[int, int] = {}
    for x in specs:
        for k, v in x["k_histogram"].items():
            if int(k) > 0:
                hist[int(k)] = hist.get(int(k), 0) + v
    return round(sum(k * v for k, v in hist.items()) / sum(hist.values())) if hist else 0


def speedup_range(row: dict) -> str:
    """'lowest–highest' of a row's per-repeat speedups ('–' for plain or a single repeat)."""
    ratios = row.get("speedup_per_repeat") or []
    if row["mode"] == "plain" or len(ratios) < 2:
        return "–"
    return f"{min(ratios):.2f}–{max(ratios):.2f}"


def environment() -> dict:
    import verispec
    from verispec.kernels import machine

    return {"verispec": verispec.__version__, "torch": torch.__version__, "python": platform.python_version(),
            "threads": torch.get_num_threads(), "platform": platform.platform(), **machine()}


def format_table(result: dict) -> str:
    c = result["costs"]
    lines = ["measured costs: " + ", ".join(f"c_p({n})={v * 1e3:.0f}ms" for n, v in c["c_p"].items())
             + (f", c_q={c['c_q_draft'] * 1e3:.0f}ms (draft/target {c['draft_to_target']:.2f})" if c["c_q_draft"] else "")]
    hdr = f"{'T':>4} {'bs':>3} {'category':<14} {'mode':<16} {'tok/s':>7} {'speedup':>8} {'range':>9} {'decode':>7} {'acct':>6} {'pred':>6} {'accept':>7} {'tau':>5} {'pred_tau':>8} {'alpha':>6} {'same':>5}"
    lines += [hdr, "-" * len(hdr)]
    f = lambda v, fmt: (fmt % v) if isinstance(v, (int, float)) else "-"
    for r in result["summary"]:
        lines.append(f"{r['temperature']:>4} {r['batch_size']:>3} {r['category']:<14} {r['mode']:<16} "
                     f"{f(r['tokens_per_s'], '%.2f'):>7} {f(r['speedup'], '%.2fx'):>8} {speedup_range(r):>9} "
                     f"{f(r.get('decode_speedup'), '%.2fx'):>7} {f(r.get('accounted_speedup'), '%.2fx'):>6} {f(r.get('predicted_speedup'), '%.2fx'):>6} "
                     f"{f(r.get('acceptance_rate'), '%.0f%%' if False else '%.2f'):>7} {f(r.get('tau'), '%.2f'):>5} "
                     f"{f(r.get('predicted_tau'), '%.2f'):>8} {f(r.get('alpha'), '%.2f'):>6} "
                     f"{str(r.get('identical_to_plain', '-')):>5}")
    return "\n".join(lines + settings_lines(result))


def settings_lines(result: dict) -> list[str]:
    """A line per mode run with settings beside its twin without them (an A/B in one process): its rate
    over the twin's, per repeat and the median, for every category."""
    lines = []
    for r in result["summary"]:
        if r.get("against_per_repeat"):
            per = ", ".join(f"{x:.3f}" for x in r["against_per_repeat"])
            lines.append(f"T={r['temperature']} bs={r['batch_size']} {r['category']}: {r['mode']} ÷ {r['against']} "
                         f"= {r['against_speedup']:.3f} (per repeat {per})")
    return (["", "with settings against the same mode without them, paired by repeat:"] + lines) if lines else []


def machine_line(env: dict) -> str:
    """'CPU <model>, <core> (<vector extensions>), kernel: <status>' from an environment record (older
    records name no core, or only the kernel)."""
    kernel = env.get("kernel", env.get("int8_kernel", "torch"))
    kv = f", KV cache {env['kv_cache']}" if "kv_cache" in env else ""
    if "cpu_model" not in env:
        return f"kernel: {kernel}{kv}"
    core = f", {env['cpu_core']}" if env.get("cpu_core") else ""
    return f"CPU {env['cpu_model']}{core} ({' '.join(env.get('cpu_flags', [])) or 'no AVX2'}), kernel: {kernel}{kv}"


def truncation(result: dict) -> str:
    """What the sampled runs (T > 0) kept of each distribution, e.g. 'top_k 40, top_p 0.95'; '' for the
    whole distribution (so do records made before the field existed)."""
    sampling = result.get("sampling") or {}
    top_k, top_p = sampling.get("top_k", 0), sampling.get("top_p", 1.0)
    return ", ".join([f"top_k {top_k}"] * bool(top_k) + [f"top_p {top_p}"] * (top_p < 1.0))


def sampling_line(result: dict) -> str:
    return f"Sampling at T > 0: {truncation(result) or 'the whole distribution (no top-k, no top-p)'}."


def peers_line(builds: dict[str, str]) -> str:
    """'llama.cpp plain, llama.cpp lookup: <build>' — each build once, with the modes that ran it."""
    by_build: dict[str, list[str]] = {}
    for label, build in builds.items():
        by_build.setdefault(build or "build not recorded", []).append(label)
    return "; ".join(f"{', '.join(labels)}: {build}" for build, labels in by_build.items())


def format_markdown(result: dict) -> str:
    """A self-contained report: command, environment, measured costs and the summary table."""
    env, c = result["environment"], result["costs"]
    out = ["# verispec bench report", "", "Generated by `verispec bench` — do not edit by hand.", "",
           f"Command: `{result.get('command', 'verispec bench')}`", "",
           f"Environment: verispec {env['verispec']}, torch {env['torch']}, Python {env['python']}, "
           f"{env['threads']} threads, {env['platform']}, {machine_line(env)}", "",
           *([f"Peers: {peers_line(env['peers'])}.", ""] if env.get("peers") else []),
           *([sampling_line(result), ""] if any(r["temperature"] > 0 for r in result["runs"]) else []),
           "## Measured costs", "",
           "| n tokens in one target pass | c_p(n) ms | c_p(n) / c_p(1) |", "| --- | --- | --- |"]
    for n, v in c["c_p"].items():
        out.append(f"| {n} | {v * 1e3:.0f} | {c['verify_ratio'][n]:.2f} |")
    if c["c_q_draft"]:
        out += ["", f"Draft step c_q = {c['c_q_draft'] * 1e3:.0f} ms = {c['draft_to_target']:.2f} × c_p(1)."]
    out += ["", "## Results", "",
            "tokens/s include prefill. speedup: median over repeats of tokens/s ÷ plain tokens/s on the same "
            "prompts in the same repeat; range: the lowest and highest of those per-repeat ratios. accounted: "
            "the speedup from counts — plain's c_p(1) per token produced over Σ c_p(K+1) per round plus the "
            "proposer's seconds, with the c_p above (free of the machine's drift between runs; see "
            "`accounted_speedup`). predicted: from α and a fixed K. decode: the decode phase alone, as llama.cpp "
            "reports its eval speed — tokens after the first round over the time after it (batch 1 only).", "",
            "| T | batch | category | mode | tok/s | speedup | range | decode tok/s | decode speedup | accounted | predicted | acceptance | τ | predicted τ | α | same as plain |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    f = lambda v, fmt: (fmt % v) if isinstance(v, (int, float)) else "–"
    for r in result["summary"]:
        out.append(f"| {r['temperature']} | {r['batch_size']} | {r['category']} | {r['mode']} | "
                   f"{f(r['tokens_per_s'], '%.2f')} | {f(r['speedup'], '%.2fx')} | {speedup_range(r)} | "
                   f"{f(r.get('decode_tokens_per_s'), '%.2f')} | {f(r.get('decode_speedup'), '%.2fx')} | "
                   f"{f(r.get('accounted_speedup'), '%.2fx')} | {f(r.get('predicted_speedup'), '%.2fx')} | "
                   f"{f(r.get('acceptance_rate'), '%.2f')} | {f(r.get('tau'), '%.2f')} | {f(r.get('predicted_tau'), '%.2f')} | "
                   f"{f(r.get('alpha'), '%.2f')} | {r.get('identical_to_plain', '–')} |")
    return "\n".join(out + settings_lines(result)) + "\n"
