"""What one target pass over n new tokens costs on this machine, relative to a 1-token pass.

`pass_costs` times passes of several widths round-robin (every round times each width once, so a
slow spell of a shared machine falls on all widths alike). `width_ratios` turns that into the
ratios c_p(n) / c_p(1) that the K policy prices rounds with, measured once per machine, model, format,
kernel build and thread count (a few seconds) and kept in `$VERISPEC_CACHE/calibration.json`: without
them `auto` would only know the widths it has already tried, and would never try the 20- or 40-token
drafts that a long copied match makes worthwhile. The policy keeps refining them on the fly.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

from verispec.cache import cache_dir, write_json
from verispec.models import KVCache, Transformer
from verispec.models.quant import BlockLinear

# Widths measured once (sparse; the policy interpolates between them): K + 1 for K up to 64.
CALIBRATION_WIDTHS = (2, 3, 4, 5, 6, 8, 12, 17, 24, 33, 48, 65)
# A wider pass reads every weight a 1-token pass reads and computes more: quiet calibrations give 0.88–1.05
# at 2–5 rows (a Zen 4's c_p(3) 0.88–0.93) and more beyond. Ratios far below that were timed while something
# else held the cores — measured: a first run beside a compiler stored c_p(3) = 0.26 and c_p(8) = 0.61 ×
# c_p(1) where quiet passes give 1.01 and 1.55, and since calibrated ratios stay fixed, `auto` drafted as if
# wide passes were nearly free for the machine's life. Such a measurement is taken again (ATTEMPTS in all),
# never kept.
RATIO_FLOOR = 0.6
ATTEMPTS = 3


def rounds_line(what: str):
    """An on_round callback that keeps one stderr line, "\r<what>: r/total", ending it at the last round."""
    return lambda r, total: print(f"\r{what}: {r}/{total}", end="\n" if r == total else "", file=sys.stderr,
                                  flush=True)


def pass_costs(model: Transformer, widths: list[int], context: int = 128, repeats: int = 5,
               on_round=None, vocab: torch.Tensor | None = None,
               kv_dtype: torch.dtype | None = None) -> dict[int, float]:
    """Median seconds of one forward pass over n new tokens after `context` cached tokens, logits
    for all n rows (what a verify pass computes), for each n in widths; kv_dtype: the cache's format.

    The widths are measured round-robin — every round times each width once — so a slow spell of a
    shared machine falls on all widths alike instead of on whichever was being measured."""
    widths = sorted(set(widths))
    timed = _pass_timer(model, max(widths), context, vocab, kv_dtype)
    times: dict[int, list[float]] = {n: [] for n in widths}
    for r in range(repeats + 1):                 # round 0 warms up
        for n in widths:
            t = timed(n)
            if r:
                times[n].append(t)
        if on_round:
            on_round(r, repeats)
    return {n: statistics.median(v) for n, v in times.items()}


def _pass_timer(model: Transformer, top: int, context: int, vocab: torch.Tensor | None,
                kv_dtype: torch.dtype | None):
    """A function n -> seconds of one pass over n ≤ top new tokens after `context` cached random tokens
    (the same cache positions rewritten each time)."""
    cache = KVCache.for_model(model.config, 1, context + top + 1, model.dtype, model.device, kv_dtype)
    ids = torch.randint(0, model.config.vocab_size, (1, context + top))
    pos = torch.arange(context)[None]
    model(ids[:, :context], pos, cache.view([0], pos))

    def timed(n: int) -> float:
        new_pos = torch.arange(context, context + n)[None]
        t = time.perf_counter()
        model.forward_logits(ids[:, context:context + n], new_pos, cache.view([0], new_pos), torch.arange(n)[None],
                             vocab)
        return time.perf_counter() - t
    return timed


# Passes whose row groups after the first have r rows (groups of up to 6, near-equal, the larger first;
# a pass of 7 or more rows never has a later group of 1 or 2): where the later groups' schedules are timed.
LATER_GROUP_WIDTHS = {3: 7, 4: 8, 5: 10, 6: 12}
# A model with fewer bytes of int4/int6 weights than this may sit in a large cache, where the other schedule
# wins: it chooses nothing (the embedded 0.5B draft in int4-all has ~220 MB, the 1.5B target ~1 GB).
TUNE_MIN_BYTES = 128 << 20


def swept_bytes(model) -> int:
    """Bytes of the model's weights in the int4 and int6 block layouts (the kernels a schedule steers)."""
    return sum(t.numel() * t.element_size() for m in model.modules() if isinstance(m, BlockLinear)
               for t in m.tensors())


def tune_sweeps(model: Transformer, rounds: int = 4, on_round=None,
                kv_dtype: torch.dtype | None = None) -> dict[str, tuple[int, ...]] | None:
    """Choose and keep this machine's sweep schedules for the kernels in force (kernels/sweeps.py) by
    timing whole passes of `model` — with its weights streaming from memory, which decides it — unless one
    is kept already or there is nothing to choose (then None, at once). A pass's first group of rows reads
    each block from memory and the groups after it from cache, so each has its own schedule: passes of 1 … 6
    rows time the first group's, passes of 7, 8, 10 and 12 rows the later groups'. Every round times each
    such width with the compiled defaults and with each format's entry flipped, one after the other in an
    order that turns from round to round; a flip is kept where its median time over the defaults' of the
    same round is below 1 − sweeps.MARGIN. About 15 s for the 1.5B on an AVX2 machine, once per machine,
    kernel build and thread count. A model with less than TUNE_MIN_BYTES in those formats (a test's tiny
    model, a target in int8) decides nothing and keeps nothing."""
    from verispec import kernels
    from verispec.kernels import sweeps

    defaults = kernels.untuned_sweeps()
    if defaults is None or swept_bytes(model) < TUNE_MIN_BYTES:
        return None
    rows = kernels.SWEPT_ROWS
    entries = {m: m - 1 for m in range(1, rows + 1)}                  # width -> schedule index it decides
    entries.update({w: rows + r - 1 for r, w in LATER_GROUP_WIDTHS.items()})
    trials = [None, *kernels.SWEPT_FORMATS]          # None: the defaults; a format: its entry flipped
    timed = _pass_timer(model, max(entries), 128, None, kv_dtype)
    seconds = {(w, trial): [] for w in entries for trial in trials}
    try:
        for r in range(rounds + 1):                  # round 0 warms up
            for w, i in entries.items():
                for trial in trials[r % len(trials):] + trials[:r % len(trials)]:
                    kernels.set_sweeps({fmt: tuple(1 - d if fmt == trial and j == i else d for j, d in enumerate(one))
                                        for fmt, one in defaults.items()})
                    t = timed(w)
                    if r:
                        seconds[w, trial].append(t)
            if on_round:
                on_round(r, rounds)
    finally:
        kernels.set_sweeps(defaults)
    times = {fmt: {} for fmt in defaults}            # format -> index -> (a sweep per half, one sweep), relative
    for fmt, one in defaults.items():
        for w, i in entries.items():                 # the flip over the defaults of the same round: a slow spell
            flipped = statistics.median(f / d for f, d in zip(seconds[w, fmt], seconds[w, None]))   # cancels
            times[fmt][i] = (1.0, flipped) if one[i] == 0 else (flipped, 1.0)
    chosen = sweeps.choose(times, defaults)
    kernels.keep_sweeps(chosen)
    return chosen


def pass_cost(model: Transformer, n: int, context: int = 128, repeats: int = 5,
              vocab: torch.Tensor | None = None, kv_dtype: torch.dtype | None = None) -> float:
    """pass_costs for one width (vocab: logits for these token ids only, a truncated draft's)."""
    return pass_costs(model, [n], context, repeats, vocab=vocab, kv_dtype=kv_dtype)[n]


def pass_and_matmul_costs(model: Transformer, context: int = 128, repeats: int = 7,
                          kv_dtype: torch.dtype | None = None) -> tuple[float, float]:
    """(c_p(1), its matmuls alone): median seconds of a 1-token pass and of the same model's linears
    (every layer's q/k/v, o, gate/up and down, then the LM head) called one after another on one
    random row, the two alternated round by round. Each linear is a module call (the native kernel
    behind a little Python and an output allocation), so the second figure is, if anything, above
    what the kernels alone take, and c_p(1) over it a lower bound on the pass's overhead ratio."""
    linears = []
    for block in model.model.layers:
        linears += [block.self_attn.qkv_proj, block.self_attn.o_proj, block.mlp.gate_up_proj, block.mlp.down_proj]
    linears.append(model.lm_head)
    inputs = {m.in_features: torch.randn(1, m.in_features, dtype=model.dtype) for m in linears}   # (1, K) each
    passes, matmuls = [], []
    for r in range(repeats + 1):                 # round 0 warms up
        p = pass_cost(model, 1, context, repeats=1, kv_dtype=kv_dtype)
        with torch.inference_mode():
            t = time.perf_counter()
            for m in linears:
                m(inputs[m.in_features])
            mm = time.perf_counter() - t
        if r:
            passes.append(p)
            matmuls.append(mm)
    return statistics.median(passes), statistics.median(matmuls)


def c_p_at(c_p: dict[int, float], n: int) -> float:
    """c_p(n) from the measured widths: exact, linear between the two nearest, or extended along
    the widest two."""
    if n in c_p:
        return c_p[n]
    widths = sorted(c_p)
    below, above = [w for w in widths if w < n], [w for w in widths if w > n]
    if below and above:
        lo, hi = below[-1], above[0]
    else:                                   # beyond the measured widths: the nearest two
        lo, hi = (widths[-2], widths[-1]) if below else (widths[0], widths[1])
    return c_p[lo] + (c_p[hi] - c_p[lo]) * (n - lo) / (hi - lo)



def plausible_ratios(ratios: dict[int, float]) -> bool:
    """Whether c_p(n) / c_p(1) by width could come from a quiet machine: none below RATIO_FLOOR, and
    none below RATIO_FLOOR × the dearest narrower width's (a spike that made one width dear)."""
    dearest = 1.0
    for n in sorted(ratios):
        if ratios[n] < RATIO_FLOOR * dearest:
            return False
        dearest = max(dearest, ratios[n])
    return True


def width_ratios(model: Transformer, key: str, widths=CALIBRATION_WIDTHS, repeats: int = 3,
                 on_round=None) -> dict[int, float] | None:
    """c_p(n) / c_p(1) for each width, from the calibration file when it has `key` (with the machine's
    kernel build and threads added) and its ratios are plausible, else measured now (up to ATTEMPTS
    times, until plausible) and stored. None when no attempt was: nothing is stored, and the next
    process measures again."""
    def measure() -> dict[int, float] | None:
        for _ in range(ATTEMPTS):
            seconds = pass_costs(model, [1, *widths], repeats=repeats, on_round=on_round)
            ratios = {n: seconds[n] / seconds[1] for n in widths}
            if plausible_ratios(ratios):
                return ratios
        return None

    entry = _calibrated(f"{key}|{','.join(map(str, widths))}", measure,
                        lambda stored: plausible_ratios({int(n): r for n, r in stored.items()}))
    return None if entry is None else {int(n): r for n, r in entry.items()}


def alternated_steps(target: Transformer, draft: Transformer, vocabs: dict, repeats: int, context: int = 128,
                     kv_dtype: torch.dtype | None = None) -> tuple[list[float], dict[str, list[float]]]:
    """Seconds of a 1-token target pass and of a draft step for each vocabulary in vocabs (name ->
    token ids, or None for the whole one), every round timing the target and then each draft step, so a
    slow spell of a shared machine falls on both sides: (target times, {name: draft times})."""
    target_s, draft_s = [], {name: [] for name in vocabs}
    for _ in range(repeats):
        target_s.append(pass_cost(target, 1, context, repeats=1, kv_dtype=kv_dtype))
        for name, vocab in vocabs.items():
            draft_s[name].append(pass_cost(draft, 1, context, repeats=1, vocab=vocab, kv_dtype=kv_dtype))
    return target_s, draft_s


def draft_step_ratio(target: Transformer, draft: Transformer, key: str, repeats: int = 3,
                     vocab: torch.Tensor | None = None) -> float:
    """One draft step (its LM head over `vocab` only, when given) over one target step, measured
    alternately (calibration file as width_ratios)."""
    def measure() -> dict[str, float]:
        t, d = alternated_steps(target, draft, {"draft": vocab}, repeats)
        return {"ratio": statistics.median(d["draft"]) / statistics.median(t)}

    head = "" if vocab is None else f"|vocab {len(vocab)}"
    return _calibrated(f"draft step|{key}{head}", measure)["ratio"]


def _calibrated(key: str, measure, plausible=None) -> dict | None:
    """The calibration file's entry for key (with the machine's CPU, kernel variant and build, and threads
    added, so that a rebuilt kernel is measured again) where plausible(entry) holds, or measure() now and
    store it (nothing stored when measure() gives None)."""
    from verispec.kernels import machine

    info = machine()
    full_key = "|".join([key, info["cpu_model"], info["cpu_core"], info["kernel"], info["kernel_build"] or "-",
                         f"{torch.get_num_threads()} threads"])
    path = cache_dir() / "calibration.json"
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):
        stored = {}
    stored = stored if isinstance(stored, dict) else {}     # other keys' entries are kept when one is added
    try:
        entry = {k: float(v) for k, v in stored[full_key].items()}
        if entry and all(v > 0 for v in entry.values()) and (plausible is None or plausible(entry)):
            return entry
    except (KeyError, ValueError, TypeError, AttributeError):
        pass
    entry = measure()
    if entry is None:
        return None
    stored[full_key] = entry
    write_json(path, stored)                                 # a read-only cache: measure again next time
    return entry
