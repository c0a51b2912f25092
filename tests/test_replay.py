"""K = auto on recorded answers (bench/replay.py): greedy answers of the embedded 1.5B to the bundled
prompts and 10 HumanEval prompts (tests/data/answers.jsonl, tests/data/record_answers.py), replayed
through prompt lookup and the policy with each kind of machine's pass costs."""

from pathlib import Path

import pytest

from verispec.bench.replay import Answer, load, replay, save
from verispec.engine.cost_model import STATIC_AVX2, STATIC_AVX512, STATIC_AVXVNNI, StaticCosts
from verispec.engine.k_policy import KPolicy
from verispec.errors import VerispecError

ANSWERS = Path(__file__).with_name("data") / "answers.jsonl"
# A Zen/Zen+ EPYC's calibration (docs/results/zen1/profile.json, rounded): every extra row costs about
# half a 1-row pass, the dearest rows of any machine kind met so far.
DEAR_ROWS = StaticCosts(((2, 1.47), (3, 2.01), (4, 2.78), (5, 3.4), (6, 3.8), (8, 5.39), (12, 7.48), (16, 10.29)),
                        {}, {})
PROFILES = {"avx2": STATIC_AVX2, "avxvnni": STATIC_AVXVNNI, "avx512": STATIC_AVX512, "dear rows": DEAR_ROWS}


@pytest.fixture(scope="module")
def answers():
    return load(ANSWERS)


def speedups(answers, costs, policy=None):
    return {cat: r.speedup for cat, r in replay(answers, costs, max_tokens=128, policy=policy).items()}


@pytest.mark.parametrize("kind", PROFILES)
def test_auto_never_costs_much_and_gains_where_answers_repeat_their_prompt(answers, kind):
    """In no category does `auto` fall more than 5 % below plain decoding, and where answers repeat
    their prompt (HumanEval: the function's signature and docstring) it gains."""
    got = speedups(answers, PROFILES[kind])
    assert min(got.values()) >= 0.95, got
    assert got["all"] >= 1.05 and got["humaneval"] >= 1.15, got


@pytest.mark.parametrize("kind", PROFILES)
def test_auto_is_as_good_overall_as_the_best_fixed_k(answers, kind):
    """Overall, `auto` gives at least 97 % of what the best fixed K of 1 … 4 gives on the same answers:
    its choices are worth what they cost, where rows are nearly free and where they are dear."""
    best = max(speedups(answers, PROFILES[kind], KPolicy(k))["all"] for k in (1, 2, 3, 4))
    assert speedups(answers, PROFILES[kind])["all"] >= 0.97 * best


def test_the_bar_is_not_met_by_speculating_blindly(answers):
    """The checks above can fail: a fixed K, or `auto` blind to what wider passes cost (every width
    priced as one pass: a broken calibration), falls below them where rows are dear."""
    assert min(speedups(answers, DEAR_ROWS, KPolicy(2)).values()) < 0.95
    blind = KPolicy("auto")
    blind.costs.pricer = lambda batch=1: (lambda n: 1.0)
    assert speedups(answers, DEAR_ROWS, blind)["all"] < 0.9


def test_plain_rounds_cost_one_pass_per_token(answers):
    """K = 0: one 1-token pass per token, the stop token's included — the speedup is exactly 1."""
    got = replay(answers[:3], STATIC_AVX2, max_tokens=40, policy=KPolicy(0))
    assert got["all"].speedup == 1.0 and got["all"].proposed == 0
    assert got["all"].rounds == sum(min(len(a.token_ids), 40) + (a.stop_id is not None and len(a.token_ids) < 40)
                                    for a in answers[:3])


def test_a_copied_answer_is_accepted_whole():
    """An answer that repeats its prompt's text: lookup drafts it, every draft is accepted, and `auto`
    takes long rounds."""
    text = list(range(1000, 1200))
    a = Answer("copy", "copy", [7, 8, 9] + text + [7, 8, 9], text, 5)
    got = replay([a], STATIC_AVX512)["copy"]
    assert got.accepted == got.proposed > 150
    assert got.rounds < 30 and got.speedup > 5


def test_recorded_answers_round_trip_and_bad_files_are_named(tmp_path):
    a = [Answer("x", "chat", [1, 2, 3], [4, 5], 6), Answer("y", "maths", [1], [2], None)]
    save(a, tmp_path / "a.jsonl")
    assert load(tmp_path / "a.jsonl") == a
    (tmp_path / "bad.jsonl").write_text('{"id": "x", "category": "c", "prompt_ids": [1]}\n')
    with pytest.raises(VerispecError, match="line 1: not a recorded answer"):
        load(tmp_path / "bad.jsonl")
    (tmp_path / "empty.jsonl").write_text('{"id": "x", "category": "c", "prompt_ids": [1], "token_ids": [], '
                                          '"stop_id": null}\n')
    with pytest.raises(VerispecError, match="at least one token"):
        load(tmp_path / "empty.jsonl")
    with pytest.raises(VerispecError, match="cannot read recorded answers"):
        load(tmp_path / "missing.jsonl")
    (tmp_path / "binary.jsonl").write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(VerispecError, match="cannot read recorded answers"):
        load(tmp_path / "binary.jsonl")


def agreement_answers(pattern: list[list[bool]], category: str = "text") -> list[Answer]:
    """Answers of arbitrary tokens for a draft replay: only their agreement matters."""
    return [Answer(f"a{i}", category, [1, 2, 3], list(range(100, 100 + len(p))), None) for i, p in enumerate(pattern)]


def test_a_draft_model_is_replayed_from_its_agreement():
    """A draft that always agrees is accepted whole in long rounds; one that never does is soon left
    out (K = 0 rounds but for probes); K = 0 throughout costs exactly plain decoding."""
    from verispec.bench.replay import replay_draft

    agree = [[True] * 300]
    got = replay_draft(agreement_answers(agree), agree, STATIC_AVX512)["all"]
    assert got.accepted == got.proposed > 240 and got.speedup > 2.2
    never = [[False] * 300]
    got = replay_draft(agreement_answers(never), never, STATIC_AVX2)["all"]
    assert got.accepted == 0 and got.proposed < 20 and got.speedup > 0.95
    assert replay_draft(agreement_answers(agree), agree, STATIC_AVX2, KPolicy(0))["all"].speedup == 1.0


def test_a_short_run_of_misses_does_not_stop_a_draft_that_mostly_agrees(monkeypatch):
    """Agreement at 0.8 (every fifth token missed), then five misses in a row, then 0.8 again: where
    extra rows are nearly free (AVX-512) the draft's slower EMA drafts on through the run, where the
    lookups' EMA stopped it for the 16 rounds until a probe."""
    from verispec.bench.replay import replay_draft
    from verispec.engine import acceptance_rates
    from verispec.engine.ema import EMA

    good = [t % 5 != 4 for t in range(100)]
    pattern = [good + [False] * 5 + good]
    answers = agreement_answers(pattern)
    slow = replay_draft(answers, pattern, STATIC_AVX512)["all"]
    monkeypatch.setattr(acceptance_rates, "MODEL_EMA", EMA)
    fast = replay_draft(answers, pattern, STATIC_AVX512)["all"]
    assert slow.rounds - slow.speculative <= 2 < 16 <= fast.rounds - fast.speculative
    assert slow.speedup > 1.03 * fast.speedup


@pytest.mark.real
def test_a_model_agrees_with_its_own_greedy_answer_token_for_token(real_pair):
    """draft_agreement on real weights: the 0.5B's own greedy answer is its greedy choice at every token
    (one pass over prompt and answer scores what decoding chose step by step), and the same answer
    moved on by one token is not."""
    from verispec import LLM, SamplingParams
    from verispec.bench.replay import draft_agreement

    _, draft = real_pair
    prompt = draft.tokenizer.encode("def quicksort(arr):")
    out = LLM(draft, proposer="none").generate([prompt], SamplingParams(temperature=0, max_tokens=24,
                                                                        ignore_eos=True))[0].token_ids
    own = Answer("own", "code", prompt, list(out), None)
    moved = Answer("moved", "code", prompt, list(out[1:]) + [out[0]], None)
    agree_own, agree_moved = draft_agreement(draft.model, [own, moved])
    assert agree_own == [True] * len(out)
    assert not all(agree_moved)
