"""`verispec.LLM`: load a target (and a proposer), then generate for a batch of prompts."""

from __future__ import annotations

import itertools
import os
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Sequence as Seq

import torch

from verispec.engine.branch_policy import MAX_ALTERNATIVES
from verispec.engine.engine import Engine, Request, encode_prompt
from verispec.engine.cost_model import static_costs
from verispec.engine.k_policy import K_MAX, KPolicy
from verispec.engine.params import SamplingParams
from verispec.engine.scheduler import Entry
from verispec.engine.sequence import Sequence
from verispec import kernels
from verispec.errors import InvalidRequest, VerispecError
from verispec.loaders.builtin import DEFAULT_DRAFT, DEFAULT_TARGET, PAIRED_DRAFTS
from verispec.engine.loading import LoadedModel, draft_auto_dtype, kv_auto_dtype, load_model, parse_dtype
from verispec.models import Transformer
from verispec.models.kv_cache import KV_DTYPES
from verispec.proposers import REGISTRY, Proposer

Prompt = str | list[int]
NEEDS_DRAFT = ("draft", "hybrid")
# The context an open-ended answer (`default_max_tokens`) and a conversation (`Session`) may fill
# when the model allows more, as llama.cpp's and Ollama's defaults do: a 32k-token static cache
# of the 1.5B would take 1.9 GB.
DEFAULT_CONTEXT = 4096


@dataclass
class Session:
    """A conversation: its turns share one context limit, and each turn's prompt (the history so far)
    finds the previous turns' keys and values in the engine's prefix cache, so only the new message
    is prefilled. One sequence at a time."""

    context: int = DEFAULT_CONTEXT

    def reset(self) -> None:
        """Nothing to drop: a new conversation simply shares no prefix with the old one."""


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
    tokens_per_s: float | None  # decode speed: tokens after the first round's / decode_s
    spec: dict
    cached_tokens: int = 0    # prompt tokens whose keys and values a Session already held (not prefilled)
    first_tokens: int = 1     # tokens committed with the first (a speculative first round emits several)

    def to_dict(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids, "prompt_tokens": self.prompt_tokens,
                "generated_tokens": self.generated_tokens, "finish_reason": self.finish_reason,
                "prefill_s": round(self.prefill_s, 6), "decode_s": round(self.decode_s, 6),
                "tokens_per_s": self.tokens_per_s, "cached_tokens": self.cached_tokens,
                "first_tokens": self.first_tokens, "spec": self.spec}


class LLM:
    """A target model, an optional draft model, and a proposer chosen by name.

    Defaults (measured best on a 2-core CPU, docs/PERFORMANCE.md): the embedded 1.5B target, int4
    weights on CPU (bf16 elsewhere), and with k="auto" `hybrid` — prompt lookup where the text
    repeats, else the embedded 0.5B draft model; a target without a paired draft uses lookup, else
    its shipped heads. Passing a draft selects the `draft` proposer.

    >>> llm = LLM()
    >>> out = llm.generate(["def fib(n):"], SamplingParams(temperature=0, max_tokens=32))
    """

    def __init__(self, model: str | Transformer = DEFAULT_TARGET, draft: str | Transformer | None = None, proposer: str | None = None,
                 k: int | str = "auto", dtype: str = "auto", device: str = "cpu", max_batch: int = 32,
                 progress: bool = False, ngram_n: tuple[int, int] = (3, 1), k_max: int = K_MAX,
                 corpus: Seq[str | os.PathLike] | Seq[list[int]] | None = None, draft_vocab: int | str = "auto",
                 kv_dtype: str = "auto", head: str | os.PathLike | None = None, branches: int | str = "auto",
                 draft_dtype: str = "auto", draft_stop: float | str = "auto"):
        if proposer is not None and proposer not in REGISTRY:
            raise VerispecError(f"unknown proposer {proposer!r}; choose one of {', '.join(sorted(REGISTRY))}")
        if k != "auto" and (not isinstance(k, int) or not 0 <= k <= K_MAX):
            raise VerispecError(f"k must be 'auto' or an integer in 0 … {K_MAX}, got {k!r}")
        if not isinstance(k_max, int) or not 1 <= k_max <= K_MAX:
            raise VerispecError(f"k_max must be an integer in 1 … {K_MAX}, got {k_max!r}")
        if max_batch < 1:
            raise VerispecError(f"max_batch must be >= 1, got {max_batch}")
        if kv_dtype != "auto" and kv_dtype not in KV_DTYPES:
            raise VerispecError(f"kv_dtype must be 'auto' or one of {', '.join(KV_DTYPES)}, got {kv_dtype!r}")
        for value in (dtype, draft_dtype):
            if value != "auto":
                parse_dtype(value)                      # an unknown format fails here, before any load
        if branches != "auto" and (not isinstance(branches, int) or not 0 <= branches <= MAX_ALTERNATIVES):
            raise VerispecError(f"branches must be 'auto' or an integer in 0 … {MAX_ALTERNATIVES}, got {branches!r}")
        if draft_stop != "auto" and (isinstance(draft_stop, bool) or not isinstance(draft_stop, (int, float))
                                     or not 0 <= draft_stop < 1):
            raise VerispecError(f"draft_stop must be 'auto' or a probability in [0, 1), got {draft_stop!r}")
        kernels.settings()                              # a misspelt VERISPEC_KERNEL* setting, before any load
        self.branches = branches
        self.draft_stop = None if draft_stop == "auto" else float(draft_stop)    # None: the measured default
        self.target: LoadedModel = _load(model, dtype, device, progress)
        self.kv_dtype = kv_auto_dtype(self.target.model) if kv_dtype == "auto" else KV_DTYPES[kv_dtype]
        if self.target.name != "in-memory":
            self._tune_sweeps(self.target, self.kv_dtype, progress)
        self.tokenizer = self.target.tokenizer
        default_heads = False
        if proposer is None:            # measured best on a 2-core CPU (docs/PERFORMANCE_LOG.md), with k="auto":
            from verispec.heads import shipped_heads    # lookup, else the paired draft model or the shipped heads

            paired = PAIRED_DRAFTS.get(self.target.name)
            if draft is not None:
                proposer = "draft"
            elif paired is not None and head is None:
                proposer, draft = "hybrid", paired
            else:
                default_heads = head is not None or shipped_heads(self.target.name) is not None
                proposer = "hybrid" if default_heads else "ngram"
        self.draft: LoadedModel | None = None
        if head is not None and proposer not in ("head", "hybrid"):
            raise VerispecError(f"a heads file drafts for --proposer head or hybrid, not {proposer}")
        heads_fallback = proposer == "hybrid" and (head is not None or default_heads)   # lookup, else the heads
        if proposer in NEEDS_DRAFT and not heads_fallback:
            self.draft = _load(draft if draft is not None else DEFAULT_DRAFT, draft_auto_dtype(draft_dtype, device),
                               device, progress)
            check_vocab_compatible(self.target, self.draft)
        self.proposer_name = proposer
        self.draft_vocab = self._draft_vocab(draft_vocab)
        self.corpus_index = self._build_index(corpus) if proposer == "retrieval" else None
        self.heads = self._load_heads(head) if proposer == "head" or heads_fallback else None
        if proposer == "head":              # one head per drafted position
            k_max = min(k_max, self.heads.depth)
            k = k if not isinstance(k, int) else min(k, self.heads.depth)
        self.k = k if proposer != "none" else 0
        self._k_max = k_max
        self._width_seed: dict[int, float] | None = None     # this machine's calibrated costs (K = auto)
        self._draft_seed: float | None = None
        if self.k == "auto" and self.target.name != "in-memory":
            self._width_seed = self._width_ratios(self.target, progress)
            if self.draft is not None and self.draft.name != "in-memory":
                from verispec.engine.calibrate import draft_step_ratio

                self._draft_seed = draft_step_ratio(
                    self.target.model, self.draft.model, f"{_format_key(self.target)}|{_format_key(self.draft)}",
                    vocab=self.draft_vocab)
        self.policy = self.new_policy()          # generate()'s; every other engine gets its own
        self.max_batch = max_batch
        self._engine: Engine | None = None
        self._ids = itertools.count()
        self._ngram_n = ngram_n
        self.context_length = self.target.config.max_position_embeddings

    def new_policy(self) -> KPolicy:
        """A K policy for one engine, seeded with this machine's calibrated pass and draft costs."""
        policy = KPolicy(self.k, self._k_max, static_costs(kernels.active_variant()))
        if self._width_seed is not None:
            policy.costs.seed(self._width_seed)
        if self._draft_seed is not None:
            policy.costs.seed_propose("draft", self._draft_seed)
        if self.heads is not None:
            policy.limit("head", self.heads.depth)
            policy.set_prior("head", self._heads_first_acceptance())
            policy.costs.seed_propose("head", policy.static.c_q["head"])   # this CPU kind's profiled cost
        return policy

    @staticmethod
    def _tune_sweeps(target: LoadedModel, kv_dtype, progress: bool) -> None:
        """This machine's sweep schedules for the int4/int6 kernels in force (timed once on the target's
        passes, then read from the cache; nothing where the kernels have none to choose)."""
        from verispec.engine.calibrate import rounds_line, tune_sweeps

        say = rounds_line("timing the kernels' sweep schedules (once per machine)") if progress else None
        tune_sweeps(target.model, on_round=say, kv_dtype=kv_dtype)

    @staticmethod
    def _width_ratios(target: LoadedModel, progress: bool) -> dict[int, float]:
        """This machine's c_p(n) / c_p(1) for the target (measured once, then read from the cache); this
        CPU kind's profile, with a warning, when the passes could not be timed consistently."""
        from verispec.engine.calibrate import rounds_line, width_ratios

        say = rounds_line("measuring pass widths for the K policy (once per machine)") if progress else None
        ratios = width_ratios(target.model, _format_key(target), on_round=say)
        if ratios is None:
            warnings.warn("verispec: passes of different widths could not be timed consistently (another process "
                          "busy on the cores?); --k auto prices them with this CPU kind's profile, and the next "
                          "start measures again", RuntimeWarning, stacklevel=2)
            ratios = dict(static_costs(kernels.active_variant()).ratios)
        return ratios

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

    def _draft_vocab(self, n: int | str) -> torch.Tensor | None:
        """The truncated draft vocabulary (proposers/draft_vocab.py), or None for the full one; "auto" is
        DEFAULT_DRAFT_VOCAB tokens for a draft model with a tokenizer, else the full vocabulary."""
        if n == "auto":
            from verispec.proposers.draft_vocab import DEFAULT_DRAFT_VOCAB

            n = DEFAULT_DRAFT_VOCAB if self.draft is not None and self.tokenizer is not None else 0
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise VerispecError(f"draft_vocab must be 'auto', 0 (the full vocabulary) or a positive integer, "
                                f"got {n!r}")
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

    def _load_heads(self, path) -> "MedusaHeads | EagleHead":
        """The drafting heads (heads/medusa.py): `path`, else the ones shipped for this target."""
        from verispec.heads import load_heads
        from verispec.heads import shipped_heads

        path = path if path is not None else shipped_heads(self.target.name)
        if path is None:
            raise VerispecError(f"no drafting heads ship for {self.target.name}: pass head=FILE (--head FILE); "
                                "`verispec train-head --model MODEL --out FILE` trains them")
        return load_heads(path, self.target.config.hidden_size, self.target.config.vocab_size)

    def _heads_first_acceptance(self) -> float:
        """The heads' held-out first-draft acceptance from their file (0.4 when it does not say)."""
        import json

        try:
            value = float(json.loads(self.heads.meta.get("heldout", "{}"))["chain"][0])
        except (ValueError, KeyError, IndexError, TypeError):
            return 0.4
        return min(max(value, 0.0), 1.0)

    def make_proposer(self) -> Proposer:
        factory = REGISTRY[self.proposer_name]
        if self.proposer_name == "head":
            return factory(self.heads, self.target.model)
        if self.proposer_name == "draft":
            return factory(self.draft.model, self.target.config.vocab_size, self.draft_vocab, self.draft_stop)
        if self.proposer_name == "hybrid" and self.heads is not None:
            return factory(REGISTRY["head"](self.heads, self.target.model), self.target.config.vocab_size,
                           *self._ngram_n, k_max=self.policy.k_max)
        if self.proposer_name == "hybrid":
            return factory(self.draft.model, self.target.config.vocab_size, *self._ngram_n, k_max=self.policy.k_max,
                           vocab=self.draft_vocab, stop_below=self.draft_stop)
        if self.proposer_name == "ngram":
            return factory(*self._ngram_n, k_max=self.policy.k_max)
        if self.proposer_name == "retrieval":
            return factory(self.corpus_index)
        return factory()

    # -- prompts --------------------------------------------------------------------------
    def encode(self, prompt: Prompt) -> list[int]:
        """Text or token ids -> validated token ids."""
        return encode_prompt(self.tokenizer, self.target.config.vocab_size, prompt)

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

    def engine(self, kv_budget_mb: float = 1024, block_size: int = 16, max_running: int | None = None,
               prefill_budget: int = 256, num_blocks: int | None = None, policy: KPolicy | None = None) -> Engine:
        """A new Engine over this LLM's models with a proposer and a K policy of its own (the server
        runs one; `generate` keeps one)."""
        return Engine(self.target.model, self.make_proposer(), policy or self.new_policy(), self.tokenizer,
                      self.proposer_name,
                      self.k, self.context_length, self.draft.model if self.draft is not None else None,
                      kv_budget_mb, block_size, max_running or self.max_batch, prefill_budget, num_blocks,
                      self.kv_dtype, self.branches)

    def clear_prefix_cache(self) -> None:
        """Forget the cached prompts of earlier calls (the next prompt is prefilled in full)."""
        if self._engine is not None:
            self._engine.clear_prefix_cache()

    def generate(self, prompts: Prompt | Seq[Prompt], params: SamplingParams | None = None,
                 on_update: Callable[[Sequence], None] | None = None,
                 session: Session | None = None) -> list[RequestOutput]:
        """Generate for every prompt (and n samples each), up to max_batch sequences at a time;
        outputs in prompt order. Prompts that start like an earlier call's (a shared system prompt,
        a conversation's history) reuse its cached keys and values.

        on_update(seq) is called after every round for each sequence that emitted tokens (streaming).
        session: one conversation's turns (one prompt, n = 1), within its context limit.
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
        if session is not None and (len(encoded) != 1 or params.n != 1):
            raise InvalidRequest("a session generates one sequence at a time (one prompt, n = 1)")
        engine = self._engine_for(encoded, params, session)
        self.policy.forget()

        def sink(update) -> None:
            if on_update is not None and update.seq is not None and (update.token_ids or update.finish_reason):
                on_update(update.seq)

        request = Request(f"generate-{next(self._ids)}", encoded, params, sink, text_deltas=False)
        t_start = time.perf_counter()
        entries = engine.add(request)
        try:
            while not all(e.seq.finished for e in entries):
                engine.step()
        finally:                  # also when interrupted: what was committed stays in the prefix cache
            if not all(e.seq.finished for e in entries):
                engine.abort(request.id)
        return [self._output(e, params.n, t_start) for e in entries]

    def _engine_for(self, encoded: list[list[int]], params: SamplingParams, session: Session | None) -> Engine:
        """The LLM's engine, rebuilt only when its KV pool cannot hold this call's sequences at once
        (up to max_batch of them, each with room for K lookahead)."""
        block = 16
        longest = session.context if session is not None else max(len(ids) for ids in encoded) + params.max_tokens
        per_seq = -(-(longest + 2 * (self.policy.k_max + 1) + 1) // block)
        need = min(len(encoded) * params.n, self.max_batch) * per_seq + 1
        if self._engine is None or self._engine.pool.num_blocks < need:
            self._engine = None                          # free the old pool before allocating the new one
            self._engine = self.engine(block_size=block, prefill_budget=512, num_blocks=max(need, 2),
                                       policy=self.policy)
        return self._engine

    def _output(self, e: Entry, n: int, t_start: float) -> RequestOutput:
        s = e.seq
        t_end = e.done or time.perf_counter()
        t_first = e.first_token or t_end
        count = len(s.generated)
        decode_s = t_end - t_first
        first = min(e.first_count, count) if e.first_token is not None else count
        text = s.text if self.tokenizer is not None else None
        return RequestOutput(s.index // n, s.prompt_ids, s.generated, text, s.finish_reason or "abort",
                             len(s.prompt_ids), count, t_first - t_start, decode_s,
                             (count - first) / decode_s if count > first and decode_s > 0 else None,
                             s.metrics.to_dict() if self.proposer_name != "none" else {"proposer": "none"},
                             e.cached, first)


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
        same_file = tt.source_digest and tt.source_digest == td.source_digest      # the embedded pair: one file
        if not same_file and tt.tokenizer.get_vocab(with_added_tokens=True) != td.tokenizer.get_vocab(
                with_added_tokens=True):
            raise VerispecError(f"draft {draft.name} and target {target.name} have different tokenizers; "
                                "a draft must share the target's vocabulary")
        real = tt.vocab_size
        if min(vt, vd) < real:
            raise VerispecError(f"draft has {vd} and target {vt} embedding rows but the tokenizer has {real} tokens")
    elif vt != vd:
        raise VerispecError(f"draft vocabulary ({vd}) differs from the target's ({vt}) and there is no "
                            "tokenizer to show the difference is only padding")
