"""Weights read from safetensors files into huge-page memory: the same tensors safetensors itself
reads, in mappings advised for 2 MiB pages, and a hostile header refused before anything is allocated."""

from __future__ import annotations

import json
import mmap
import os
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from verispec.errors import InvalidModelFile
from verispec import huge_pages
from verispec.huge_pages import HUGE_ENOUGH, HUGE_PAGE, huge_bytes, huge_fraction, thp_mode
from verispec.loaders.safetensors_file import read_header, read_safetensors

on_linux_with_advice = pytest.mark.skipif(not (sys.platform == "linux" and hasattr(mmap, "MADV_HUGEPAGE")),
                                          reason="huge-page advice is Linux's madvise(MADV_HUGEPAGE)")


def test_every_dtype_reads_as_safetensors_reads_it(tmp_path):
    """Odd sizes put later tensors at offsets their dtype cannot be viewed at (they get copies);
    empty tensors and scalars come back too."""
    g = torch.Generator().manual_seed(0)
    tensors = {
        "odd": torch.randint(0, 255, (3,), dtype=torch.uint8, generator=g),
        "f32": torch.randn(5, 7, generator=g),
        "bf16": torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "f16": torch.randn(9, generator=g).to(torch.float16),
        "i8": torch.randint(-128, 127, (4, 3), dtype=torch.int8, generator=g),
        "i32": torch.randint(-2**31, 2**31 - 1, (6,), dtype=torch.int32, generator=g),
        "i64": torch.randint(-2**62, 2**62, (2, 2), dtype=torch.int64, generator=g),
        "f64": torch.randn(3, generator=g, dtype=torch.float64),
        "flag": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 4),
        "scalar": torch.tensor(2.5),
    }
    path = tmp_path / "w.safetensors"
    save_file(tensors, str(path))
    ours, theirs = read_safetensors(path), load_file(str(path))
    assert list(ours) == list(theirs)
    for name, want in theirs.items():
        got = ours[name]
        assert got.dtype == want.dtype and got.shape == want.shape and got.is_contiguous(), name
        assert torch.equal(got, want), name


@on_linux_with_advice
@pytest.mark.skipif(thp_mode() not in ("always", "madvise"), reason=f"transparent huge pages are {thp_mode()}")
def test_the_tensors_are_in_huge_pages_and_their_mapping_is_advised(tmp_path):
    """Mapped from the file in 2 MiB pages where the filesystem allows, else copied into them: either way
    the kernel holds them in huge pages and their mapping carries the `hg` flag (MADV_HUGEPAGE)."""
    path = tmp_path / "w.safetensors"
    save_file({"a": torch.randn(3072, 1024), "b": torch.randn(64)}, str(path))
    tensors = read_safetensors(path)
    assert huge_fraction(tensors["a"]) >= HUGE_ENOUGH
    assert all(_advised(t) for t in tensors.values())
    # The checks can fail: an anonymous mapping of the process's own, never advised, filled the same way. (Not
    # a torch allocation: which mapping malloc serves that from depends on what the process allocated before —
    # in one full test run a 12 MiB tensor landed in an advised mapping.)
    area = mmap.mmap(-1, 12 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    plain = torch.frombuffer(area, dtype=torch.float32)
    plain.copy_(torch.randn(plain.shape))
    assert not _advised(plain) and huge_fraction(plain) < HUGE_ENOUGH
    del plain
    area.close()


@on_linux_with_advice
@pytest.mark.skipif(thp_mode() not in ("always", "madvise"), reason=f"transparent huge pages are {thp_mode()}")
def test_a_file_the_kernel_keeps_in_small_pages_is_copied_into_huge_ones(tmp_path, monkeypatch):
    """A file whose mapping stays in 4 KiB pages (an older kernel, a filesystem without large folios):
    its data section is copied into an anonymous block that starts on a 2 MiB boundary and is advised."""
    import verispec.loaders.safetensors_file as module
    path = tmp_path / "w.safetensors"
    save_file({"a": torch.randn(1024, 1024), "odd": torch.arange(3, dtype=torch.uint8), "b": torch.randn(64)},
              str(path))

    def small(p, hot=None):
        mapped = huge_pages.map_file(p, hot)
        mapped.huge = 0.0
        return mapped
    monkeypatch.setattr(module, "map_huge", small)
    tensors, want = read_safetensors(path), load_file(str(path))
    assert all(torch.equal(tensors[k], want[k]) for k in want)
    assert all(len(_mapping(t)[2].split()) == 5 for t in tensors.values()), "not in an anonymous mapping"
    assert all(_advised(t) for t in tensors.values())
    block = huge_bytes(3 * HUGE_PAGE + 5)
    assert block.data_ptr() % HUGE_PAGE == 0 and not block.any()


def _cache_in_small_folios(path) -> None:
    """Leave path in the page cache in 4 KiB folios, as a plain reader without readahead does."""
    huge_pages.drop_page_cache(path)
    with open(path, "rb") as f:
        huge_pages.no_readahead(f)
        while f.read(4096):
            pass


def _gives_large_folios(path) -> bool:
    """Whether the filesystem reads path back into 2 MiB folios for a mapping advised for them."""
    huge_pages.drop_page_cache(path)
    fraction = huge_pages.map_file(path).huge
    huge_pages.drop_page_cache(path)
    return fraction >= 0.99


@on_linux_with_advice
@pytest.mark.skipif(thp_mode() not in ("always", "madvise"), reason=f"transparent huge pages are {thp_mode()}")
def test_a_file_cached_in_small_folios_is_read_back_into_huge_ones(tmp_path):
    """A file the page cache holds in small folios (as a plain read leaves it, or reclaim under memory
    pressure) cannot be mapped in huge pages: map_huge drops the file from the page cache and maps it
    again, so the tensors are views of the file, in huge pages, and not a copy. Reading its header
    first leaves no small folio of it either."""
    path = tmp_path / "w.safetensors"
    save_file({"a": torch.randn(4096, 1024), "b": torch.randn(64)}, str(path))
    if not _gives_large_folios(path):
        pytest.skip("the filesystem under the test directory reads no 2 MiB folios")
    read_header(path)
    assert huge_pages.map_file(path).huge >= 0.99, "the header's read left small folios"
    _cache_in_small_folios(path)
    assert huge_pages.map_file(path).huge < HUGE_ENOUGH
    tensors = read_safetensors(path)
    assert huge_fraction(tensors["a"]) >= HUGE_ENOUGH
    assert len(_mapping(tensors["a"])[2].split()) == 6, "copied instead of mapped from the file"


@on_linux_with_advice
@pytest.mark.skipif(thp_mode() not in ("always", "madvise"), reason=f"transparent huge pages are {thp_mode()}")
@pytest.mark.parametrize("kept_small", [False, True], ids=["mapped", "copied"])
def test_a_tensor_read_by_rows_stays_in_plain_pages_until_touched(tmp_path, monkeypatch, kept_small):
    """The token embedding, of which a pass reads one row per token, is neither advised, faulted in nor
    copied: it takes memory for the pages a lookup touches. The tensors around it are in huge pages."""
    import verispec.loaders.safetensors_file as module
    path = tmp_path / "w.safetensors"
    g = torch.Generator().manual_seed(1)
    save_file({"a": torch.randn(2048, 1024, generator=g), "embed": torch.randn(8192, 1024, generator=g),
               "z": torch.randn(2048, 1024, generator=g)}, str(path))
    _, entries = module.read_header(path)
    assert [n for n, _ in sorted(entries.items(), key=lambda e: e[1][2])] == ["a", "embed", "z"]
    if kept_small:
        def small(p, hot=None):
            mapped = huge_pages.map_file(p, hot)
            mapped.huge = 0.0
            return mapped
        monkeypatch.setattr(module, "map_huge", small)
    else:
        huge_pages.drop_page_cache(path)          # as the loader leaves the files it writes
    tensors = read_safetensors(path, by_rows={"embed"})
    embed = tensors["embed"]
    middle = embed[embed.shape[0] // 2]
    assert not _advised(middle)
    assert _resident(middle) < 4 << 20, "the untouched rows were read in"
    assert _advised(tensors["a"]) and _advised(tensors["z"])
    if kept_small:
        assert all(len(_mapping(tensors[k])[2].split()) == 5 for k in ("a", "z")), "not copied"
    assert len(_mapping(middle)[2].split()) == 6, "the embedding left the file's mapping"
    want = load_file(str(path))
    assert all(torch.equal(tensors[k], want[k]) for k in want)


@on_linux_with_advice
def test_a_weights_file_written_to_the_cache_leaves_the_page_cache(tmp_path, monkeypatch):
    """The loader writes each prepared and quantized weights file out and drops it from the page cache,
    so that the first load reads it back in 2 MiB folios instead of mapping the small ones writing left
    (what it asks of the kernel is checked here; what the kernel then does, in the tests above)."""
    pytest.importorskip("gguf")
    from test_loader_errors import write_tiny_gguf
    from verispec.engine.loading import load_model

    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    dropped = []
    real = os.posix_fadvise
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, off, n, advice: dropped.append(
        (os.path.basename(os.readlink(f"/proc/self/fd/{fd}")), off, n, advice)) or real(fd, off, n, advice))
    load_model(write_tiny_gguf(tmp_path / "m.gguf"), dtype="int8")
    whole = [call for call in dropped if call[1:] == (0, 0, os.POSIX_FADV_DONTNEED)]   # not a header's pages
    assert sorted(whole) == sorted([("model.safetensors", 0, 0, os.POSIX_FADV_DONTNEED),
                                      (next((tmp_path / "cache").rglob("model.int8.*")).name, 0, 0,
                                       os.POSIX_FADV_DONTNEED)])


@on_linux_with_advice
def test_a_loaded_model_keeps_its_weights_in_huge_page_memory(tmp_path, monkeypatch):
    """Both the first load (which prepares and quantizes) and a warm one read the kept files back into
    advised memory: every weight of the int8 model and of the float32 one."""
    pytest.importorskip("gguf")
    from test_loader_errors import write_tiny_gguf
    from verispec.engine.loading import load_model

    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    gguf = write_tiny_gguf(tmp_path / "m.gguf", layers=2)
    for dtype in ("int8", "int8", "float32"):
        model = load_model(gguf, dtype=dtype).model
        weights = [t for t in model.state_dict().values() if t.numel()]
        assert weights and all(_advised(t) for t in weights), dtype


@pytest.mark.parametrize("tied", [False, True], ids=["own-lm-head", "tied"])
def test_the_loader_reads_the_token_embedding_by_rows_unless_it_is_the_lm_head(tmp_path, monkeypatch, tied):
    """The loader leaves the token embedding out of huge pages in every format, except in a float model
    whose LM head is the embedding (tied): then every pass streams it whole."""
    pytest.importorskip("gguf")
    from test_loader_errors import write_tiny_gguf
    import verispec.engine.loading as loading
    from verispec.engine.loading import load_model

    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    seen: list[tuple[str, set[str]]] = []
    real = loading.read_safetensors
    monkeypatch.setattr(loading, "read_safetensors",
                        lambda path, by_rows=(): seen.append((path.name, set(by_rows))) or real(path, by_rows))
    gguf = write_tiny_gguf(tmp_path / "m.gguf", drop="output.weight" if tied else None)
    for dtype in ("float32", "int8", "int8"):
        seen.clear()
        load_model(gguf, dtype=dtype)
        assert seen and seen[-1][0].startswith("model.int8." if dtype == "int8" else "model.safetensors")
        want = set() if tied and dtype == "float32" else {"model.embed_tokens.weight"}
        assert seen[-1][1] == want, (dtype, seen)


def _mapping(t: torch.Tensor) -> tuple[int, int, str, list[str]]:
    """(start, end, header line, VmFlags) of the mapping in /proc/self/smaps holding t's first byte."""
    address, found = t.data_ptr(), None
    with open("/proc/self/smaps") as f:
        for line in f:
            first = line.split(maxsplit=1)[0]
            if "-" in first and ":" not in first:
                lo, hi = (int(x, 16) for x in first.split("-"))
                found = (lo, hi, line.strip()) if lo <= address < hi else None
            elif found and line.startswith("VmFlags:"):
                return (*found, line.split()[1:])
    raise AssertionError("no mapping holds the tensor")


def _resident(t: torch.Tensor) -> int:
    """Bytes resident (Rss in /proc/self/smaps) of the mapping holding t's first byte."""
    lo = _mapping(t)[0]
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            first = line.split(maxsplit=1)[0]
            if "-" in first and ":" not in first:
                inside = int(first.split("-")[0], 16) == lo
            elif inside and line.startswith("Rss:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no mapping holds the tensor")


def _advised(t: torch.Tensor) -> bool:
    """Whether the mapping holding t's first byte is advised for huge pages (`hg` in its VmFlags)."""
    return "hg" in _mapping(t)[3]


def _raw(header: dict, data: bytes = b"", length: int | None = None) -> bytes:
    text = json.dumps(header).encode()
    return (len(text) if length is None else length).to_bytes(8, "little") + text + data


F32 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}


@pytest.mark.parametrize("raw, problem", [
    (b"\x05\x00", "too short"),
    (_raw({"w": F32}, bytes(8), length=1 << 40), "header length"),
    (_raw({"w": F32}, bytes(8), length=0), "header length"),
    (b"\x04\x00\x00\x00\x00\x00\x00\x00{no}", "not JSON"),
    (b"\x02\x00\x00\x00\x00\x00\x00\x00\xff\xfe", "not JSON"),
    (_raw([1, 2], bytes(8)), "not a JSON object"),
    (_raw({"w": "F32"}, bytes(8)), "not an object"),
    (_raw({"w": {**F32, "dtype": "F128"}}, bytes(8)), "unknown dtype"),
    (_raw({"w": {**F32, "shape": [-2]}}, bytes(8)), "not a list of sizes"),
    (_raw({"w": {**F32, "shape": [True, 2]}}, bytes(8)), "not a list of sizes"),
    (_raw({"w": {**F32, "shape": 2}}, bytes(8)), "not a list of sizes"),
    (_raw({"w": {**F32, "data_offsets": [0]}}, bytes(8)), "not \\[begin, end\\]"),
    (_raw({"w": {**F32, "data_offsets": [0, 9]}}, bytes(8)), "outside"),
    (_raw({"w": {**F32, "data_offsets": [8, 0]}}, bytes(8)), "outside"),
    (_raw({"w": {**F32, "shape": [1 << 40], "data_offsets": [0, 8]}}, bytes(8)), "expected"),
    (_raw({"w": F32, "v": F32}, bytes(8)), "share bytes"),
    (_raw({"w": F32, "v": {**F32, "data_offsets": [4, 12]}}, bytes(12)), "share bytes"),
])
def test_a_hostile_header_is_refused_before_anything_is_allocated(tmp_path, monkeypatch, raw, problem):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(raw)
    import verispec.loaders.safetensors_file as module
    monkeypatch.setattr(module, "map_huge", lambda p, hot=None: pytest.fail(f"mapped {p} despite a bad header"))
    with pytest.raises(InvalidModelFile, match=problem) as info:
        read_safetensors(path)
    assert str(path) in str(info.value)


def test_a_valid_header_still_reads_with_the_guard_above(tmp_path):
    """The header checks pass a well-formed file of the same shapes (so the cases above fail for their
    own reason): two tensors side by side, metadata ignored."""
    path = tmp_path / "ok.safetensors"
    path.write_bytes(_raw({"__metadata__": {"format": "pt"}, "w": F32, "v": {**F32, "data_offsets": [8, 16]}},
                          torch.arange(4, dtype=torch.float32).numpy().tobytes()))
    got = read_safetensors(path)
    assert got["w"].tolist() == [0.0, 1.0] and got["v"].tolist() == [2.0, 3.0]
