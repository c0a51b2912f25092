"""`verispec generate`: one prompt in, streamed text out, a one-line summary on stderr."""

from __future__ import annotations

import sys

from verispec.engine.llm import DEFAULT_CONTEXT
from verispec.errors import InvalidRequest
from verispec.loaders.builtin import DEFAULT_TARGET
from verispec.proposers import REGISTRY


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text for one prompt",
                       description="Generate a completion. The prompt comes from the argument or stdin; "
                                   "instruct models get their chat template unless --raw.")
    p.add_argument("prompt", nargs="?", help="the prompt (default: read stdin)")
    add_model_args(p)
    add_sampling_args(p)
    p.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    p.add_argument("--system", default=None, help="system message for the chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    p.set_defaults(run=run)


def add_sampling_args(p) -> None:
    """Sampling flags shared by `generate` and `chat`."""
    p.add_argument("--max-tokens", type=int, default=None,
                   help=f"most tokens to generate (default: until the model stops, within a {DEFAULT_CONTEXT}-token "
                        "context)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (1 = off)")
    p.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def sampling_params(args, max_tokens: int):
    """SamplingParams from the shared flags; max_tokens when --max-tokens was not given."""
    from verispec import SamplingParams

    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                          max_tokens=max_tokens if args.max_tokens is None else args.max_tokens, seed=args.seed,
                          stop=args.stop)


WEIGHT_CHOICES = ["auto", "float32", "bfloat16", "float16", "int8", "int4", "int4-all"]


def add_model_args(p) -> None:
    p.add_argument("--model", default=DEFAULT_TARGET,
                   help=f"target: a .gguf file, a Hugging Face directory, or a built-in name (default {DEFAULT_TARGET})")
    p.add_argument("--draft", default=None,
                   help="draft model for --proposer draft/hybrid (default: the embedded 0.5B); giving one "
                        "selects --proposer draft")
    p.add_argument("--proposer", default=None, choices=sorted(REGISTRY),
                   help="how drafts are proposed: draft (a small model), ngram (prompt lookup), head "
                        "(drafting heads on the target), hybrid (lookup when it matches, else the draft "
                        "model, or the heads with --head), retrieval (lookup in --corpus), none (plain "
                        "decoding). Default (measured fastest on CPU): hybrid — lookup, else the target's "
                        "paired draft model (the embedded 0.5B for the embedded 1.5B); for another target "
                        "lookup, else its shipped heads, or ngram alone; draft when --draft is given")
    p.add_argument("--corpus", action="append", default=None, metavar="PATH",
                   help="text files or directories for --proposer retrieval (repeatable)")
    p.add_argument("--k", type=parse_k, default="auto",
                   help="draft tokens per round: an integer 0 … 64, or 'auto' (default) to choose per "
                        "sequence and round from measured costs and acceptance, 0 included")
    p.add_argument("--dtype", default="auto", choices=WEIGHT_CHOICES,
                   help="weights: auto (default: int4 on CPU, bfloat16 on GPU), float32 (reference), "
                        "bfloat16, int8 (int8 weights per channel, activations rounded to 16 bits per token "
                        "inside the native kernel; float32 elsewhere), int4 (the GGUF's Q4_K tensors "
                        "as the file stores them, with activations rounded to 8 bits per group of 32; the other "
                        "linears int8), or int4-all (the other linears rounded into int4 too: faster, further "
                        "from the file's weights)")
    p.add_argument("--draft-dtype", default="auto", choices=WEIGHT_CHOICES,
                   help="the draft model's weights, as --dtype; auto (default) is int4-all on CPU (a draft's "
                        "weights change how often its guesses are accepted, never the output)")
    p.add_argument("--kv-dtype", default="auto", choices=["auto", "float32", "bfloat16", "int8"],
                   help="keys and values in the cache: auto (bfloat16 where the native pass runs, else the "
                        "model's dtype), float32, bfloat16 (half the memory), or int8 (one scale per position "
                        "and head: ~3.6x the sequences per GiB of float32); the native pass reads all three in "
                        "place")
    p.add_argument("--draft-vocab", type=parse_draft_vocab, default="auto", metavar="N",
                   help="let the draft model propose only the N most frequent tokens (its LM head reads N rows "
                        "instead of all; output unchanged: the target verifies over its whole vocabulary). "
                        "auto (default): 32768 for a draft model; 0 = the full vocabulary")
    p.add_argument("--draft-stop", type=parse_draft_stop, default="auto", metavar="P",
                   help="the draft model stops drafting for a round after a token it gave less than P "
                        "(auto, the default: 0.6, measured; 0 = always draft K; output unchanged)")
    p.add_argument("--branches", type=parse_branches, default="auto",
                   help="alternative continuations lookup verifies beside each draft in the same pass (a token "
                        "tree): 'auto' (default) when they pay at the measured costs, or an integer 0 … 4 "
                        "(0 = chains only)")
    p.add_argument("--head", default=None, metavar="FILE",
                   help="drafting heads for --proposer head (default: the heads shipped for the target; "
                        "`verispec train-head` makes them)")
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")


def parse_k(text: str) -> int | str:
    import argparse

    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'auto', got {text!r}") from None


def parse_draft_vocab(text: str) -> int | str:
    import argparse

    if text == "auto" or text.isdigit():
        return text if text == "auto" else int(text)
    raise argparse.ArgumentTypeError(f"expected 'auto' or a whole number, got {text!r}")


def parse_draft_stop(text: str) -> float | str:
    import argparse

    if text == "auto":
        return text
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if 0 <= value < 1:
        return value
    raise argparse.ArgumentTypeError(f"expected 'auto' or a probability in [0, 1), got {text!r}")


def parse_branches(text: str) -> int | str:
    import argparse

    if text == "auto":
        return text
    if text.isdigit() and 0 <= int(text) <= 4:
        return int(text)
    raise argparse.ArgumentTypeError(f"expected 'auto' or an integer 0 … 4, got {text!r}")


def build_llm(args):
    from verispec import LLM

    return LLM(model=args.model, draft=args.draft, proposer=args.proposer, k=args.k, dtype=args.dtype,
               draft_dtype=args.draft_dtype, device=args.device, progress=True, corpus=args.corpus, draft_vocab=args.draft_vocab,
               kv_dtype=args.kv_dtype, head=args.head, branches=args.branches, draft_stop=args.draft_stop)


def run(args) -> int:
    from verispec.cli.main import print_json

    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    if not prompt.strip():
        raise InvalidRequest("empty prompt: pass it as an argument or on stdin")
    sampling_params(args, 1)                        # bad flags fail before the model loads
    llm = build_llm(args)
    if not args.raw and llm.tokenizer is not None and llm.tokenizer.chat_template:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        prompt = llm.chat_prompt(messages + [{"role": "user", "content": prompt}])
    params = sampling_params(args, llm.default_max_tokens(prompt))

    def stream(seq) -> None:
        delta = seq.take_stream_delta()
        if delta:
            sys.stdout.write(delta)
            sys.stdout.flush()

    out = llm.generate([prompt], params, on_update=None if args.json else stream)[0]
    if args.json:
        print_json(out.to_dict())
        return 0
    sys.stdout.write("\n")
    sys.stdout.flush()
    spec = out.spec
    extra = ""
    if spec.get("rounds"):
        rate = spec["acceptance_rate"]
        extra = (f", {spec['proposer']} k={spec['k']}: acceptance {rate:.0%}" if rate is not None else "") + \
                f", τ={spec['mean_accepted_length']:.2f} tokens/round"
    tps = f"{out.tokens_per_s:.2f} tok/s" if out.tokens_per_s else "n/a"
    print(f"[{out.prompt_tokens} prompt tokens, {out.generated_tokens} generated ({out.finish_reason}), "
          f"prefill {out.prefill_s:.2f}s, decode {tps}{extra}]", file=sys.stderr)
    return 0
