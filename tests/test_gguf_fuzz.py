"""Mutated model files: a seeded campaign against tiny valid GGUFs, loaded as a user would
(`LLM(model=path)`, a 2-token generate, text and a chat template where the file has a tokenizer).
Every mutant must load and run or fail with one VerispecError: never another exception, never a
hang (10 s), never a memory blow-up, never a truncated file accepted.

CI runs a short in-process campaign. A long one runs in worker processes that a supervisor can kill
on a hang, and resumes from its results file:

    python tests/test_gguf_fuzz.py --count 10000 --workers 2 --out fuzz-gguf

It prints progress and a summary, keeps every finding's mutant under OUT/findings/, and exits 1 if
there were findings.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
import json
import os
import random
import resource
import selectors
import shutil
import struct
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest

from gguf_mutants import Gguf, mutate_bytes, mutate_structure, write_gguf
from test_loader_errors import write_tiny_gguf
from verispec.errors import VerispecError

MUTANTS = 150                # in CI: about a minute
TIMEOUT_S = 10.0             # the goal: every load and generate of a tiny model within this
MEMORY_LIMIT = 64 << 20      # peak RSS growth allowed for one mutant (the files are ~30 KB)


def write_bases(workdir: Path) -> list[tuple[Path, bool]]:
    """(path, has tokenizer): F32 without a tokenizer, Q8_0 and F16 with tokenizer and chat template."""
    from gguf import GGMLQuantizationType as Q
    workdir.mkdir(parents=True, exist_ok=True)
    return [(write_tiny_gguf(workdir / "base-f32.gguf"), False),
            (write_tiny_gguf(workdir / "base-q8.gguf", qtype=Q.Q8_0, layers=2, tokenizer=True), True),
            (write_tiny_gguf(workdir / "base-f16-llama.gguf", arch="llama", qtype=Q.F16, tokenizer=True), True)]


def data_end(path: Path) -> int:
    """Where the last tensor's bytes end: a file cut short of this has lost weights."""
    from gguf import GGUFReader
    return max(int(t.data_offset) + int(t.n_bytes) for t in GGUFReader(str(path)).tensors)


@dataclass
class Base:
    data: bytes
    parsed: Gguf
    has_tokenizer: bool
    end: int            # where its weights end


def mutant(bases: list[Base], seed: int, i: int) -> tuple[bytes, Base, str]:
    """Mutant i of campaign `seed` (independent of every other index, so campaigns shard and resume)
    -> (file bytes, its base, mutation kind). Three in five are byte-level damage."""
    rng = random.Random(f"{seed}:{i}")
    base = bases[i % len(bases)]
    data, kind = mutate_bytes(base.data, rng) if rng.random() < 0.6 else mutate_structure(base.parsed, rng)
    return data, base, kind


def load_and_run(path: Path, has_tokenizer: bool, dtype: str) -> str:
    """'ok', or the VerispecError's class name; anything else propagates."""
    from verispec import LLM, SamplingParams

    try:
        llm = LLM(model=str(path), proposer="none", dtype=dtype)
        llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=2))
        if has_tokenizer and llm.tokenizer is not None:
            llm.generate(["ab a"], SamplingParams(temperature=0.7, max_tokens=2, seed=0))
            if llm.tokenizer.chat_template:
                llm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
        return "ok"
    except VerispecError as err:
        return type(err).__name__


def run_mutant(workdir: Path, bases, seed: int, i: int) -> dict:
    """Load mutant i once; the result record names a finding if there is one."""
    data, base, kind = mutant(bases, seed, i)
    path = workdir / f"mutant-{i}.gguf"
    path.write_bytes(data)
    dtype = "float32" if i % 2 else "auto"
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
    start = time.perf_counter()
    record = {"i": i, "kind": kind, "dtype": dtype}
    try:
        record["outcome"] = load_and_run(path, base.has_tokenizer, dtype)
    except Exception as err:                      # the finding: not a VerispecError
        record["outcome"] = "raised"
        record["finding"] = f"{type(err).__name__}: {err}"[:300]
        record["trace"] = traceback.format_exc(limit=-4)[-1500:]
    record["s"] = round(time.perf_counter() - start, 3)
    grew = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10) - before
    if record["outcome"] == "ok" and kind == "truncate" and len(data) < base.end:
        record["finding"] = f"accepted a file cut to {len(data)} bytes (its weights end at {base.end})"
    elif grew > MEMORY_LIMIT:
        record["finding"] = f"peak memory grew by {grew >> 20} MiB"
    elif record["s"] > TIMEOUT_S:
        record["finding"] = f"took {record['s']:.1f} s"
    if "finding" not in record:
        path.unlink()
    shutil.rmtree(Path(os.environ["VERISPEC_CACHE"]) / "prepared", ignore_errors=True)
    return record


def read_bases(workdir: Path):
    """The bases' bytes, loaded once each in both formats first, so that what a mutant adds to the peak
    memory is its own (imports, kernel builds and first allocations are paid here)."""
    bases = write_bases(workdir / "bases")
    for path, has_tok in bases:
        for dtype in ("auto", "float32"):
            assert load_and_run(path, has_tok, dtype) == "ok"
            shutil.rmtree(Path(os.environ["VERISPEC_CACHE"]) / "prepared", ignore_errors=True)
    return [Base(p.read_bytes(), Gguf.read(p), has_tok, data_end(p)) for p, has_tok in bases]


def campaign(workdir: Path, count: int, seed: int = 0) -> dict[str, int]:
    """In-process campaign (CI): raises at the first finding."""
    bases = read_bases(workdir)
    outcomes: dict[str, int] = {}
    for i in range(count):
        record = run_mutant(workdir, bases, seed, i)
        assert "finding" not in record, f"mutant {i} (seed {seed}, {record['kind']}): {record['finding']}\n" \
                                        f"{record.get('trace', '')}"
        outcomes[record["outcome"]] = outcomes.get(record["outcome"], 0) + 1
    return outcomes


def test_mutated_gguf_files_load_or_fail_cleanly(tmp_path, monkeypatch):
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    outcomes = campaign(tmp_path, MUTANTS)
    assert sum(outcomes.values()) == MUTANTS
    assert outcomes.get("InvalidModelFile", 0) > MUTANTS // 4            # the campaign does reach the checks
    assert outcomes.get("ok", 0) > MUTANTS // 10                         # and past them, into the model


def test_our_serializer_writes_the_bases_as_they_were(tmp_path, monkeypatch):
    """The structured mutants start from a faithful copy: the re-serialized base loads and generates
    the same tokens as the original."""
    from verispec import LLM, SamplingParams
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    for path, _ in write_bases(tmp_path / "bases"):
        copy = tmp_path / f"copy-{path.name}"
        copy.write_bytes(write_gguf(Gguf.read(path)))
        outs = [LLM(model=str(p), proposer="none", dtype="float32").generate(
            [[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4))[0].token_ids for p in (path, copy)]
        assert outs[0] == outs[1]


def test_header_counts_beyond_the_file_are_refused_before_parsing(tmp_path):
    from verispec.errors import InvalidModelFile
    from verispec.loaders.gguf_header import check_header

    base = write_tiny_gguf(tmp_path / "base.gguf").read_bytes()
    huge = bytearray(base)
    huge[16:24] = struct.pack("<Q", 2**60)                               # the metadata count
    (tmp_path / "huge.gguf").write_bytes(bytes(huge))
    start = time.perf_counter()
    with pytest.raises(InvalidModelFile, match="cannot fit"):
        check_header(tmp_path / "huge.gguf")
    assert time.perf_counter() - start < 1
    check_header(tmp_path / "base.gguf")                                # the valid file passes


def test_overlapping_tensors_are_refused(tmp_path):
    """A tensor offset moved onto another tensor's bytes (aligned, inside the file) is corrupt."""
    from gguf import GGUFReader
    from verispec.engine.loading import load_model
    from verispec.errors import InvalidModelFile

    path = write_tiny_gguf(tmp_path / "m.gguf")
    data = bytearray(path.read_bytes())
    tensors = GGUFReader(str(path)).tensors
    target = next(t for t in tensors if t.name == "blk.0.ffn_norm.weight")
    other = next(t for t in tensors if t.name == "blk.0.attn_norm.weight")
    # A tensor's info: name, u32 dimension count, u64 dimensions, u32 type, u64 offset from the data start.
    name = target.name.encode()
    at = bytes(data).index(name) + len(name)
    dims = struct.unpack_from("<I", data, at)[0]
    at += 4 + 8 * dims + 4
    base = int(target.data_offset) - struct.unpack_from("<Q", data, at)[0]          # the data section's start
    data[at:at + 8] = struct.pack("<Q", int(other.data_offset) - base)
    path.write_bytes(bytes(data))
    with pytest.raises(InvalidModelFile, match="overlap"):
        load_model(path, dtype="float32")


# ---- long campaigns: a supervisor and worker processes ----

def worker(out_dir: Path, seed: int) -> None:
    """Read mutant indices on stdin; print 'start i' before and a JSON record after each one."""
    os.environ["VERISPEC_CACHE"] = str(out_dir / f"cache-{os.getpid()}")
    workdir = out_dir / f"work-{os.getpid()}"
    workdir.mkdir(parents=True, exist_ok=True)
    bases = read_bases(workdir)
    for line in sys.stdin:
        i = int(line)
        print(f"start {i}", flush=True)
        record = run_mutant(workdir, bases, seed, i)
        if "finding" in record:
            (out_dir / "findings").mkdir(exist_ok=True)
            shutil.copy(workdir / f"mutant-{i}.gguf", out_dir / "findings" / f"mutant-{i}.gguf")
            (workdir / f"mutant-{i}.gguf").unlink()
        print(json.dumps(record), flush=True)
    shutil.rmtree(workdir, ignore_errors=True)
    shutil.rmtree(os.environ["VERISPEC_CACHE"], ignore_errors=True)


class _Worker:
    def __init__(self, out_dir: Path, seed: int, todo: list[int]):
        self.todo, self.current, self.started = list(todo), None, time.monotonic()
        self.proc = subprocess.Popen([sys.executable, __file__, "--worker", "--out", str(out_dir), "--seed", str(seed)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        self.proc.stdin.write("".join(f"{i}\n" for i in self.todo))
        self.proc.stdin.close()


def supervise(out_dir: Path, count: int, seed: int, workers: int) -> int:
    out_dir.mkdir(parents=True, exist_ok=True)
    results = out_dir / "results.jsonl"
    done = set()
    if results.exists():
        for line in results.read_text().splitlines():
            try:
                done.add(json.loads(line)["i"])
            except (ValueError, KeyError):
                pass                                # a line cut by a stopped run: that mutant runs again
    todo = [i for i in range(1, count + 1) if i not in done]
    print(f"{len(done)} mutants done earlier, {len(todo)} to run, {workers} workers, seed {seed}", flush=True)
    sel = selectors.DefaultSelector()
    live = []

    def spawn(indices: list[int]) -> None:
        if indices:
            w = _Worker(out_dir, seed, indices)
            sel.register(w.proc.stdout, selectors.EVENT_READ, w)
            live.append(w)

    for k in range(workers):
        spawn(todo[k::workers])
    start, finished = time.monotonic(), 0
    with open(results, "a") as log:
        while live:
            for key, _ in sel.select(timeout=1.0):
                w = key.data
                line = w.proc.stdout.readline()
                if not line:                                       # the worker ended (or died)
                    sel.unregister(w.proc.stdout)
                    live.remove(w)
                    w.proc.wait()
                    if w.current is not None:                      # it died inside a mutant: that is a finding
                        log.write(json.dumps({"i": w.current, "outcome": "died",
                                              "finding": f"worker exited with {w.proc.returncode}"}) + "\n")
                        spawn(w.todo[w.todo.index(w.current) + 1:])
                    continue
                if line.startswith("start "):
                    w.current, w.started = int(line.split()[1]), time.monotonic()
                    continue
                log.write(line)
                log.flush()
                w.current, finished = None, finished + 1
                if finished % 100 == 0:
                    rate = finished / (time.monotonic() - start)
                    print(f"{finished}/{len(todo)} ({rate:.1f}/s, {(len(todo) - finished) / rate / 60:.0f} min left)",
                          flush=True)
            for w in list(live):
                if w.current is not None and time.monotonic() - w.started > 3 * TIMEOUT_S:
                    w.proc.kill()                                  # a hang: record it, go on after it
                    log.write(json.dumps({"i": w.current, "outcome": "hang",
                                          "finding": f"no answer in {3 * TIMEOUT_S:.0f} s"}) + "\n")
                    log.flush()
                    sel.unregister(w.proc.stdout)
                    live.remove(w)
                    w.proc.wait()
                    spawn(w.todo[w.todo.index(w.current) + 1:])
    return summarize(results, count, seed, workers)


def summarize(results: Path, count: int, seed: int, workers: int) -> int:
    records = {}
    for line in results.read_text().splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue
        records[r["i"]] = r
    outcomes: dict[str, int] = {}
    for r in records.values():
        outcomes[r["outcome"]] = outcomes.get(r["outcome"], 0) + 1
    findings = sorted((r for r in records.values() if "finding" in r), key=lambda r: r["i"])
    slowest = max((r.get("s", 0) for r in records.values()), default=0)
    from verispec.kernels import machine

    summary = {"command": f"python tests/test_gguf_fuzz.py --count {count} --seed {seed} --workers {workers}",
               "mutants": len(records), "of": count, "outcomes": outcomes, "findings": len(findings),
               "slowest_s": slowest, "environment": machine()}
    (results.parent / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary))
    for r in findings[:20]:
        print(f"  mutant {r['i']} ({r.get('kind')}, {r.get('dtype')}): {r['finding']}")
    return 1 if findings else 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="A long fuzz campaign of mutated GGUF files.")
    ap.add_argument("--count", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--out", default="fuzz-gguf")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(Path(args.out), args.seed)
    else:
        sys.exit(supervise(Path(args.out), args.count, args.seed, args.workers))
