"""`verispec bench`: speedup, acceptance and predicted-vs-measured on a prompt suite, in one run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from verispec.cli import invocation
from verispec.cli.generate import add_model_args
from verispec.errors import VerispecError


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x]
    except ValueError:
        raise VerispecError(f"expected comma-separated integers, got {text!r}") from None


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x]
    except ValueError:
        raise VerispecError(f"expected comma-separated numbers, got {text!r}") from None


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="measure speedup vs plain decoding on a prompt suite",
                       description="Run a prompt suite with plain decoding and each speculative mode, "
                                   "interleaved in one process, and report tokens/s, speedup vs plain "
                                   "(same run), acceptance, tau, alpha and the predicted speedup.")
    add_model_args(p)
    p.add_argument("--prompts", default=None,
                   help="prompt suite: a JSONL file ({id, category, prompt|messages}), 'humaneval' (164 problems) "
                        "or 'mtbench' (80 questions; first turns); default: the bundled suite")
    p.add_argument("--limit", type=int, default=None, help="use a random subset of N prompts (seeded)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per prompt (default 64)")
    p.add_argument("--modes", default="draft,ngram", help="comma-separated proposers besides plain: draft, ngram, "
                   "hybrid, head, hybrid+head (lookup, else the heads) (default draft,ngram); each runs at every "
                   "--ks value. A suffix /bN verifies up to N of lookup's alternative continuations beside "
                   "each draft (/b0: chains only; default: as many as pay, chosen from measured costs). A "
                   "suffix [module.NAME=value;…] runs the mode with verispec's tuning constants set so (e.g. "
                   "'hybrid,hybrid[engine.acceptance_rates.MODEL_EMA=0.2]': an A/B of a policy change in one "
                   "process)")
    p.add_argument("--ks", default="4", help="comma-separated K values, integers or 'auto' (default 4)")
    p.add_argument("--temperatures", default="0", help="comma-separated temperatures (default 0)")
    p.add_argument("--top-k", type=int, default=0,
                   help="sampled runs (T > 0) keep the K most likely tokens, in every mode and peer (default 0: off)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="sampled runs (T > 0) keep the fewest tokens holding this much probability, in every mode "
                        "and peer (default 1.0: off)")
    p.add_argument("--batch-sizes", default="1", help="comma-separated batch sizes (default 1)")
    p.add_argument("--repeats", type=int, default=1, help="repeats per prompt; medians are reported (default 1)")
    p.add_argument("--json", dest="json_file", default=None, help="write every raw number to this file")
    p.add_argument("--markdown", default=None, help="write a Markdown report (command, costs, table) to this file")
    p.add_argument("--plot", default=None, metavar="DIR", help="write PNG plots to this directory")
    p.add_argument("--peer", choices=["hf", "llamacpp"], action="append", default=[],
                   help="also run a peer on the same prompts in the same run (repeatable): 'hf' = transformers "
                        "generate() plain, with the draft as assistant_model, and with prompt lookup (float32; "
                        "needs transformers + accelerate); 'llamacpp' = llama.cpp plain and prompt lookup on the "
                        "same GGUF file and thread count (needs llama-cpp-python: pip install 'verispec[llamacpp]')")
    p.set_defaults(run=run)


def run(args) -> int:
    from verispec.bench.console import print_summary, progress_bar
    from verispec.bench.run import format_markdown, parse_modes, run_bench, split_modes
    from verispec.bench.suites import load_suite
    from verispec.loaders.builtin import DEFAULT_DRAFT
    from verispec.engine.loading import draft_auto_dtype, load_model

    if args.max_tokens < 1 or args.repeats < 1 or (args.limit is not None and args.limit < 1):
        raise VerispecError("--max-tokens, --repeats and --limit must be positive")
    from verispec.engine.params import SamplingParams

    temperatures = _floats(args.temperatures)
    if not temperatures:
        raise VerispecError("--temperatures needs at least one value")
    for t in temperatures:                                    # bad values fail before anything loads
        SamplingParams(temperature=t, top_k=args.top_k, top_p=args.top_p)
    if (args.top_k or args.top_p < 1.0) and not any(t > 0 for t in temperatures):
        print("verispec: note: --top-k and --top-p apply to sampled runs only, and --temperatures has no T > 0",
              file=sys.stderr)
    ks = [k if k == "auto" else _ints(k)[0] for k in args.ks.split(",") if k]
    if any(k != "auto" and not 1 <= k <= 64 for k in ks):
        raise VerispecError("--ks values must be 'auto' or in 1 … 64")
    modes = parse_modes(split_modes(args.modes), ks)
    prompts = load_suite(args.prompts, args.limit)
    target = load_model(args.model, args.dtype, args.device, progress=True)
    draft = None
    if any(m.needs_draft for m in modes):
        draft = load_model(args.draft or DEFAULT_DRAFT, draft_auto_dtype(args.draft_dtype, args.device), args.device,
                           progress=True)
    peers = []
    if "hf" in args.peer:
        from verispec.bench.peers import hf_peers

        if draft is None:
            draft = load_model(args.draft or DEFAULT_DRAFT, draft_auto_dtype(args.draft_dtype, args.device),
                               args.device, progress=True)
        print("loading the transformers peer (float32) …", file=sys.stderr, flush=True)
        peers += hf_peers(target, draft, target.tokenizer.stop_token_ids if target.tokenizer else [0])
    if "llamacpp" in args.peer:
        import torch

        from verispec.bench.peers import llamacpp_peers
        from verispec.engine.llm import LLM

        print("loading the llama.cpp peer …", file=sys.stderr, flush=True)
        render = LLM(target, proposer="none")
        longest = max(len(render.encode(p.render(render))) for p in prompts)
        peers += llamacpp_peers(target, target.tokenizer.stop_token_ids if target.tokenizer else [0],
                                longest + args.max_tokens + 16, torch.get_num_threads())
    with progress_bar() as progress:
        result = run_bench(target, draft, prompts, modes, temperatures, args.max_tokens,
                           args.repeats, _ints(args.batch_sizes), peers=peers, progress=progress,
                           draft_vocab=args.draft_vocab, kv_dtype=args.kv_dtype, head=args.head,
                           draft_stop=args.draft_stop, top_k=args.top_k, top_p=args.top_p)
    result["command"] = invocation()
    print_summary(result)
    if args.plot:
        from verispec.bench.plots import write_plots
        for path in write_plots(result, args.plot):
            print(f"plot: {path}", file=sys.stderr)
    if args.markdown:
        Path(args.markdown).write_text(format_markdown(result))
        print(f"report: {args.markdown}", file=sys.stderr)
    if args.json_file:
        Path(args.json_file).write_text(json.dumps(result, indent=1))
        print(f"raw results: {args.json_file}", file=sys.stderr)
    return 0
