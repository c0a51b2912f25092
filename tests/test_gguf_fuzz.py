"""Mutated model files: a seeded campaign against a tiny valid GGUF, loaded as a user would
(`LLM(model=path)` and a 2-token generate). Every mutant must load and run or fail with one
VerispecError — never another exception, never a hang. `python tests/test_gguf_fuzz.py N` runs a
longer campaign and prints what it found."""

from __future__ import annotations

import random
import struct
import sys
import time
from pathlib import Path

import pytest

from test_loader_errors import write_tiny_gguf
from verispec.errors import VerispecError

MUTANTS = 150                # in CI: about a minute


def mutate(data: bytes, rng: random.Random) -> bytes:
    """One mutation: flip bytes, overwrite an 8-byte field with an extreme value, truncate, or splice.
    Most land in the header (the first few KB), where parsers go wrong."""
    b = bytearray(data)
    header = min(len(b), 4096)
    kind = rng.randrange(5)
    if kind == 0:
        for _ in range(rng.randint(1, 8)):
            b[rng.randrange(header)] = rng.randrange(256)
    elif kind == 1:
        at = rng.randrange(8, header - 8)
        value = rng.choice([0, 1, 2**31, 2**32 - 1, 2**63, 2**64 - 1, rng.randrange(2**64)])
        b[at:at + 8] = struct.pack("<Q", value)
    elif kind == 2:
        at = rng.randrange(8, header - 4)
        b[at:at + 4] = struct.pack("<f", rng.choice([float("nan"), float("inf"), -1.0, 0.0, 1e30]))
    elif kind == 3:
        b = b[:rng.randrange(len(b))]
    else:
        at, n = rng.randrange(header), rng.randint(1, 64)
        b[at:at] = bytes(rng.randrange(256) for _ in range(n))
    return bytes(b)


def load_and_run(path: Path) -> str:
    """'ok', or the VerispecError's class name; anything else propagates."""
    from verispec import LLM, SamplingParams

    try:
        llm = LLM(model=str(path), proposer="none", dtype="float32")
        llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=2))
        return "ok"
    except VerispecError as err:
        return type(err).__name__


def campaign(workdir: Path, count: int, seed: int = 0) -> dict[str, int]:
    base = write_tiny_gguf(workdir / "base.gguf").read_bytes()
    rng = random.Random(seed)
    outcomes: dict[str, int] = {}
    for i in range(count):
        path = workdir / f"mutant-{i}.gguf"
        path.write_bytes(mutate(base, rng))
        start = time.perf_counter()
        try:
            outcome = load_and_run(path)
        except Exception as err:              # the finding: report the mutant that raised it
            raise AssertionError(f"mutant {i} (seed {seed}) raised {type(err).__name__}: {err}") from err
        assert time.perf_counter() - start < 10, f"mutant {i} took {time.perf_counter() - start:.1f} s"
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
        path.unlink()
    return outcomes


def test_mutated_gguf_files_load_or_fail_cleanly(tmp_path, monkeypatch):
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    outcomes = campaign(tmp_path, MUTANTS)
    assert sum(outcomes.values()) == MUTANTS
    assert outcomes.get("InvalidModelFile", 0) > MUTANTS // 4            # the campaign does reach the checks


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


if __name__ == "__main__":
    import os
    import tempfile

    n = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    with tempfile.TemporaryDirectory() as d:
        os.environ["VERISPEC_CACHE"] = str(Path(d) / "cache")
        print(campaign(Path(d), n, seed=int(sys.argv[2]) if len(sys.argv) > 2 else 1))
