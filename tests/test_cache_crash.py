"""Crash-safe caches: a process killed while writing a cache file leaves nothing a later start trips
on, and a later start repairs the cache without help (the kill is real: SIGKILL mid-write)."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from test_loader_errors import write_tiny_gguf
from verispec.cache import atomic_directory, atomic_file, sweep, temp_path
from verispec.errors import CacheWriteError


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_a_dead_writers_temporaries_are_swept_and_a_live_ones_kept(tmp_path):
    dead = tmp_path / f".model.safetensors.{_dead_pid()}.tmp"
    dead.write_bytes(b"half")
    dead_dir = tmp_path / f".prepared-x.{_dead_pid()}.tmp"
    dead_dir.mkdir()
    live = tmp_path / f".model.safetensors.{os.getppid()}.tmp"
    live.write_bytes(b"being written")
    ordinary = tmp_path / "model.safetensors"
    ordinary.write_bytes(b"whole")
    assert set(sweep(tmp_path)) == {dead, dead_dir}
    assert live.exists() and ordinary.exists() and not dead.exists() and not dead_dir.exists()


def test_atomic_writes_leave_the_old_file_or_the_new_one(tmp_path):
    target = tmp_path / "calibration.json"
    target.write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_file(target) as tmp:
            tmp.write_text("new, half")
            raise RuntimeError("the writer fails")
    assert target.read_text() == "old" and not temp_path(target).exists()
    with atomic_file(target) as tmp:
        tmp.write_text("new")
    assert target.read_text() == "new"
    directory = tmp_path / "prepared"
    with atomic_directory(directory) as tmp:
        (tmp / "a").write_text("1")
    with atomic_directory(directory) as tmp:
        (tmp / "b").write_text("2")
    assert sorted(p.name for p in directory.iterdir()) == ["b"]
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_a_full_disk_is_one_clear_error_that_keeps_the_old_file(tmp_path, monkeypatch):
    """ENOSPC (or a quota, a read-only directory) inside a write: CacheWriteError naming the file, the
    reason and the free space, still an OSError for callers that recompute; the old file stays, no
    temporary is left. Other OSErrors pass through as they are."""
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))
    target = tmp_path / "calibration.json"
    target.write_text("old")
    for code in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
        with pytest.raises(CacheWriteError) as caught:
            with atomic_file(target) as tmp:
                tmp.write_text("new, half")
                raise OSError(code, os.strerror(code))
        message = str(caught.value)
        assert message.startswith(f"cannot write {target}: {os.strerror(code)}; ") and "GiB free there" in message
        assert "VERISPEC_CACHE" in message and caught.value.errno == code and isinstance(caught.value, OSError)
        assert target.read_text() == "old" and not temp_path(target).exists()
    with pytest.raises(FileNotFoundError):
        with atomic_file(target):
            raise FileNotFoundError(errno.ENOENT, "a source is gone")
    with pytest.raises(CacheWriteError, match="No space left on device"):
        with atomic_directory(tmp_path / "prepared") as tmp:
            raise OSError(errno.ENOSPC, "disk full")
    assert [p.name for p in tmp_path.iterdir()] == ["calibration.json"]
    outside = tmp_path.parent / f"{tmp_path.name}-elsewhere" / "head.pt"
    with pytest.raises(CacheWriteError) as caught:
        with atomic_file(outside):
            raise OSError(errno.ENOSPC, "disk full")
    assert "VERISPEC_CACHE" not in str(caught.value)          # not the cache: no word of moving it


def test_a_disk_that_fills_while_a_model_is_prepared_loses_nothing(tmp_path, monkeypatch):
    """safetensors reports a full disk as its own error ("… (os error 28)"): preparing a model then ends
    in the same CacheWriteError, with no half-written copy; the next load, with room, prepares it."""
    import safetensors.torch
    from safetensors import SafetensorError
    from verispec.engine import loading

    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    path = write_tiny_gguf(tmp_path / "m.gguf")

    def full(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"half")
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    monkeypatch.setattr(safetensors.torch, "save_file", full)
    with pytest.raises(CacheWriteError, match=r"cannot write .*prepared.*: No space left on device"):
        loading.load_model(path, dtype="float32")
    assert not [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]
    monkeypatch.undo()
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    assert loading.load_model(path, dtype="float32").cold


# A child that prepares a model and is killed in the middle of writing one cache file: the save
# function writes half of its output, says so, and waits to be killed.
CHILD = textwrap.dedent("""
    import sys, time
    import safetensors.torch
    import verispec.engine.loading as loading
    real, which = safetensors.torch.save_file, sys.argv[2]

    def dying_save(state, filename, *args, **kwargs):
        real(state, filename, *args, **kwargs)
        if (which == "prepared") == filename.endswith("/model.safetensors"):
            data = open(filename, "rb").read()
            open(filename, "wb").write(data[: len(data) // 2])
            print("half written", flush=True)
            time.sleep(120)

    safetensors.torch.save_file = dying_save
    loading.load_model(sys.argv[1], dtype="int8")
""")


def _kill_mid_write(model: Path, which: str, cache: Path) -> None:
    env = {**os.environ, "VERISPEC_CACHE": str(cache)}
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(model), which], env=env, stdout=subprocess.PIPE,
                             text=True)
    try:
        assert child.stdout.readline().strip() == "half written"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()


def _temporaries(cache: Path) -> list[Path]:
    return [p for p in cache.rglob("*") if p.name.endswith(".tmp")]


def _tokens(model: Path, dtype: str = "int8") -> list[int]:
    from verispec import LLM, SamplingParams
    llm = LLM(model=str(model), proposer="none", dtype=dtype)
    return llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=6))[0].token_ids


@pytest.mark.parametrize("which", ["prepared", "quantized"])
def test_a_preparation_killed_mid_write_is_repaired_by_the_next_start(tmp_path, monkeypatch, which):
    model = write_tiny_gguf(tmp_path / "m.gguf", layers=2)
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "clean"))
    want = _tokens(model)
    cache = tmp_path / "cache"
    _kill_mid_write(model, which, cache)
    assert _temporaries(cache), "the kill left no half-written file: the test did not test anything"
    monkeypatch.setenv("VERISPEC_CACHE", str(cache))
    from verispec.engine.loading import load_model
    first = load_model(model, dtype="int8")
    assert first.cold == (which == "prepared")       # a killed quantization leaves the prepared copy whole
    assert _tokens(model) == want
    assert _temporaries(cache) == []


def test_a_damaged_prepared_copy_is_prepared_again(tmp_path, monkeypatch, capsys):
    """Not a kill: a prepared file cut short on disk. The load says so on one line and repairs it."""
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    model = write_tiny_gguf(tmp_path / "m.gguf")
    for name, dtype in (("model.safetensors", "float32"), ("model.int8.*.safetensors", "int8")):
        want = _tokens(model, dtype)
        stored = next((tmp_path / "cache" / "prepared").glob(f"*/{name}"))
        stored.write_bytes(stored.read_bytes()[:100])
        assert _tokens(model, dtype) == want
        assert "damaged" in capsys.readouterr().err


@pytest.mark.real
def test_an_assembly_killed_mid_write_is_redone_by_the_next_start(tmp_path, monkeypatch):
    """The built-in 0.5B (~0.5 GB) assembled into a private cache, killed once its file is growing."""
    from verispec.loaders import builtin
    name = "qwen2.5-coder-0.5b-instruct"
    if not builtin.builtin_status(name).installed:
        pytest.skip("the built-in model packages are not installed")
    cache = tmp_path / "cache"
    env = {**os.environ, "VERISPEC_CACHE": str(cache)}
    child = subprocess.Popen([sys.executable, "-c", f"from verispec.loaders.builtin import ensure_assembled; "
                                                    f"ensure_assembled({name!r}, progress=False)"], env=env)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not any(p.stat().st_size > 50 << 20 for p in _temporaries(cache)):
        time.sleep(0.01)
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert _temporaries(cache), "the assembly finished before the kill: the test did not test anything"
    monkeypatch.setenv("VERISPEC_CACHE", str(cache))
    path = builtin.ensure_assembled(name, progress=False)
    assert builtin.builtin_status(name).assembled and path.stat().st_size == builtin.BUILTIN_MODELS[name].size
    assert _temporaries(cache) == []


def test_an_assembly_without_room_stops_before_writing_a_byte(tmp_path, monkeypatch, capsys):
    """The built-in GGUF's size is known: a disk with less free space stops the assembly at once, with
    the size and the free space in one line, and the cache holds nothing new."""
    from verispec import cache as cache_module
    from verispec.loaders import builtin
    name = "qwen2.5-coder-0.5b-instruct"
    if not builtin.builtin_status(name).installed:
        pytest.skip("the built-in model packages are not installed")
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cache_module, "_free_bytes", lambda target: 100 << 20)
    with pytest.raises(CacheWriteError, match=r"it takes 0\.\d GiB and its disk has 0\.1 GiB free \(set VERISPEC_CACHE"):
        builtin.ensure_assembled(name, progress=True)
    assert not (tmp_path / "cache").exists() or not [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]
    assert "assembling" not in capsys.readouterr().err


def test_save_tensors_gives_safetensors_io_errors_their_errno(tmp_path, monkeypatch):
    """Every safetensors write (prepared copies, quantized weights, heads, training shards) goes through
    cache.save_tensors: an I/O error in safetensors' text becomes that OSError; anything else is kept."""
    import safetensors.torch
    import torch
    from safetensors import SafetensorError
    from verispec.cache import save_tensors

    def failing(text):
        def save(tensors, filename, metadata=None):
            raise SafetensorError(text)
        return save
    monkeypatch.setattr(safetensors.torch, "save_file", failing("I/O error: Disk quota exceeded (os error 122)"))
    with pytest.raises(CacheWriteError, match="Disk quota exceeded"):
        with atomic_file(tmp_path / "heads.safetensors") as tmp:
            save_tensors({"w": torch.zeros(2)}, tmp)
    monkeypatch.setattr(safetensors.torch, "save_file", failing("tensor 'w' is not contiguous"))
    with pytest.raises(SafetensorError, match="not contiguous"):
        save_tensors({"w": torch.zeros(2)}, tmp_path / "x.safetensors")
