"""`verispec train-head`: Medusa heads or an EAGLE-style layer for a target, trained on this CPU (heads/train*.py)."""

from __future__ import annotations

import hashlib
import json
import os
import random
import sys
from pathlib import Path

from verispec.errors import VerispecError

DEFAULT_TOKENS = 150_000
DEFAULT_CORPUS = ("answers", "stdlib")
NAMED_CORPORA = ("answers", "tasks", "stdlib")
STDLIB_BYTES = 8 << 20      # of standard-library sources


def add_parser(sub) -> None:
    from verispec.loaders.builtin import DEFAULT_TARGET

    p = sub.add_parser("train-head", help="train drafting heads on the target's own states (--proposer head)",
                       description="Read text with the target (teacher-forced, features cached and resumable), then "
                                   "train Medusa heads to predict the target's own next tokens 2 … H+1 places ahead, "
                                   "or (--kind eagle) one decoder layer that predicts the target's next state from its "
                                   "state and the pending token, drafting autoregressively — within a time budget, "
                                   "printing held-out acceptance as they learn (docs/HEADS.md).")
    p.add_argument("--model", default=DEFAULT_TARGET, help=f"the target the heads draft for (default {DEFAULT_TARGET})")
    p.add_argument("--dtype", default="auto", help="weight format of the target (default auto, as generate)")
    p.add_argument("--kind", default="medusa", choices=["medusa", "eagle"], help="head kind (default medusa)")
    p.add_argument("--corpus", nargs="+", default=list(DEFAULT_CORPUS),
                   help="what to read: 'answers' (the target's own greedy answers to the HumanEval and MT-bench "
                        "prompts, generated once and cached), 'tasks' (its answers to code and explanation requests "
                        "made from the standard library's documented functions and classes, cached likewise), "
                        "'stdlib' (the Python standard library's sources), "
                        f"or text files and directories (default: {' '.join(DEFAULT_CORPUS)})")
    p.add_argument("--tokens", type=int, default=DEFAULT_TOKENS,
                   help=f"how many tokens of text to read (default {DEFAULT_TOKENS:,})")
    p.add_argument("--heads", type=int, default=None,
                   help="future positions drafted: Medusa, one head each; EAGLE, the deepest draft of a round "
                        "(default 4 Medusa heads, 6 EAGLE drafts)")
    p.add_argument("--vocab", type=int, default=16384,
                   help="tokens the heads may propose: those the target says most often in the corpus (default 16384)")
    p.add_argument("--minutes", type=float, default=20, help="training time budget, after features (default 20)")
    p.add_argument("--lr", type=float, default=None, help="learning rate (default 1e-3 Medusa, 5e-4 EAGLE)")
    p.add_argument("--intermediate", type=int, default=2048,
                   help="EAGLE: width of the layer's feed-forward block (default 2048)")
    p.add_argument("--unroll", type=int, default=3,
                   help="EAGLE: steps trained on the layer's own predictions, as drafting runs (default 3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="the heads file to write (.safetensors)")
    p.set_defaults(run=run)


ANSWER_SUITES = ("humaneval", "mtbench")   # public prompt sets whose answers the target writes itself
ANSWER_TOKENS = 384                         # longest answer kept per prompt
ANSWER_BATCH = 16                           # prompts decoded together (plain greedy, row-exact)
TASK_PROMPTS = 480                          # requests made from the standard library's documented names


def _answer_prompts(entry: str) -> list:
    """The prompts of a corpus entry whose answers the target writes: `answers` (HumanEval and MT-bench)
    or `tasks` (code and explanation requests made from the standard library, text_collection.py)."""
    from verispec.bench.suites import BenchPrompt, load_suite
    from verispec.text_collection import stdlib_tasks

    if entry == "answers":
        return [p for suite in ANSWER_SUITES for p in load_suite(suite)]
    return [BenchPrompt(id, kind, prompt) for id, kind, prompt in stdlib_tasks(TASK_PROMPTS)]


def _own_answers(target, dtype: str, entry: str) -> list[list[int]]:
    """Token ids of each prompt of `entry` (chat template applied) followed by the target's own greedy
    answer. Written batch by batch under the cache (`head-answers/`), so an interrupted run resumes; the
    bundled suite's prompts are never used, so that `verispec bench` measures heads on prompts they never saw."""
    from verispec.cache import atomic_file, cache_dir
    from verispec.engine.llm import LLM
    from verispec.engine.params import SamplingParams

    prompts = _answer_prompts(entry)
    name = json.dumps([target.name, dtype, [p.id for p in prompts], ANSWER_TOKENS])
    path = cache_dir() / "head-answers" / f"{hashlib.sha256(name.encode()).hexdigest()[:16]}.json"
    done: dict[str, list[int]] = {}
    if path.exists():
        try:
            done = json.loads(path.read_text())
        except (OSError, ValueError):            # a damaged file is made again
            done = {}
    llm = LLM(target, proposer="none", max_batch=ANSWER_BATCH)
    params = SamplingParams(temperature=0, max_tokens=ANSWER_TOKENS)
    todo = [p for p in prompts if p.id not in done]
    for i in range(0, len(todo), ANSWER_BATCH):
        batch = todo[i: i + ANSWER_BATCH]
        encoded = [llm.encode(p.render(llm)) for p in batch]
        for p, ids, out in zip(batch, encoded, llm.generate(encoded, params)):
            done[p.id] = ids + out.token_ids
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_file(path) as tmp:
            tmp.write_text(json.dumps(done))
        sys.stderr.write(f"\r{entry}: {len(prompts) - len(todo) + i + len(batch)}/{len(prompts)} prompts")
        sys.stderr.flush()
    if todo:
        sys.stderr.write("\n")
    return [done[p.id] for p in prompts]


def _corpus(entries: list[str], target, dtype: str, tokens: int) -> tuple[list[list[int]], str]:
    """Training windows (token ids) from the corpus entries — `answers` (the target's own answers to
    public prompts), `stdlib` (the standard library's sources) or text files and directories — up to
    `tokens` tokens: answers first, then the texts' whole windows, shuffled."""
    from verispec.heads.train import windows_of
    from verispec.text_collection import stdlib_sources

    windows: list[list[int]] = []
    for entry in ("answers", "tasks"):
        if entry in entries:
            windows += windows_of(_own_answers(target, dtype, entry), min_tail=64)
    texts: list[str] = []
    if "stdlib" in entries:
        texts += list(stdlib_sources(STDLIB_BYTES))
    paths = [e for e in entries if e not in NAMED_CORPORA]
    if paths:
        from verispec.proposers.retrieval import read_corpus

        texts += read_corpus(paths)
    rest = windows_of([target.tokenizer.encode(t) for t in texts])
    random.Random(0).shuffle(rest)                # spread the budget over the whole text
    out, used = [], 0
    for w in windows + rest:
        if used + len(w) > tokens:
            break
        out.append(w)
        used += len(w)
    return out, " ".join(entries)


def run(args) -> int:
    import torch

    from verispec.cache import cache_dir
    from verispec.engine.loading import load_model
    from verispec.heads import EagleHead, MedusaHeads, save_head, save_heads
    from verispec.heads.eagle import MAX_DEPTH
    from verispec.heads.medusa import MAX_HEADS
    from verispec.heads.train import WINDOW, extract, heads_vocab, progress_line, record, train, training_tokens
    from verispec.proposers.draft_vocab import frequent_tokens

    eagle = args.kind == "eagle"
    top = MAX_DEPTH if eagle else MAX_HEADS
    args.heads = args.heads if args.heads is not None else 6 if eagle else 4
    args.lr = args.lr if args.lr is not None else 5e-4 if eagle else 1e-3
    if (not 1 <= args.heads <= top or args.tokens < WINDOW or args.minutes <= 0 or args.vocab < 2
            or not 16 <= args.intermediate <= 65536 or not 1 <= args.unroll <= MAX_DEPTH or not args.lr > 0):
        raise VerispecError(f"--heads must be 1 … {top}, --tokens at least {WINDOW}, --minutes and --lr positive, "
                            f"--vocab at least 2, --intermediate 16 … 65536, --unroll 1 … {MAX_DEPTH}")
    out = Path(args.out)
    try:                                    # fail now, not after the features and the training
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise VerispecError(f"cannot write {out}: {exc.strerror or exc}") from None
    if not os.access(out.parent, os.W_OK) or out.is_dir():
        raise VerispecError(f"cannot write {out}: not a writable file path")
    missing = [e for e in args.corpus if e not in NAMED_CORPORA and not Path(e).exists()]
    if missing:
        raise VerispecError(f"--corpus: no such file or directory: {', '.join(missing)}")
    if "answers" in args.corpus:             # the prompt sets are installed: fail before loading anything
        from verispec.bench.suites import public_suite_file

        for suite in ANSWER_SUITES:
            public_suite_file(suite)
    target = load_model(args.model, args.dtype, "cpu", progress=True)
    if target.tokenizer is None:
        raise VerispecError("training heads needs a model with a tokenizer")
    model, cfg = target.model, target.config
    windows, corpus_name = _corpus(args.corpus, target, args.dtype, args.tokens)
    if not windows:
        raise VerispecError(f"the corpus holds no window of {WINDOW} tokens")
    tokens = sum(len(w) for w in windows)
    key = hashlib.sha256(json.dumps([target.name, args.dtype, corpus_name, tokens, len(windows)]).encode()).hexdigest()[:16]
    features = extract(model, windows, cache_dir() / "head-features" / key, on_progress=progress_line)
    n = min(args.vocab, cfg.vocab_size)
    vocab = (heads_vocab(training_tokens(features), n, frequent_tokens(target.tokenizer, n, cfg.vocab_size))
             if n < cfg.vocab_size else torch.arange(n))
    weight = model.lm_head.dequantized() if hasattr(model.lm_head, "dequantized") else model.lm_head.weight.detach()
    head_rows = weight[vocab].float()                                              # (N, C)
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    if eagle:
        from verispec.heads.train_eagle import train as train_eagle

        heads = EagleHead(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, args.intermediate, vocab,
                          depth=args.heads, rms_norm_eps=cfg.rms_norm_eps)
        table = model.model.embed_tokens
        embed = table.dequantized() if hasattr(table, "dequantized") else table.weight.detach()   # (V, C)
        score = train_eagle(heads, embed, head_rows, features, args.minutes, lr=args.lr, unroll=args.unroll,
                            seed=args.seed, log=log)
    else:
        heads = MedusaHeads(args.heads, cfg.hidden_size, vocab)
        score = train(heads, head_rows, features, args.minutes, lr=args.lr, seed=args.seed, log=log)
    command = "verispec train-head " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["train-head"] else "verispec train-head"
    heads.meta = {"vocab_size": str(cfg.vocab_size), "target": target.name, "command": command,
                  "corpus": corpus_name, "tokens": str(tokens), "heldout": json.dumps(score)}
    (save_head if eagle else save_heads)(heads, out)
    record(out, {"command": command, "kind": args.kind, "target": target.name, "corpus": corpus_name,
                 "tokens": tokens, "heads": args.heads, "vocab": len(vocab),
                 "minutes": args.minutes, "heldout": score})
    print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB): held-out acceptance by draft position "
          + " / ".join(f"{x:.2f}" for x in score["chain"]))
    return 0
