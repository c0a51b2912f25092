"""Sweep schedules of the int4 and int6 matmuls (kernels/sweeps.py): either schedule gives the same bits
for every row count, a kernel whose schedules differ is caught, and the engine keeps the schedule its
whole-pass timings chose, per machine, refusing damaged or absurd ones."""

from __future__ import annotations

import json

import pytest
import torch

from verispec import kernels
from verispec.engine import calibrate
from verispec.errors import InvalidSetting
from verispec.kernels import cpu, sweeps
from verispec.models import quant
from test_kernels import choose_afresh, q4_fields, q6_fields

SWEPT_VARIANTS = ("avxvnni", "avx2")      # the variants whose 16-column blocks are two 8-lane vectors


def swept_variant(name: str):
    if name not in kernels.supported_variants():
        pytest.skip(f"the CPU does not run the {name} kernels")
    try:
        return kernels.load_variant(name)
    except RuntimeError as err:
        pytest.skip(f"{name} kernels: {err}")


def schedule_mismatches(lib) -> list[tuple]:
    """(format, rows, K) of every matmul whose bits differ between the two schedules (all rows one sweep
    against all rows a sweep per half), over awkward shapes: K = 896 ends in half a super-block, N = 100
    in a part-filled block, 7–13 rows run as two or three groups (7: 4 + 3)."""
    before = lib.schedule()
    torch.manual_seed(5)
    cases = []
    for k in (896, 1536):
        four, six = quant.Int4Linear.from_fields(q4_fields(100, k, seed=k)), quant.Int6Linear.from_fields(q6_fields(100, k, seed=k))
        cases += [("int4", k, lambda x, w=four: lib.int4_gemm(x, w.packed, w.groups, w.supers)),
                  ("int6", k, lambda x, w=six: lib.int6_gemm(x, w.packed, w.scales, w.supers))]
    bad = []
    try:
        for fmt, k, gemm in cases:
            for m in (*range(1, 8), 9, 13):
                x = torch.randn(m, k) * 3                                   # (M, K)
                outs = []
                for one in (0, 1):
                    lib.set_schedule(fmt, (one,) * (2 * kernels.SWEPT_ROWS))
                    outs.append(gemm(x))
                if not torch.equal(*outs):
                    bad.append((fmt, m, k))
    finally:
        for fmt, one in before.items():
            lib.set_schedule(fmt, one)
    return bad


@pytest.mark.parametrize("name", SWEPT_VARIANTS)
def test_both_sweep_schedules_give_the_same_bits(name):
    """The schedule is speed only: the whole-pass timing may pick either for any row count."""
    lib = swept_variant(name)
    assert lib.schedule() is not None and lib.defaults is not None
    assert schedule_mismatches(lib) == []


def test_a_kernel_whose_schedules_differ_is_caught():
    """Broken on purpose: the one-sweep kernels of 3 rows skip a block's last group (int4 and int6). The
    comparison above fails on that build — it can fail — where a group of 3 rows runs (3 rows; 7 = 4 + 3)
    and only there."""
    swept_variant("avx2")
    broken = kernels.build_variant("avx2", ("VERISPEC_BROKEN_SWEEP",))
    assert sorted(schedule_mismatches(broken)) == sorted((fmt, m, k) for fmt in ("int4", "int6") for m in (3, 7)
                                                         for k in (896, 1536))


def test_a_schedule_is_set_only_where_there_is_one_to_choose():
    lib = swept_variant("avx2")
    for fmt, one in (("int5", (1,) * 12), ("int4", (1,) * 6), ("int4", (1, 2) * 6), ("int6", (1,) * 13)):
        with pytest.raises(ValueError, match="sweep schedule"):
            lib.set_schedule(fmt, one)
    wide = next((v for v in kernels.supported_variants() if kernels.builds_with(v, "avx512f")), None)
    if wide is not None:
        native = kernels.load_variant(wide)
        assert native.schedule() is None and native.defaults is None
        with pytest.raises(ValueError, match="no sweep schedule"):
            native.set_schedule("int4", (1,) * 12)


def test_schedules_are_described_for_results_files():
    assert sweeps.describe(None) == ""
    assert sweeps.describe({"int4": (1, 1, 1, 1, 0, 0) + (1, 1, 1, 0, 0, 0), "int6": (1, 0, 0, 0, 0, 0) + (0,) * 6}) == \
        "one sweep (first row group / later ones): int4 rows 1-4 / 1-3, int6 rows 1 / none"
    assert sweeps.describe({"int4": (0,) * 12, "int6": (1, 1, 0, 1, 0, 1) * 2}) == \
        "one sweep (first row group / later ones): int4 rows none / none, int6 rows 1,2,4,6 / 1,2,4,6"


def test_the_other_schedule_must_win_by_the_margin():
    defaults = {"int4": (1, 1, 0, 0), "int6": (1, 0, 0, 1)}
    times = {"int4": {0: (0.90, 1.00), 1: (1.00, 0.99), 2: (0.95, 1.00)},      # (a sweep per half, one sweep)
             "int6": {1: (1.00, 0.96), 2: (1.00, 0.98), 3: (0.50, 1.00)}}      # entries not timed keep their default
    assert sweeps.choose(times, defaults, margin=0.03) == {"int4": (0, 1, 0, 0), "int6": (1, 1, 0, 0)}


@pytest.fixture
def timed_passes(monkeypatch, tmp_path):
    """The avx2 kernels in force with nothing kept, and whole passes whose timing a test decides from the
    schedule in force: seconds(schedule, width) -> float."""
    lib = swept_variant("avx2")
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))
    monkeypatch.delenv("VERISPEC_KERNEL_SWEEPS", raising=False)
    before = lib.schedule()
    rule = {}

    def timer(model, top, context, vocab, kv_dtype):
        return lambda n: rule["seconds"](kernels._load().schedule(), n)
    monkeypatch.setattr(calibrate, "_pass_timer", timer)
    monkeypatch.setattr(calibrate, "swept_bytes", lambda model: calibrate.TUNE_MIN_BYTES)   # as a 1.5B's
    with kernels.using(lib):
        yield lib, rule
    for fmt, one in before.items():
        lib.set_schedule(fmt, one)


def test_the_engine_keeps_the_schedule_whole_passes_chose(timed_passes):
    """Passes of 4 rows 10 % faster with one int6 sweep, of 10 rows (5 + 5) 10 % faster with two int4 sweeps
    for the later group, of 2 rows 20 % slower with int4's other schedule: the kept schedule takes the first
    two and keeps the default of the third; a later process reads it instead of timing again."""
    lib, rule = timed_passes
    defaults = lib.defaults

    def seconds(schedule, n):
        t = 0.05
        if n == 4 and schedule["int6"][3]:                       # rows 4, first group
            t *= 0.9
        if n == 10 and not schedule["int4"][6 + 4]:              # rows 5, later groups
            t *= 0.9
        if n == 2 and schedule["int4"][1] != defaults["int4"][1]:
            t *= 1.2
        return t
    rule["seconds"] = seconds
    chosen = calibrate.tune_sweeps(model=None, rounds=2)
    expected = {"int4": defaults["int4"][:10] + (0,) + defaults["int4"][11:],
                "int6": defaults["int6"][:3] + (1,) + defaults["int6"][4:]}
    assert chosen == expected and lib.schedule() == expected
    assert "int6 rows" in kernels.kernel_status() and kernels.machine()["kernel_sweeps"] == expected
    assert kernels.untuned_sweeps() is None                       # kept: nothing to time
    assert calibrate.tune_sweeps(model=None) is None
    for fmt, one in defaults.items():                             # a new process: the compiled defaults, then the kept one
        lib.set_schedule(fmt, one)
    sweeps.apply_kept(lib, cpu.key())
    assert lib.schedule() == expected


def test_a_damaged_or_refused_kept_schedule_is_timed_again(timed_passes, monkeypatch, tmp_path):
    lib, rule = timed_passes
    rule["seconds"] = lambda schedule, n: 0.05
    path = tmp_path / "kernels" / "sweeps.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    key = sweeps._key(lib, cpu.key())
    for damaged in ("{not json", json.dumps([1, 2]), json.dumps({key: {"int4": [1] * 6}}),
                    json.dumps({key: {"int4": [1, 1, 1, 7, 0, 0], "int6": [1] * 6}}),
                    json.dumps({key: {"int4": [1] * 5, "int6": [1] * 6}})):
        path.write_text(damaged)
        assert sweeps.kept(lib, cpu.key()) is None
        assert kernels.untuned_sweeps() == lib.defaults
    path.write_text(json.dumps({key.replace(lib.build, "0ldbuild"): {"int4": [0] * 12},   # a rebuilt kernel's
                                "other|entry": {"int4": [1] * 12}}))                  # is dropped, others stay
    assert calibrate.tune_sweeps(model=None, rounds=1) == lib.defaults     # equal times: the defaults stay
    assert sweeps.kept(lib, cpu.key()) == lib.defaults
    assert set(json.loads(path.read_text())) == {key, "other|entry"}
    monkeypatch.setenv("VERISPEC_KERNEL_SWEEPS", "default")                # nothing timed, nothing applied
    assert kernels.untuned_sweeps() is None and sweeps.kept(lib, cpu.key()) is None


@pytest.mark.parametrize("value", ["defaults", "off", "1"])
def test_a_misspelt_setting_is_refused(value, monkeypatch, tmp_path):
    """VERISPEC_KERNEL_SWEEPS takes 'default' or nothing: another value stops the kernels from loading, on
    every machine, with an error naming it (the CLI prints it), instead of timing and keeping what it
    meant to avoid."""
    lib = swept_variant("avx2")
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))
    choose_afresh(monkeypatch)
    monkeypatch.setenv("VERISPEC_KERNEL_SWEEPS", value)
    for load in (kernels.kernel_status, lambda: sweeps.kept(lib, cpu.key())):
        with pytest.raises(InvalidSetting, match=f"VERISPEC_KERNEL_SWEEPS='{value}' is not a setting"):
            load()
    monkeypatch.setenv("VERISPEC_KERNEL_SWEEPS", " Default ")
    assert sweeps.fixed() and sweeps.kept(lib, cpu.key()) is None
    assert kernels.kernel_status().startswith("active")


def test_a_model_too_small_to_stream_its_weights_chooses_nothing(monkeypatch, tmp_path):
    """A test's tiny model, or a target in int8, fits in cache or has no int4/int6 weights: its timings
    would decide for the wrong regime, so nothing is timed and nothing is kept."""
    from conftest import tiny_model

    lib = swept_variant("avx2")
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))
    monkeypatch.delenv("VERISPEC_KERNEL_SWEEPS", raising=False)
    monkeypatch.setattr(calibrate, "_pass_timer", lambda *a: pytest.fail("a small model must not be timed"))
    model = tiny_model()
    layer = quant.Int4Linear.from_fields(q4_fields(64, 256))
    model.model.layers[0].mlp.down_proj = layer
    assert calibrate.swept_bytes(model) == sum(t.numel() * t.element_size() for t in layer.tensors()) > 0
    with kernels.using(lib):
        assert kernels.untuned_sweeps() is not None             # nothing kept here: it would be timed …
        assert calibrate.tune_sweeps(model) is None              # … were the model big enough
    assert not (tmp_path / "kernels" / "sweeps.json").exists()
