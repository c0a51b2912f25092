"""`verispec train-head`: Medusa heads for a target, trained on this CPU (heads/train.py)."""

from __future__ import annotations

import hashlib
import json
import os
import random
import sys
from pathlib import Path

from verispec.errors import VerispecError

DEFAULT_TOKENS = 150_000
STDLIB_BYTES = 8 << 20      # of standard-library sources, the default corpus


def add_parser(sub) -> None:
    from verispec.loaders.builtin import DEFAULT_TARGET

    p = sub.add_parser("train-head", help="train drafting heads on the target's own states (--proposer head)",
                       description="Read text with the target (teacher-forced, features cached and resumable), then "
                                   "train Medusa heads to predict the target's own next tokens 2 … H+1 places ahead "
                                   "within a time budget, printing held-out acceptance as they learn.")
    p.add_argument("--model", default=DEFAULT_TARGET, help=f"the target the heads draft for (default {DEFAULT_TARGET})")
    p.add_argument("--dtype", default="auto", help="weight format of the target (default auto, as generate)")
    p.add_argument("--kind", default="medusa", choices=["medusa", "eagle"], help="head kind (default medusa)")
    p.add_argument("--corpus", nargs="*", default=None,
                   help="text files or directories to read (default: the Python standard library's sources)")
    p.add_argument("--tokens", type=int, default=DEFAULT_TOKENS,
                   help=f"how many tokens of text to read (default {DEFAULT_TOKENS:,})")
    p.add_argument("--heads", type=int, default=4, help="future positions drafted, one head each (default 4)")
    p.add_argument("--vocab", type=int, default=16384,
                   help="tokens the heads may propose, the most frequent in the corpus (default 16384)")
    p.add_argument("--minutes", type=float, default=20, help="training time budget, after features (default 20)")
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate (default 1e-3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="the heads file to write (.safetensors)")
    p.set_defaults(run=run)


def _corpus_texts(paths: list[str] | None, budget_chars: int) -> tuple[list[str], str]:
    from verispec.text_collection import stdlib_sources

    if not paths:
        return list(stdlib_sources(budget_chars)), "python-stdlib"
    from verispec.proposers.retrieval import read_corpus

    return read_corpus(paths), " ".join(paths)


def run(args) -> int:
    import torch

    from verispec.cache import cache_dir
    from verispec.engine.loading import load_model
    from verispec.heads import MedusaHeads, save_heads
    from verispec.heads.medusa import MAX_HEADS
    from verispec.heads.train import WINDOW, extract, progress_line, record, train, windows_of
    from verispec.proposers.draft_vocab import frequent_tokens

    if args.kind == "eagle":
        raise VerispecError("EAGLE-style heads are not built yet; use --kind medusa")
    if not 1 <= args.heads <= MAX_HEADS or args.tokens < WINDOW or args.minutes <= 0 or args.vocab < 2:
        raise VerispecError(f"--heads must be 1 … {MAX_HEADS}, --tokens at least {WINDOW}, --minutes positive, "
                            "--vocab at least 2")
    out = Path(args.out)
    try:                                    # fail now, not after the features and the training
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise VerispecError(f"cannot write {out}: {exc.strerror or exc}") from None
    if not os.access(out.parent, os.W_OK) or out.is_dir():
        raise VerispecError(f"cannot write {out}: not a writable file path")
    target = load_model(args.model, args.dtype, "cpu", progress=True)
    if target.tokenizer is None:
        raise VerispecError("training heads needs a model with a tokenizer")
    model, cfg = target.model, target.config
    texts, corpus_name = _corpus_texts(args.corpus, STDLIB_BYTES)
    ids = [target.tokenizer.encode(t) for t in texts]
    windows = windows_of(ids)
    random.Random(args.seed).shuffle(windows)             # spread the budget over the whole corpus
    windows = windows[: args.tokens // WINDOW]
    if not windows:
        raise VerispecError(f"the corpus holds no window of {WINDOW} tokens")
    key = hashlib.sha256(json.dumps([target.name, args.dtype, corpus_name, len(windows), args.seed]).encode()).hexdigest()[:16]
    features = extract(model, windows, cache_dir() / "head-features" / key, on_progress=progress_line)
    n = min(args.vocab, cfg.vocab_size)
    vocab = frequent_tokens(target.tokenizer, n, cfg.vocab_size) if n < cfg.vocab_size else torch.arange(n)
    weight = model.lm_head.dequantized() if hasattr(model.lm_head, "dequantized") else model.lm_head.weight.detach()
    head_rows = weight[vocab].float()                                              # (N, C)
    heads = MedusaHeads(args.heads, cfg.hidden_size, vocab)
    score = train(heads, head_rows, features, args.minutes, lr=args.lr, seed=args.seed,
                  log=lambda s: print(s, file=sys.stderr, flush=True))
    command = "verispec train-head " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["train-head"] else "verispec train-head"
    heads.meta = {"vocab_size": str(cfg.vocab_size), "target": target.name, "command": command,
                  "corpus": corpus_name, "tokens": str(len(windows) * WINDOW), "heldout": json.dumps(score)}
    save_heads(heads, out)
    record(out, {"command": command, "target": target.name, "corpus": corpus_name,
                 "tokens": len(windows) * WINDOW, "heads": args.heads, "vocab": len(vocab),
                 "minutes": args.minutes, "heldout": score})
    print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB): held-out acceptance by draft position "
          + " / ".join(f"{x:.2f}" for x in score["chain"]))
    return 0
