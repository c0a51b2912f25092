"""`verispec chat`: an interactive conversation in the terminal, with speculation on show.

Each turn renders the whole conversation with the model's chat template and generates through one
`Session`, so the history already in the cache is not prefilled again — only the new message is.
Commands: /reset, /stats, /save FILE, /help, /exit. Ctrl-C stops a reply (what was shown stays in
the history); Ctrl-C at the prompt, Ctrl-D or /exit leaves. Piped input: one message per line.
`--show-drafts` colours the tokens the target accepted from the proposer (on a terminal, unless
NO_COLOR is set); the rest — recovered, bonus and plain-decoded tokens — the target produced itself.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field

from verispec.cli.generate import add_model_args, add_sampling_args, build_llm, sampling_params
from verispec.errors import InvalidRequest, VerispecError

HELP = """commands:
  /reset       forget the conversation (the system message stays)
  /stats       acceptance, tokens per round and speed of the last reply and of the session
  /save FILE   write the conversation as JSON messages
  /help        this list
  /exit        leave (or Ctrl-D; Ctrl-C stops a reply, and at the prompt leaves)"""
DRAFTED = "\033[32m"          # green: accepted from the proposer
RESET = "\033[0m"


def add_parser(sub) -> None:
    p = sub.add_parser("chat", help="talk to the model in the terminal, with multi-turn history",
                       description="An interactive chat with the model's chat template. Turns reuse the "
                                   "cached conversation. " + HELP.replace("\n", " "))
    add_model_args(p)
    add_sampling_args(p)
    p.add_argument("--system", default=None, help="system message")
    p.add_argument("--show-drafts", action="store_true",
                   help="colour tokens accepted from the proposer (on a terminal; plain text otherwise or "
                        "with NO_COLOR set)")
    p.set_defaults(run=run)


@dataclass
class Totals:
    tokens: int = 0
    seconds: float = 0.0
    rounds: int = 0
    proposed: int = 0
    accepted: int = 0

    def add(self, out) -> None:
        self.tokens += out.generated_tokens
        self.seconds += out.prefill_s + out.decode_s
        for key in ("rounds", "proposed", "accepted"):
            setattr(self, key, getattr(self, key) + out.spec.get(key, 0))

    def line(self, label: str) -> str:
        rate = f"{self.accepted / self.proposed:.0%}" if self.proposed else "–"
        tau = f"{(self.tokens / self.rounds):.2f}" if self.rounds else "–"
        speed = f"{self.tokens / self.seconds:.1f}" if self.seconds else "–"
        return (f"{label}: {self.tokens} tokens, {speed} tok/s, acceptance {rate} "
                f"({self.accepted}/{self.proposed} drafted), τ {tau} tokens/round")


@dataclass
class Chat:
    llm: object
    args: object
    out: object = sys.stdout
    color: bool = False
    messages: list[dict] = field(default_factory=list)
    session: object = None
    last: Totals = field(default_factory=Totals)
    total: Totals = field(default_factory=Totals)
    last_prefill: tuple[int, int] = (0, 0)     # (prompt tokens prefilled, reused from the cache) last turn

    def __post_init__(self) -> None:
        self.session = self.llm.session()
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.args.system}] if self.args.system else []
        self.session.reset()

    def command(self, line: str) -> bool:
        """Run a /command; False to leave."""
        name, _, rest = line.strip().partition(" ")
        if name == "/exit":
            return False
        if name == "/reset":
            self.reset()
            self.say("(conversation cleared)")
        elif name == "/stats":
            self.say(self.last.line("last reply"))
            self.say(self.total.line("session"))
            self.say(f"last prompt: {self.last_prefill[0]} tokens prefilled, {self.last_prefill[1]} reused from "
                     f"the cache")
        elif name == "/save":
            if not rest.strip():
                self.say("usage: /save FILE")
            else:
                try:
                    with open(rest.strip(), "w") as f:
                        json.dump(self.messages, f, indent=2, ensure_ascii=False)
                    self.say(f"(saved {len(self.messages)} messages to {rest.strip()})")
                except OSError as err:
                    self.say(f"cannot save: {err}")
        elif name == "/help":
            self.say(HELP)
        else:
            self.say(f"unknown command {name}; /help lists them")
        return True

    def say(self, text: str) -> None:
        print(text, file=self.out, flush=True)

    def reply(self, text: str) -> None:
        """One turn: the user's text in, the assistant's reply streamed out and added to the history."""
        from verispec.loaders.tokenizer import IncrementalDecoder

        self.messages.append({"role": "user", "content": text})
        try:                                      # (a Ctrl-C this early drops the message)
            prompt = self.llm.chat_prompt(self.messages)
            room = self.session.context - len(self.llm.encode(prompt))
            if room < 1:
                raise InvalidRequest(f"the conversation fills the {self.session.context}-token context: /reset")
            params = sampling_params(self.args, room)
        except (VerispecError, KeyboardInterrupt):
            self.messages.pop()
            raise
        decoder = IncrementalDecoder(self.llm.tokenizer) if self.color else None
        shown = {"tokens": 0, "accepted": 0, "seq": None}

        def stream(seq) -> None:
            shown["seq"] = seq
            if decoder is None:
                self.out.write(seq.take_stream_delta())
            else:                            # colour the round's accepted drafts, then the target's token
                new = seq.generated[shown["tokens"]:]
                drafted = seq.metrics.accepted - shown["accepted"]
                head = decoder.push(new[:drafted]) if drafted else ""
                tail = decoder.push(new[drafted:])
                self.out.write((DRAFTED + head + RESET if head else "") + tail)
                shown["tokens"], shown["accepted"] = len(seq.generated), seq.metrics.accepted
            self.out.flush()

        try:
            out = self.llm.generate([prompt], params, on_update=stream, session=self.session)[0]
            answer = out.text
            self.last = Totals()
            self.last.add(out)
            self.total.add(out)
            self.last_prefill = (out.prompt_tokens - out.cached_tokens, out.cached_tokens)
        except KeyboardInterrupt:                 # Ctrl-C: the reply so far stays in the history
            answer = shown["seq"].text if shown["seq"] is not None else ""
            self.out.write(f"{RESET if self.color else ''} [stopped]")
        self.out.write("\n")
        self.out.flush()
        self.messages.append({"role": "assistant", "content": answer})


def run(args) -> int:
    sampling_params(args, 1)                                      # bad flags fail before the model loads
    llm = build_llm(args)
    if llm.tokenizer is None or not llm.tokenizer.chat_template:
        raise VerispecError(f"{args.model} has no chat template; use `verispec generate --raw` instead")
    interactive = sys.stdin.isatty()
    color = args.show_drafts and sys.stdout.isatty() and not os.environ.get("NO_COLOR")
    chat = Chat(llm, args, sys.stdout, color)
    if interactive:
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass
        chat.say(f"verispec chat — {llm.target.name}, proposer {llm.proposer_name}, k={llm.k}. /help for commands.")
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            break
        except KeyboardInterrupt:
            break
        if not line.strip():
            continue
        if line.startswith("/"):
            if not chat.command(line):
                break
            continue
        try:
            chat.reply(line)
        except VerispecError as err:
            chat.say(f"error: {err}")
        except KeyboardInterrupt:
            chat.say(" [stopped]")
    if interactive:
        print(file=sys.stderr)
    return 0
