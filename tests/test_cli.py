"""The command line: one-line errors and non-zero exits for bad input; JSON outputs parse."""

from __future__ import annotations

import json

import pytest

from verispec.cli.main import main
from test_loader_errors import write_tiny_gguf


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))


@pytest.mark.parametrize("argv, message", [
    (["generate", "--max-tokens", "-1", "hi"], "max_tokens"),
    (["generate", "--temperature", "-0.5", "hi"], "temperature"),
    (["generate", "--top-p", "1.5", "hi"], "top_p"),
    (["generate", "--top-p", "0", "hi"], "top_p"),
    (["generate", "--model", "/no/such/model.gguf", "hi"], "no model"),
    (["generate", "--model", "no-such-name", "hi"], "built-in"),
    (["generate", "--k", "99", "--proposer", "ngram", "--model", "MODEL", "hi"], "k must be"),
    (["generate", "--proposer", "retrieval", "--model", "MODEL", "hi"], "corpus"),
    (["generate", "--proposer", "none", "--model", "MODEL", "hi"], "tokenizer"),
    (["bench", "--ks", "0"], "--ks"),
    (["bench", "--top-p", "1.5"], "top_p"),
    (["bench", "--top-k", "-1"], "top_k"),
    (["bench", "--temperatures", "0,-1"], "temperature"),
    (["bench", "--temperatures", ","], "--temperatures"),
    (["profile", "--max-n", "1"], "--max-n"),
    (["verify", "--temperature", "0"], "temperature"),
])
def test_bad_input_is_one_line_and_exit_2(argv, message, tmp_path, capsys):
    model = write_tiny_gguf(tmp_path / "tiny.gguf")
    argv = [str(model) if a == "MODEL" else a for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("verispec: error:") and message in err[-1]
    assert not any("Traceback" in line for line in err)


def test_models_json_lists_builtins(capsys):
    assert main(["models", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["name"] for r in rows} == {"qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"}
    assert all({"installed", "assembled", "size_bytes", "path"} <= set(r) for r in rows)


def test_empty_prompt_on_stdin(monkeypatch, capsys):
    import io
    monkeypatch.setattr("sys.stdin", io.StringIO("   \n"))
    assert main(["generate"]) == 2
    assert "empty prompt" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["1.5", "-0.1", "nan", "often"])
def test_a_bad_draft_stop_is_refused_before_anything_loads(value, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["generate", "--draft-stop", value, "hi"])
    assert stop.value.code == 2
    assert "--draft-stop" in capsys.readouterr().err


def test_bench_says_when_top_k_and_top_p_have_no_sampled_run_to_apply_to(capsys):
    assert main(["bench", "--top-p", "0.9", "--temperatures", "0", "--ks", "0"]) == 2    # stops before loading
    err = capsys.readouterr().err
    assert "apply to sampled runs only" in err and "--ks" in err
    assert main(["bench", "--top-p", "0.9", "--temperatures", "0,0.7", "--ks", "0"]) == 2
    assert "sampled runs only" not in capsys.readouterr().err


@pytest.mark.parametrize("setting, value", [("VERISPEC_KERNELS", "of"), ("VERISPEC_KERNEL_ISA", "avx512"),
                                            ("VERISPEC_KERNEL_SWEEPS", "defaults")])
@pytest.mark.parametrize("argv", [["models", "--json"], ["serve", "--replicas", "2"], ["generate", "hi"]])
def test_a_misspelt_kernel_setting_stops_every_command_before_it_starts(setting, value, argv, monkeypatch, capsys):
    """Before the model list, a model load, Ray's replicas or a server: one line naming the setting."""
    monkeypatch.setenv(setting, value)
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.startswith(f"verispec: error: {setting}='{value}'")
