"""Prompt lookup: worked examples from proposers/ngram.py."""

from verispec.proposers.ngram import lookup


def test_docstring_example_most_frequent_then_most_recent():
    assert lookup([5, 6, 7, 9, 6, 7, 8, 6, 7], k=2, n_max=3, n_min=1) == [8, 6]


def test_longest_match_wins_over_shorter_ones():
    # n=2 suffix [1, 2] occurred once (followed by 3); n=1 suffix [2] also occurred before 9.
    assert lookup([2, 9, 1, 2, 3, 4, 1, 2], k=2) == [3, 4]


def test_most_frequent_continuation():
    toks = [1, 2, 1, 5, 1, 2, 1, 5, 1, 7, 1]
    # [1, 7, 1] and [7, 1] never occurred before; [1] did, followed by 2 (x2), 5 (x2) and 7 (x1).
    # 2 and 5 tie on count; 5's latest occurrence (position 6) is more recent than 2's (position 4).
    assert lookup(toks, k=1) == [5]


def test_no_match_and_k_zero():
    assert lookup([1, 2, 3, 4], k=3) == []
    assert lookup([1, 2, 1, 2], k=0) == []


def test_continuation_is_capped_at_k_and_at_the_end():
    assert lookup([4, 5, 6, 7, 8, 4, 5], k=2) == [6, 7]
    assert lookup([4, 5, 4], k=5) == [5, 4]


def test_lookup_match_reports_the_matched_length():
    from verispec.proposers.ngram import lookup_match, match_source

    assert lookup_match([2, 9, 1, 2, 3, 4, 1, 2], k=2) == (2, [3, 4])
    assert lookup_match([5, 6, 7, 9, 6, 7, 8, 6, 7], k=2) == (2, [8, 6])
    assert lookup_match([1, 2, 3, 4], k=3) == (0, [])
    assert [match_source(n) for n in (0, 1, 3)] == ["none", "ngram:1", "ngram:3"]


def test_each_match_length_is_its_own_source_for_the_k_policy():
    """source_for tells the policy how long the match is (it keeps an acceptance estimate per length);
    nothing to match means nothing to speculate on."""
    from types import SimpleNamespace

    from verispec.proposers.ngram import NgramProposer

    p = NgramProposer()
    long_match = SimpleNamespace(slot=0, tokens=[7, 8, 9, 1, 7, 8, 9])
    short_match = SimpleNamespace(slot=1, tokens=[3, 1, 4, 5, 3])
    no_match = SimpleNamespace(slot=2, tokens=[1, 2, 3])
    assert [p.source_for(s) for s in (long_match, short_match, no_match)] == ["ngram:3", "ngram:1", "none"]
    proposal = p.propose([long_match, short_match, no_match], [2, 2, 2])
    assert proposal.tokens.tolist() == [[1, 7], [1, 4], [0, 0]] and proposal.num_draft.tolist() == [2, 2, 0]
    assert proposal.source == ["ngram:3", "ngram:1", "none"]


def test_a_long_match_proposes_what_followed_its_longest_occurrence():
    from verispec.proposers.ngram import lookup_match, match_source

    # Docstring example of match_index.py: [1 2 3 4] matched (4 tokens), continuation [5, 0].
    assert lookup_match([1, 2, 3, 4, 5, 0, 1, 2, 3, 4], k=2) == (4, [5, 0])
    # Two earlier occurrences of [7 8 9]; the one preceded by more matching tokens wins, however old.
    toks = [1, 2, 7, 8, 9, 50, 3, 7, 8, 9, 60, 1, 2, 7, 8, 9]
    assert lookup_match(toks, k=3) == (5, [50, 3, 7])
    assert [match_source(n) for n in (4, 7, 8, 15, 16, 300)] == \
        ["ngram:4-7", "ngram:4-7", "ngram:8-15", "ngram:8-15", "ngram:16+", "ngram:16+"]


def test_a_copied_file_is_proposed_as_far_as_it_goes():
    """An answer re-emitting its prompt: after a few tokens of the copy the whole rest is proposed."""
    from verispec.proposers.ngram import lookup_match

    source = list(range(100, 180))
    n, cont = lookup_match(source + [7] + source[:10], k=64)
    assert n == 10 and cont == source[10:74]


def test_the_index_grows_with_the_sequence_and_restarts_after_a_reset():
    from verispec.proposers.match_index import MatchIndex

    idx, toks = MatchIndex(), [3, 1, 4, 1, 5, 9, 2, 6, 1]
    assert idx.find(toks, 2) == (1, [5, 9])                       # [1] seen twice, once each: the most recent
    toks += [5, 3, 1, 4]
    assert idx.find(toks, 3) == (3, [1, 5, 9])
    assert idx.length == len(toks)
    assert idx.find([2, 2], 1) == (1, [2]) and idx.length == 2    # a shorter list: indexed anew


def test_lookup_cost_does_not_grow_with_the_context():
    """32k tokens of repetitive code-like text: each round's lookup (index the new token, then find)
    stays far below a millisecond."""
    import random
    import time

    from verispec.proposers.match_index import MatchIndex

    rng = random.Random(0)
    lines = [[rng.randrange(50) for _ in range(12)] for _ in range(40)]
    toks = [t for _ in range(70) for line in rng.sample(lines, 12) for t in line][:32768]
    idx = MatchIndex()
    idx.find(toks, 64)                                             # index the prompt once
    t = time.perf_counter()
    for i in range(200):
        toks.append(rng.randrange(50))
        idx.find(toks, 64)
    per_round = (time.perf_counter() - t) / 200
    assert per_round < 2e-3, per_round


def test_docstring_example_an_edit_before_the_match_is_applied_to_the_continuation():
    from verispec.proposers.match_index import MatchIndex

    idx = MatchIndex()
    toks = [10, 11, 12, 4, 13, 14, 15, 16, 4, 17, 10, 11, 12, 9, 13, 14, 15]
    assert idx.find(toks, 3) == (7, [16, 9, 17])
    assert idx.edits == {(4,): (9,)}


def test_a_renamed_variable_is_proposed_renamed_after_its_first_rename():
    """A file re-emitted with one name changed (token 7 -> 70): once the copy has realigned after
    the first rename, the rest is proposed with the new name at every later use."""
    from verispec.proposers.match_index import MatchIndex

    source = [20, 21, 22, 1, 7, 2, 3, 4, 5, 7, 6, 8, 9, 11, 12, 7, 13, 14, 15, 16, 7, 17]
    renamed = [70 if t == 7 else t for t in source]
    toks = [0] + source + [0] + renamed[:8]             # the copy: past the first rename, realigned after it
    idx = MatchIndex()
    assert idx.find(toks, 14) == (9, renamed[8:])      # 3 matched + the rename + 5 agreeing before it
    assert idx.edits == {(7,): (70,)}


def test_an_insertion_is_anchored_to_the_token_it_follows():
    from verispec.proposers.match_index import MatchIndex, apply_edits

    source = [1, 2, 3, 4, 5, 6, 7, 8, 5, 9]
    copy = [1, 2, 3, 4, 5, 50, 6, 7, 8]                 # 50 inserted after 5
    idx = MatchIndex()
    assert idx.find(source + [0] + copy, 3) == (9, [5, 50, 9])
    assert idx.edits == {(5,): (5, 50)}
    # A place that already reads the replacement is left as it is.
    assert apply_edits([5, 50, 9, 5, 1], [((5,), (5, 50))]) == \
        ([5, 50, 9, 5, 50, 1], [0, 1, 2, None, 3, 4], [(3, (5,), (5, 50))])


def test_an_edit_the_text_refutes_is_forgotten():
    from verispec.proposers.match_index import MatchIndex

    idx = MatchIndex()
    toks = [10, 11, 12, 4, 13, 14, 15, 16, 4, 17, 10, 11, 12, 9, 13, 14, 15]
    assert idx.find(toks, 3) == (7, [16, 9, 17])
    assert idx.find(toks + [16], 3)[1] == [9, 17, 10]   # not refuted yet: still applied
    assert idx.find(toks + [16, 4], 3)[1] == [17, 10, 11] and idx.edits == {}


def test_no_edit_without_agreeing_text_before_the_break():
    from verispec.proposers.match_index import edit_before

    toks = [10, 11, 12, 4, 13, 14, 15, 99, 98, 97, 9, 13, 14, 15]
    assert edit_before(toks, 6, len(toks) - 1, 3) is None
    toks = [10, 11, 12, 4, 13, 14, 15, 10, 11, 12, 9, 13, 14, 15]
    assert edit_before(toks, 6, len(toks) - 1, 3) == ((4,), (9,), 7)


def test_a_copy_through_an_edit_goes_on_from_its_source():
    """After the text took a proposal whose edit put in the new name, its suffix ([31 70]) occurs
    nowhere earlier — on its own the lookup would follow the earlier 70 ([2 3 4]). The index goes on
    from where the proposal copied; once the text leaves that copy, it searches again."""
    from verispec.proposers.match_index import MatchIndex

    source = [20, 21, 22, 1, 7, 2, 3, 4, 5, 30, 31, 7, 32, 33, 34, 35]
    renamed = [70 if t == 7 else t for t in source]
    toks = [0] + source + [0] + renamed[:8]
    idx = MatchIndex()
    assert idx.find(toks, 4) == (9, [5, 30, 31, 70])
    toks += [5, 30, 31, 70]                               # all four taken
    assert idx.find(toks, 3) == (13, [32, 33, 34])
    assert MatchIndex().find(toks, 3)[1] == [2, 3, 4]     # a fresh index: the suffix search alone
    toks += [32, 99]                                      # the text leaves the copy
    assert idx.find(toks, 3) == (0, [])                  # 99 never occurred: nothing to propose


def test_a_deletion_is_learned_applied_and_refuted_like_any_edit():
    from verispec.proposers.match_index import MatchIndex

    source = [10, 11, 12, 4, 13, 14, 15, 16, 4, 17]
    idx = MatchIndex()
    toks = source + [0, 10, 11, 12, 13, 14, 15]            # the copy dropped the 4
    assert idx.find(toks, 3) == (6, [16, 17, 0]) and idx.edits == {(4,): ()}
    assert idx.find(toks + [16, 4], 3) == (8, [17, 0, 10]) and idx.edits == {}   # the text kept this 4
