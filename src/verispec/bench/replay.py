"""Recorded greedy answers replayed through prompt lookup and the K policy, each round priced from a
fixed cost profile: what `auto` would gain on a kind of machine, without a model or a clock.

A greedy answer does not depend on K, so a recorded one settles every round: the proposer drafts
from the text so far, the drafts are accepted up to the first that differs from the answer, and the
round adds the answer's next token (recovered or bonus). The policy hears what it hears in the
engine (sources, drafted and accepted counts, pass costs), so it chooses what the engine chooses:
on the answers of a bench run this reproduces its K histograms round for round. The cost is the
profile's c_p(K+1) per round instead of a timing, and plain decoding's is c_p(1) per token, so
the ratio is the accounted speedup (bench/costs.py) of a run on that kind of machine. Left out:
token-tree alternatives (the primary chain only) and the first round's riding on the prefill pass
(it is priced as a pass of its own, which is dearer).

A draft model is replayed from its recorded agreement instead (draft_agreement, replay_draft): greedy
drafts from the answer so far are the answer's tokens for as long as the draft's greedy choice after
each prefix is the answer's next token, so one pass of the draft over prompt and answer settles every
round K could ask for.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

from verispec.bench.records import Invalid, parse_records
from verispec.engine.cost_model import StaticCosts
from verispec.engine.k_policy import KPolicy
from verispec.engine.metrics import SpecMetrics
from verispec.engine.params import SamplingParams
from verispec.engine.sequence import Sequence
from verispec.errors import VerispecError
from verispec.models import KVCache, Transformer
from verispec.proposers.ngram import NgramProposer


@dataclass(frozen=True)
class Answer:
    id: str
    category: str
    prompt_ids: list[int]
    token_ids: list[int]        # the greedy answer, its stop token left out
    stop_id: int | None         # the token that ended it; None where it reached its max_tokens


@dataclass
class Replayed:
    plain: float = 0.0          # c_p(1) units plain decoding spends on the answers' tokens
    spent: float = 0.0          # c_p(1) units the rounds spend
    rounds: int = 0
    speculative: int = 0        # rounds with at least one draft
    proposed: int = 0
    accepted: int = 0

    @property
    def speedup(self) -> float:
        return self.plain / self.spent if self.spent else 1.0

    def add_round(self, drafts: int, accepted: int, cost: float) -> None:
        self.rounds += 1
        self.speculative += drafts > 0
        self.proposed += drafts
        self.accepted += accepted
        self.spent += cost


def record(llm, prompts: list, max_tokens: int) -> list[Answer]:
    """Greedy answers of llm (a verispec.LLM) to bench prompts (suites.BenchPrompt). Decoded past
    end-of-sequence and cut at the first stop token, so the answer knows which one ended it (a
    lookup may propose it)."""
    stops = set(llm.tokenizer.stop_token_ids) if llm.tokenizer is not None else set()
    outs = llm.generate([p.render(llm) for p in prompts],
                        SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    answers = []
    for p, o in zip(prompts, outs):
        end = next((i for i, t in enumerate(o.token_ids) if t in stops), None)
        tokens = list(o.token_ids if end is None else o.token_ids[:end])
        answers.append(Answer(p.id, p.category, list(o.prompt_token_ids), tokens,
                              None if end is None else o.token_ids[end]))
    return [a for a in answers if a.token_ids]


def save(answers: list[Answer], path: str | Path) -> None:
    Path(path).write_text("\n".join(json.dumps(asdict(a)) for a in answers) + "\n")


def load(path: str | Path) -> list[Answer]:
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise VerispecError(f"cannot read recorded answers {path}: {exc}") from None
    return parse_records(text, str(path), "recorded answer", _answer)


def _answer(rec: dict) -> Answer:
    answer = Answer(str(rec["id"]), str(rec["category"]), [int(t) for t in rec["prompt_ids"]],
                    [int(t) for t in rec["token_ids"]], None if rec["stop_id"] is None else int(rec["stop_id"]))
    if not answer.prompt_ids or not answer.token_ids:
        raise Invalid("an answer needs a prompt and at least one token")
    return answer


def replay(answers: list[Answer], costs: StaticCosts, max_tokens: int | None = None, repeats: int = 1,
           policy: KPolicy | None = None) -> dict[str, Replayed]:
    """Each answer decoded as a request of max_tokens (default: room for the whole answer) with
    prompt lookup and `policy` (default: K = auto priced with `costs`), answers one after another as
    one engine serves them (what the policy learns carries over), `repeats` times over. Per category
    and "all"."""
    policy = _priced(policy, costs)
    proposer = NgramProposer()
    out: dict[str, Replayed] = defaultdict(Replayed)
    for _ in range(repeats):
        for a in answers:
            _replay_one(a, max_tokens or len(a.token_ids) + 1, costs, policy, proposer, out[a.category])
    return _with_total(out)


def _priced(policy: KPolicy | None, costs: StaticCosts) -> KPolicy:
    """policy (default: K = auto priced with costs), its pass costs seeded from costs at a level of 1."""
    policy = policy or KPolicy("auto", static=costs)
    policy.costs.seed(dict(costs.ratios))
    policy.costs.record_verify(1, 1.0)                  # the level: a 1-token pass costs 1
    return policy


def _with_total(out: dict[str, Replayed]) -> dict[str, Replayed]:
    """Per category, and their sum as "all"."""
    out["all"] = Replayed(*(sum(getattr(r, f.name) for r in out.values()) for f in fields(Replayed)))
    return dict(out)


def _replay_one(a: Answer, max_tokens: int, costs: StaticCosts, policy: KPolicy, proposer: NgramProposer,
                into: Replayed) -> None:
    # What the request produces: the answer up to max_tokens, then its stop token if it came first.
    # An answer recorded up to its own cap ends there, whatever max_tokens allows.
    stop = a.stop_id if a.stop_id is not None and len(a.token_ids) < max_tokens else None
    text = a.token_ids[:max_tokens] + ([] if stop is None else [stop])
    seq = Sequence(0, list(a.prompt_ids), SamplingParams(temperature=0, max_tokens=max_tokens), None, 0,
                   frozenset() if stop is None else frozenset({stop}), None, SpecMetrics("ngram", "auto"))
    policy.forget()
    emitted = 0
    while not seq.finished and emitted < len(text):
        k = policy.choose_for(proposer, [seq])[0]
        proposal = proposer.propose([seq], [k])
        drafts = proposal.tokens[0, : int(proposal.num_draft[0])].tolist()
        accepted = 0
        while accepted < len(drafts) and emitted + accepted < len(text) and drafts[accepted] == text[emitted + accepted]:
            accepted += 1
        for token in text[emitted: emitted + accepted + 1]:
            emitted += 1
            if seq.append(token):                       # the stop token, or max_tokens reached
                break
        width = len(drafts) + 1
        policy.costs.record_verify(width, costs.c_p(width))
        policy.observe(seq.slot, proposal.source[0], len(drafts), accepted)
        into.add_round(len(drafts), accepted, costs.c_p(width))
    into.plain += emitted                                # one 1-token pass per token, the stop token's too
    proposer.release([seq.slot])
    policy.forget_slot(seq.slot)
    policy.finished(len(seq.generated), not seq.finished or seq.finish_reason == "length")


def draft_agreement(draft: Transformer, answers: list[Answer], vocab: torch.Tensor | None = None,
                    kv_dtype: torch.dtype | None = None) -> list[list[bool]]:
    """Per answer, per token: whether the draft model's greedy choice after the prompt and the answer
    before it (over `vocab`, the token ids its LM head keeps, when given) is that token. One pass of
    the draft over each prompt and answer."""
    out = []
    for a in answers:
        ids = a.prompt_ids + a.token_ids
        cache = KVCache.for_model(draft.config, 1, len(ids), draft.dtype, draft.device, kv_dtype)
        pos = torch.arange(len(ids))[None]                                      # (1, T)
        rows = torch.arange(len(a.prompt_ids) - 1, len(ids) - 1)[None]          # (1, A): row t scores ids[t + 1]
        with torch.no_grad():
            logits, _ = draft.forward_logits(torch.tensor([ids]), pos, cache.view([0], pos), rows, vocab)  # (1, A, V')
        choice = logits[0].argmax(-1)                                           # (A,)
        if vocab is not None:
            choice = vocab[choice]
        out.append((choice == torch.tensor(a.token_ids)).tolist())
    return out


def replay_draft(answers: list[Answer], agreements: list[list[bool]], costs: StaticCosts,
                 policy: KPolicy | None = None) -> dict[str, Replayed]:
    """Each answer decoded with the draft model alone under `policy` (default: K = auto priced with
    `costs`, its draft step costs.c_q["draft"] × c_p(1)), a round of K drafts at token t accepting
    the run of agreements from t, up to K. Per category and "all"; a round costs K draft steps and
    c_p(K + 1). Left out: the draft's catch-up on tokens of K = 0 rounds (a pass over them, cheaper
    than as many steps)."""
    policy = _priced(policy, costs)
    c_q = costs.c_q["draft"]
    policy.costs.seed_propose("draft", c_q)
    out: dict[str, Replayed] = defaultdict(Replayed)
    for a, agree in zip(answers, agreements):
        into, t = out[a.category], 0
        policy.forget()
        while t < len(agree):
            k = policy.choose(0, "draft", len(agree) - t)
            accepted = 0
            while accepted < k and t + accepted < len(agree) and agree[t + accepted]:
                accepted += 1
            policy.costs.record_verify(k + 1, costs.c_p(k + 1))
            policy.observe(0, "draft", k, accepted)
            into.add_round(k, accepted, k * c_q + costs.c_p(k + 1))
            t += accepted + 1
        into.plain += len(agree)
        policy.forget_slot(0)
    return _with_total(out)
