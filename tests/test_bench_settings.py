"""A bench mode with tuning constants set while it runs (bench/settings.py): an A/B inside one process."""

from __future__ import annotations

import pytest

from verispec.bench.run import format_markdown, format_table, parse_modes, run_bench, split_modes
from verispec.bench.settings import applied, parse_settings
from verispec.bench.suites import load_suite
from verispec.engine import acceptance_rates
from verispec.engine.llm import LLM
from verispec.engine.loading import LoadedModel
from verispec.errors import VerispecError
from conftest import tiny_model


def test_settings_name_a_constant_and_a_value_of_its_type():
    assert parse_settings("engine.acceptance_rates.MODEL_EMA=0.2") == \
        (("verispec.engine.acceptance_rates.MODEL_EMA", 0.2),)
    got = parse_settings("verispec.engine.acceptance_rates.PROBE_EVERY=4; engine.acceptance_rates.MODEL_EMA=1e-1")
    assert got == (("verispec.engine.acceptance_rates.PROBE_EVERY", 4),
                   ("verispec.engine.acceptance_rates.MODEL_EMA", 0.1))
    assert isinstance(got[0][1], int)


@pytest.mark.parametrize("text, says", [
    ("engine.acceptance_rates.MODEL_EMA", "module.NAME=value"),
    ("engine.acceptance_rates.MODEL_EMA=", "module.NAME=value"),
    ("engine.no_such_module.X=1", "no module"),
    ("engine.acceptance_rates.NO_SUCH=1", "has no NO_SUCH"),
    ("engine.acceptance_rates.MODEL_SOURCES=1", "only int, float and bool"),
    ("engine.acceptance_rates.prior_rate=1", "only int, float and bool"),
    ("engine.acceptance_rates.MODEL_EMA=abc", "is not a number"),
    ("engine.acceptance_rates.PROBE_EVERY=0.5", "is not an integer"),
    ("engine.acceptance_rates.MODEL_EMA=nan", "finite"),
    ("engine.acceptance_rates.MODEL_EMA=inf", "finite"),
    (" ; ", "empty settings"),
    ("os.sep=1", "no module"),
    ("engine.acceptance_rates.PROBE_EVERY=yes", "is not an integer"),
])
def test_a_bad_setting_is_refused_before_anything_runs(text, says):
    with pytest.raises(VerispecError, match=says):
        parse_settings(text)


def test_settings_hold_inside_the_block_and_are_restored_after_it_even_on_error():
    before = acceptance_rates.MODEL_EMA, acceptance_rates.PROBE_EVERY
    settings = parse_settings("engine.acceptance_rates.MODEL_EMA=0.35;engine.acceptance_rates.PROBE_EVERY=3")
    with pytest.raises(RuntimeError):
        with applied(settings):
            assert (acceptance_rates.MODEL_EMA, acceptance_rates.PROBE_EVERY) == (0.35, 3)
            raise RuntimeError("inside")
    assert (acceptance_rates.MODEL_EMA, acceptance_rates.PROBE_EVERY) == before


def test_modes_with_settings_parse_and_are_labelled_apart():
    text = "draft,draft[engine.acceptance_rates.MODEL_EMA=0.2;engine.acceptance_rates.PROBE_EVERY=4],ngram"
    names = split_modes(text)
    assert names == ["draft", "draft[engine.acceptance_rates.MODEL_EMA=0.2;engine.acceptance_rates.PROBE_EVERY=4]",
                     "ngram"]
    modes = parse_modes(names, ["auto"])
    assert [m.label for m in modes] == ["plain", "draft k=auto", "draft k=auto [MODEL_EMA=0.2;PROBE_EVERY=4]",
                                        "ngram k=auto"]
    assert modes[2].settings[0] == ("verispec.engine.acceptance_rates.MODEL_EMA", 0.2)
    with pytest.raises(VerispecError, match="one pair of brackets at its end"):
        parse_modes(["draft[engine.acceptance_rates.MODEL_EMA=0.2]/b0"], [2])
    with pytest.raises(VerispecError, match="names a mode twice"):
        parse_modes(["ngram", "ngram"], [2])


def test_a_mode_generates_with_its_settings_and_every_other_mode_without(tmp_path, monkeypatch):
    suite = tmp_path / "suite.jsonl"
    suite.write_text('{"id": "a", "category": "x", "prompt_ids": [1, 2, 3, 1, 2]}\n'
                     '{"id": "b", "category": "y", "prompt_ids": [5, 6]}\n')
    seen: dict[int, set[float]] = {}
    generate = LLM.generate

    def spy(self, *args, **kwargs):                 # the constant each LLM reads while it generates
        seen.setdefault(id(self), set()).add(acceptance_rates.MODEL_EMA)
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(LLM, "generate", spy)
    default = acceptance_rates.MODEL_EMA
    modes = parse_modes(["draft", "draft[engine.acceptance_rates.MODEL_EMA=0.35]"], [2])
    result = run_bench(LoadedModel("tiny", tiny_model(0, scale=1.5), None, None, 0.0, False),
                       LoadedModel("tiny", tiny_model(1, scale=1.5, num_layers=1), None, None, 0.0, False),
                       load_suite(suite), modes, [0.0], max_tokens=6, repeats=2, progress=False)
    assert sorted(sorted(v) for v in seen.values()) == [[default], [default], [0.35]]
    assert acceptance_rates.MODEL_EMA == default
    rows = [r for r in result["summary"] if r["category"] == "all"]
    assert {r["mode"] for r in rows} == {"plain", "draft k=2", "draft k=2 [MODEL_EMA=0.35]"}
    assert all(r["identical_to_plain"] for r in rows if r["mode"] != "plain")
    ab = next(r for r in rows if r["mode"] == "draft k=2 [MODEL_EMA=0.35]")
    assert ab["against"] == "draft k=2" and len(ab["against_per_repeat"]) == 2
    base = next(r for r in rows if r["mode"] == "draft k=2")
    for mine, twin, ratio in zip(ab["speedup_per_repeat"], base["speedup_per_repeat"], ab["against_per_repeat"]):
        assert ratio == pytest.approx(mine / twin)          # both paired with plain in the same repeat
    assert "against" not in base
    assert "draft k=2 [MODEL_EMA=0.35] ÷ draft k=2" in format_table(result)
    assert "draft k=2 [MODEL_EMA=0.35] ÷ draft k=2" in format_markdown(result)


def test_a_setting_the_code_refuses_ends_in_an_error_that_names_the_mode(tmp_path):
    suite = tmp_path / "suite.jsonl"
    suite.write_text('{"id": "a", "category": "x", "prompt_ids": [1, 2, 3, 1, 2]}\n')
    modes = parse_modes(["draft", "draft[proposers.draft.STOP_BELOW=1.5]"], [2])     # a probability above 1
    with pytest.raises(VerispecError, match=r"draft k=2 \[STOP_BELOW=1.5\].*its settings broke it.*stop_below"):
        run_bench(LoadedModel("tiny", tiny_model(0, scale=1.5), None, None, 0.0, False),
                  LoadedModel("tiny", tiny_model(1, scale=1.5, num_layers=1), None, None, 0.0, False),
                  load_suite(suite), modes, [0.0], max_tokens=4, repeats=1, progress=False)
