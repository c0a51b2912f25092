"""`verispec chat` driven as a person would: in a pseudo-terminal (pexpect), on a tiny model saved as a
Hugging Face directory with a byte-level tokenizer and a chat template. Its end-of-sequence rows are
zeroed, so greedy replies run until --max-tokens (or Ctrl-C)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import pytest

from conftest import write_chat_model_dir

pexpect = pytest.importorskip("pexpect")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # A long context: a reply that runs until it must still be streaming when Ctrl-C arrives.
    return write_chat_model_dir(tmp_path_factory.mktemp("tiny-chat"), context=4096)


def _default_ctrl_c() -> None:
    """In the chat's process before it starts: Ctrl-C delivered and handled as a terminal user's would
    be, whatever the test process inherited or blocked (an ignored or blocked SIGINT passes to a child)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def spawn(model_dir, *flags, env=None):
    env = {**os.environ, "VERISPEC_CACHE": str(model_dir / "cache"), **(env or {})}
    env.pop("NO_COLOR", None) if "NO_COLOR" not in (env or {}) else None
    child = pexpect.spawn(sys.executable, ["-m", "verispec.cli.main", "chat", "--model", str(model_dir),
                                           "--dtype", "float32", *flags], env=env, encoding="utf-8", timeout=60,
                          dimensions=(50, 200), preexec_fn=_default_ctrl_c)
    child.expect("/help for commands")
    child.expect("> ")
    return child


def stats(child) -> dict:
    child.sendline("/stats")
    child.expect(r"last prompt: (\d+) tokens prefilled, (\d+) reused")
    prefilled, reused = int(child.match.group(1)), int(child.match.group(2))
    child.expect("> ")
    return {"prefilled": prefilled, "reused": reused}


def test_a_conversation_reuses_its_cache_resets_and_saves(model_dir, tmp_path):
    child = spawn(model_dir, "--max-tokens", "12", "--system", "be brief")
    child.sendline("hello there")
    child.expect("> ")
    first = stats(child)
    assert first["reused"] == 0 and first["prefilled"] > 10
    child.sendline("and again")
    child.expect("> ")
    second = stats(child)
    # Turn 2 finds the first turn's prompt and reply (but the reply's last token, generated and never
    # fed back) in the prefix cache, in whole blocks of 16 tokens; it prefills the rest of the last
    # block, the template's markers and the new message (30 byte tokens) and that last token.
    history = first["prefilled"] + 12 - 1
    assert second["reused"] == history // 16 * 16 > 0
    assert second["prefilled"] + second["reused"] == history + 30 + 1
    saved = tmp_path / "conv.json"
    child.sendline(f"/save {saved}")
    child.expect("saved 5 messages")
    messages = json.loads(saved.read_text())
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"]
    assert messages[1]["content"] == "hello there" and messages[3]["content"] == "and again"
    child.sendline("/reset")
    child.expect("conversation cleared")
    child.sendline("new topic")
    child.expect("> ")
    assert stats(child)["reused"] <= len("be brief") + 20          # the system message's prefix at most
    child.sendline("/nonsense")
    child.expect("unknown command")
    child.sendline("/exit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_ctrl_c_stops_a_reply_and_a_second_ctrl_c_leaves(model_dir):
    # No --max-tokens: runs until the context. Plain decoding: the tiny model repeats itself, and with
    # lookup (and its branches) a whole reply could end before the Ctrl-C arrives.
    child = spawn(model_dir, "--proposer", "none")
    child.sendline("tell me everything")
    child.expect("tell me everything\r\n")                          # the terminal's echo
    child.expect(".{20}")                                             # the reply is streaming
    child.sendintr()
    child.expect(r"\[stopped\]")
    child.expect("> ")
    child.sendline("/stats")                                          # still alive and answering
    child.expect("session:")
    child.expect("> ")
    child.sendintr()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_show_drafts_colours_accepted_tokens_on_a_terminal_only(model_dir):
    # The tiny model repeats itself, so prompt lookup drafts and some drafts are accepted.
    child = spawn(model_dir, "--max-tokens", "120", "--show-drafts", "--proposer", "ngram", "--k", "4")
    child.sendline("ab ab ab ab ab ab ab ab")
    child.expect("> ")
    assert "\x1b[32m" in child.before
    child.sendline("/exit")
    child.close()
    plain = spawn(model_dir, "--max-tokens", "120", "--show-drafts", "--proposer", "ngram", "--k", "4",
                  env={"NO_COLOR": "1"})
    plain.sendline("ab ab ab ab ab ab ab ab")
    plain.expect("> ")
    assert "\x1b[" not in plain.before
    plain.sendline("/exit")
    plain.close()


def test_piped_input_is_one_message_per_line(model_dir):
    proc = subprocess.run([sys.executable, "-m", "verispec.cli.main", "chat", "--model", str(model_dir), "--dtype",
                           "float32", "--max-tokens", "5", "--show-drafts"],
                          input="first\n\nsecond\n/stats\n", capture_output=True, text=True, timeout=120,
                          env={**os.environ, "VERISPEC_CACHE": str(model_dir / "cache")})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 2 + 3 and "session: 10 tokens" in proc.stdout     # two replies, then /stats
    assert "\x1b[" not in proc.stdout                                      # not a terminal: no colour
    assert re.search(r"\d+ reused", proc.stdout)


def test_a_chat_template_that_does_not_compile_is_refused_at_load(model_dir, tmp_path):
    import shutil

    from verispec.errors import InvalidModelFile
    from verispec.engine.loading import load_model

    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken, ignore=shutil.ignore_patterns("cache"))
    (broken / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% for m in messages %}{{ m"}))
    with pytest.raises(InvalidModelFile, match="chat template does not compile"):
        load_model(str(broken), dtype="float32")
