"""`verispec.LLM`: load a target (and a proposer), then generate for a batch of prompts."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence as Seq

import torch

from verispec.engine.k_policy import K_MAX, KPolicy
from verispec.engine.metrics import SpecMetrics
from verispec.engine.params import SamplingParams
from verispec.models.runner import ModelRunner
from verispec.engine.sequence import Sequence
from verispec.engine.spec_round import speculative_round
from verispec.errors import InvalidRequest, VerispecError
from verispec.loaders.builtin import DEFAULT_DRAFT, DEFAULT_TARGET
from verispec.engine.loading import LoadedModel, load_model
from verispec.models import Transformer
from verispec.proposers import REGISTRY, Proposer

Prompt = str | list[int]
NEEDS_DRAFT = ("draft", "hybrid")
# The context an open-ended answer (`default_max_tokens`) and a conversation (`Session`) may fill
# when the model allows more, as llama.cpp's and Ollama's defaults do: a 32k-token static cache
# of the 1.5B would take 1.9 GB.
DEFAULT_CONTEXT = 4096


@dataclass
class Session:
    """A conversation's target cache kept from one `generate` call to the next: the next prompt's
    longest common prefix with what the cache holds is not prefilled again (a chat's history is the
    prefix of its next turn). One sequence at a time; `cached` are the tokens whose keys and values
    the cache holds, in order."""

    context: int = DEFAULT_CONTEXT
    runner: ModelRunner | None = None
    cached: list[int] = field(default_factory=list)

    def reset(self) -> None:
        self.cached = []


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclass
class RequestOutput:
    index: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str
    prompt_tokens: int
    generated_tokens: int
    prefill_s: float          # start → first generated token (time to first token)
    decode_s: float           # first token → last token
    tokens_per_s: float | None  # (generated_tokens − 1) / decode_s
    spec: dict
    cached_tokens: int = 0    # prompt tokens whose keys and values a Session already held (not prefilled)

    def to_dict(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids, "prompt_tokens": self.prompt_tokens,
                "generated_tokens": self.generated_tokens, "finish_reason": self.finish_reason,
                "prefill_s": round(self.prefill_s, 6), "decode_s": round(self.decode_s, 6),
                "tokens_per_s": self.tokens_per_s, "cached_tokens": self.cached_tokens, "spec": self.spec}


class LLM:
    """A target model, an optional draft model, and a proposer chosen by name.

    Defaults (measured best on a 2-core CPU, docs/PERFORMANCE.md): the embedded 1.5B target,
    int8 weights on CPU (bf16 elsewhere), prompt lookup (`ngram`) with k="auto"; passing a
    draft selects the `draft` proposer.

    >>> llm = LLM()
    >>> out = llm.generate(["def fib(n):"], SamplingParams(temperature=0, max_tokens=32))
    """

    def __init__(self, model: str | Transformer = DEFAULT_TARGET, draft: str | Transformer | None = None, proposer: str | None = None,
                 k: int | str = "auto", dtype: str = "auto", device: str = "cpu", max_batch: int = 32,
                 progress: bool = False, ngram_n: tuple[int, int] = (3, 1), k_max: int = K_MAX,
                 corpus: Seq[str | os.PathLike] | Seq[list[int]] | None = None, draft_vocab: int = 0):
        if proposer is not None and proposer not in REGISTRY:
            raise VerispecError(f"unknown proposer {proposer!r}; choose one of {', '.join(sorted(REGISTRY))}")
        if k != "auto" and (not isinstance(k, int) or not 0 <= k <= K_MAX):
            raise VerispecError(f"k must be 'auto' or an integer in 0 … {K_MAX}, got {k!r}")
        if not isinstance(k_max, int) or not 1 <= k_max <= K_MAX:
            raise VerispecError(f"k_max must be an integer in 1 … {K_MAX}, got {k_max!r}")
        if max_batch < 1:
            raise VerispecError(f"max_batch must be >= 1, got {max_batch}")
        self.target: LoadedModel = _load(model, dtype, device, progress)
        self.tokenizer = self.target.tokenizer
        if proposer is None:            # measured best on a 2-core CPU: prompt lookup with k="auto"
            proposer = "draft" if draft is not None else "ngram"
        self.draft: LoadedModel | None = None
        if proposer in NEEDS_DRAFT:
            self.draft = _load(draft if draft is not None else DEFAULT_DRAFT, dtype, device, progress)
            check_vocab_compatible(self.target, self.draft)
        self.proposer_name = proposer
        self.draft_vocab = self._draft_vocab(draft_vocab)
        self.corpus_index = self._build_index(corpus) if proposer == "retrieval" else None
        self.k = k if proposer != "none" else 0
        self.policy = KPolicy(self.k, k_max)
        if self.k == "auto" and self.target.name != "in-memory":
            self.policy.costs.seed(self._width_ratios(self.target, progress))
            if self.draft is not None and self.draft.name != "in-memory":
                from verispec.engine.calibrate import draft_step_ratio

                self.policy.costs.seed_propose("draft", draft_step_ratio(
                    self.target.model, self.draft.model, f"{_format_key(self.target)}|{_format_key(self.draft)}"))
        self.max_batch = max_batch
        self._ngram_n = ngram_n
        self.context_length = self.target.config.max_position_embeddings

    @staticmethod
    def _width_ratios(target: LoadedModel, progress: bool) -> dict[int, float]:
        """This machine's c_p(n) / c_p(1) for the target (measured once, then read from the cache)."""
        from verispec.engine.calibrate import width_ratios

        say = (lambda r, total: print(f"\rmeasuring pass widths for the K policy (once per machine): "
                                      f"{r}/{total}", end="\n" if r == total else "", file=sys.stderr,
                                      flush=True)) if progress else None
        return width_ratios(target.model, _format_key(target), on_round=say)

    # -- proposers ------------------------------------------------------------------------
    def _build_index(self, corpus) -> "CorpusIndex":
        """Corpus paths (files/directories of text) or token lists -> the retrieval index."""
        from verispec.proposers.retrieval import CorpusIndex, read_corpus

        if not corpus:
            raise VerispecError("the retrieval proposer needs a corpus: --corpus PATH (files or directories)")
        if all(isinstance(c, list) for c in corpus):
            return CorpusIndex([[int(t) for t in c] for c in corpus])
        if self.tokenizer is None:
            raise VerispecError("a text corpus needs a model with a tokenizer; pass token lists instead")
        return CorpusIndex([self.tokenizer.encode(text) for text in read_corpus(corpus)])

    def _draft_vocab(self, n: int) -> torch.Tensor | None:
        """The truncated draft vocabulary (proposers/draft_vocab.py), or None for the full one."""
        if not isinstance(n, int) or n < 0:
            raise VerispecError(f"draft_vocab must be 0 (the full vocabulary) or a positive integer, got {n!r}")
        if n == 0:
            return None
        if self.draft is None:
            raise VerispecError("a draft vocabulary needs a draft model (--proposer draft or hybrid)")
        vocab = min(self.target.config.vocab_size, self.draft.config.vocab_size)
        if n >= vocab:
            return None
        if self.tokenizer is None:
            raise VerispecError("a truncated draft vocabulary is counted with the model's tokenizer; this model has none")
        from verispec.proposers.draft_vocab import frequent_tokens

        return frequent_tokens(self.tokenizer, n, vocab)

    def make_proposer(self) -> Proposer:
        factory = REGISTRY[self.proposer_name]
        if self.proposer_name == "draft":
            return factory(self.draft.model, self.target.config.vocab_size, self.draft_vocab)
        if self.proposer_name == "hybrid":
            return factory(self.draft.model, self.target.config.vocab_size, *self._ngram_n, k_max=self.policy.k_max,
                           vocab=self.draft_vocab)
        if self.proposer_name == "ngram":
            return factory(*self._ngram_n, k_max=self.policy.k_max)
        if self.proposer_name == "retrieval":
            return factory(self.corpus_index)
        return factory()

    # -- prompts --------------------------------------------------------------------------
    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequest("this model has no tokenizer: pass prompts as lists of token ids")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise InvalidRequest("the prompt is empty")
        v = self.target.config.vocab_size
        if any(not 0 <= t < v for t in ids):
            raise InvalidRequest(f"prompt token ids must be in [0, {v})")
        return ids

    def chat_prompt(self, messages: list[dict]) -> str:
        if self.tokenizer is None:
            raise InvalidRequest("this model has no tokenizer, so no chat template")
        return self.tokenizer.apply_chat_template(messages)

    # -- generation -----------------------------------------------------------------------
    def default_max_tokens(self, prompt: Prompt, context: int = DEFAULT_CONTEXT) -> int:
        """Room left for an answer that runs until the model stops: the context (the model's, at most
        `context`) minus the prompt; at least 1."""
        return max(1, min(self.context_length, context) - len(self.encode(prompt)))

    def session(self, context: int = DEFAULT_CONTEXT) -> Session:
        """A conversation whose turns reuse the cached prefix (see Session)."""
        return Session(min(context, self.context_length))

    def generate(self, prompts: Prompt | Seq[Prompt], params: SamplingParams | None = None,
                 on_update: Callable[[Sequence], None] | None = None,
                 session: Session | None = None) -> list[RequestOutput]:
        """Generate for every prompt (and n samples each) together; outputs in prompt order.

        on_update(seq) is called after every round for each sequence that changed (for streaming).
        session: keep the target's cache for the next call (one prompt, n = 1).
        """
        params = params or SamplingParams()
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        encoded = [self.encode(p) for p in prompts]
        limit = self.context_length if session is None else session.context
        for ids in encoded:
            if len(ids) + params.max_tokens > limit:
                raise InvalidRequest(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                                     f"the {'model' if session is None else 'conversation'}'s context of "
                                     f"{limit} tokens")
        jobs = [(i, ids, j) for i, ids in enumerate(encoded) for j in range(params.n)]
        if session is not None and len(jobs) != 1:
            raise InvalidRequest("a session generates one sequence at a time (one prompt, n = 1)")
        outputs: list[RequestOutput] = []
        for start in range(0, len(jobs), self.max_batch):
            outputs += self._run_batch(jobs[start:start + self.max_batch], params, on_update, session)
        return outputs

    def _prefill(self, seqs: list[Sequence], max_len: int, session: Session | None) -> tuple[ModelRunner, int]:
        """The target runner with every sequence's prompt cached (but its last token), and how many
        prompt tokens a session already held."""
        if session is not None:
            if session.runner is None:
                margin = 2 * (self.policy.k_max + 1) + 1
                session.runner = ModelRunner(self.target.model, 1, session.context + margin)
            seq, runner = seqs[0], session.runner
            reused = common_prefix(session.cached, seq.tokens[:-1])
            session.cached = session.cached[:reused]
            runner.cache.set_length(seq.slot, reused)
            runner.extend([seq.slot], [seq.tokens])
            return runner, reused
        target = ModelRunner(self.target.model, len(seqs), max_len)
        # Samples of one prompt (n > 1, verify's thousands) share its prefill: compute it once, copy the cache.
        leaders: dict[tuple[int, ...], Sequence] = {}
        for s in seqs:
            leaders.setdefault(tuple(s.tokens), s)
        target.prefill([s.slot for s in leaders.values()], [s.tokens for s in leaders.values()])
        for s in seqs:
            lead = leaders[tuple(s.tokens)]
            if lead is not s:
                target.cache.copy_prefix(lead.slot, s.slot, target.length(lead.slot))
        return target, 0

    def _run_batch(self, jobs, params: SamplingParams, on_update, session: Session | None = None) -> list[RequestOutput]:
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos and self.tokenizer is not None:
            stop_ids |= set(self.tokenizer.stop_token_ids)
        seqs = []
        for slot, (index, ids, sample) in enumerate(jobs):
            seed = params.seed + sample if params.seed is not None else int.from_bytes(os.urandom(7), "little")
            seqs.append(Sequence(index, ids, params, torch.Generator().manual_seed(seed), slot,
                                 frozenset(stop_ids), self.tokenizer, SpecMetrics(self.proposer_name, self.k)))
        margin = 2 * (min(self.policy.k_max, params.max_tokens) + 1) + 1      # K < max_tokens in every round
        max_len = min(max(len(s.prompt_ids) for s in seqs) + params.max_tokens + margin,
                      self.context_length + margin)
        t_start = time.perf_counter()
        target, reused = self._prefill(seqs, max_len, session)
        proposer = self.make_proposer()
        proposer.start(ModelRunner.static(len(seqs), max_len))
        first_token_at: dict[int, float] = {}
        active = list(seqs)
        self.policy.forget()
        try:
            while active:
                sources = [proposer.source_for(s) for s in active]
                ks = self.policy.choose_round(active, sources, backlogs=[proposer.backlog(s) for s in active])
                report = speculative_round(active, target, proposer, ks)
                self.learn(active, report)
                now = time.perf_counter()
                for s in active:
                    if s.generated or s.finished:
                        first_token_at.setdefault(s.slot, now)
                    if on_update:
                        on_update(s)
                active = [s for s in active if not s.finished]
        finally:                                   # also when interrupted: the cache's committed prefix stays usable
            if session is not None:
                session.cached = seqs[0].tokens[:target.length(seqs[0].slot)]
            proposer.reset()
        t_end = time.perf_counter()
        outputs = [self._output(s, t_start, first_token_at.get(s.slot, t_end), t_end) for s in seqs]
        outputs[0].cached_tokens = reused
        return outputs

    def learn(self, seqs: list[Sequence], report) -> None:
        """Feed measured costs and acceptance into the K policy (used by k="auto")."""
        costs = self.policy.costs
        costs.record_verify(report.width, report.verify_s, len(seqs))
        for source, (steps, seconds) in report.steps.items():
            costs.record_propose(source, steps, seconds)
        for source, (tokens, seconds) in (report.catchup or {}).items():
            costs.record_catchup(source, tokens, seconds)
        for s, src, k, n in zip(seqs, report.sources, report.num_draft, report.num_accepted):
            self.policy.observe(s.slot, src, k, n)

    def _output(self, s: Sequence, t_start: float, t_first: float, t_end: float) -> RequestOutput:
        n = len(s.generated)
        decode_s = t_end - t_first
        text = s.text if self.tokenizer is not None else None
        return RequestOutput(s.index, s.prompt_ids, s.generated, text, s.finish_reason, len(s.prompt_ids), n,
                             t_first - t_start, decode_s, (n - 1) / decode_s if n > 1 and decode_s > 0 else None,
                             s.metrics.to_dict() if self.proposer_name != "none" else {"proposer": "none"})


def _format_key(m: LoadedModel) -> str:
    """Names a loaded model and its weight format in the calibration file (costs differ by format)."""
    formats = sorted({type(mod).__name__ for mod in m.model.modules() if type(mod).__name__.endswith("Linear")})
    return f"{m.name}|{m.model.dtype}|{'+'.join(formats)}"


def _load(model, dtype, device, progress) -> LoadedModel:
    """A model argument, or an in-memory Transformer (tests, embedding verispec in other code)."""
    if isinstance(model, LoadedModel):
        return model
    if isinstance(model, Transformer):
        return LoadedModel("in-memory", model, None, None, 0.0, False)
    return load_model(model, dtype, device, progress)


def check_vocab_compatible(target: LoadedModel, draft: LoadedModel) -> None:
    """Equal vocabularies, or differing only by padding rows beyond the tokenizer (151936 vs 152064)."""
    vt, vd = target.config.vocab_size, draft.config.vocab_size
    tt, td = target.tokenizer, draft.tokenizer
    if tt is not None and td is not None:
        if tt.tokenizer.get_vocab(with_added_tokens=True) != td.tokenizer.get_vocab(with_added_tokens=True):
            raise VerispecError(f"draft {draft.name} and target {target.name} have different tokenizers; "
                                "a draft must share the target's vocabulary")
        real = tt.vocab_size
        if min(vt, vd) < real:
            raise VerispecError(f"draft has {vd} and target {vt} embedding rows but the tokenizer has {real} tokens")
    elif vt != vd:
        raise VerispecError(f"draft vocabulary ({vd}) differs from the target's ({vt}) and there is no "
                            "tokenizer to show the difference is only padding")
