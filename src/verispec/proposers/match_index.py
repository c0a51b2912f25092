"""The longest earlier occurrence of a sequence's current suffix, kept incrementally.

`MatchIndex` files every position of a token list under the 1-, 2- and 3-token n-grams that end
there (append-only lists: `extend` costs O(new tokens)). `find(tokens, k)` then answers:

1. Look up the current suffix's 3-gram, else its 2-gram, else its 1-gram; no entry -> no match.
2. For a 3-gram hit, extend each of the RECENT most recent earlier occurrences backwards, token by
   token, up to MAX_MATCH, and keep the longest (ties: the most recent). A match of 4 tokens or more
   proposes what followed that occurrence: up to k tokens, as far as the earlier text continues —
   the case of an answer that copies its input (an edit, a summary quoting its source).
3. A match of 1–3 tokens proposes the most frequent k-token continuation among the RECENT most
   recent occurrences, ties to the most recent (short matches predict less; the frequency vote helps).

Worked example (k = 2): tokens = [5 6 7 | 9 6 7 8 | 6 7]. The 3-gram [8 6 7] never occurred before;
the 2-gram [6 7] ended at positions 2 and 5, followed by [9 6] and [8 6]: one each, so the most recent
wins: (2, [8, 6]). With tokens = [1 2 3 4 5 | 0 | 1 2 3 4] the 3-gram [2 3 4] ended at 3; extended
backwards the match is [1 2 3 4] (4 tokens), and the proposal is what followed it: (4, [5, 0]).

`candidates` also lists what followed other occurrences, best first: the alternative branches a
round may verify beside the primary continuation (a token tree, sampling/branches.py).

The cost of `find` is bounded by RECENT × MAX_MATCH comparisons whatever the context length, so a
round's lookup stays in the microseconds at 32k tokens; the price is that a longest match whose
3-gram last occurred more than RECENT times ago is not seen.
"""

from __future__ import annotations

from collections import Counter

RECENT = 32        # occurrences examined per lookup, most recent first
MAX_MATCH = 256    # a match is not extended further back than this


class MatchIndex:
    def __init__(self, grams: int = 3) -> None:
        self.grams = grams                                       # n-gram orders indexed: 1 … grams
        self.positions: dict[tuple[int, ...], list[int]] = {}   # n-gram -> end positions, ascending
        self.length = 0                                          # tokens indexed so far

    def extend(self, tokens: list[int]) -> None:
        """Index tokens[length:], the tokens appended since the last call (a shorter list — a sequence
        that was reset — is indexed anew)."""
        if len(tokens) < self.length:
            self.positions.clear()
            self.length = 0
        for end in range(self.length, len(tokens)):
            for n in range(1, min(self.grams, end + 1) + 1):
                self.positions.setdefault(tuple(tokens[end - n + 1: end + 1]), []).append(end)
        self.length = len(tokens)

    def find(self, tokens: list[int], k: int) -> tuple[int, list[int]]:
        """(match length, continuation of at most k tokens) for the current end of tokens; (0, [])
        when the suffix never occurred before. Indexes whatever tokens are new first."""
        found = self.candidates(tokens, k, 1)
        return found[0] if found else (0, [])

    def candidates(self, tokens: list[int], k: int, limit: int) -> list[tuple[int, list[int]]]:
        """Up to `limit` (match length, continuation) pairs with distinct continuations, best first:
        the first is `find`'s answer; the others are what followed other earlier occurrences (long
        matches: by match length, then recency; short ones: by votes, then recency). A continuation
        that is a prefix of an earlier one adds nothing and is left out."""
        self.extend(tokens)
        end = len(tokens) - 1
        for n in range(min(self.grams, end), 0, -1):
            found = self.positions.get(tuple(tokens[end - n + 1:]))
            earlier = [p for p in found[-RECENT - 1:] if p < end] if found else []
            if earlier:
                break
        else:
            return []
        earlier.reverse()                                            # most recent first
        ranked: list[tuple[int, tuple[int, ...]]] = []
        if n == self.grams:
            lengths = []
            for p in earlier:
                m = n
                while m < MAX_MATCH and p - m >= 0 and tokens[p - m] == tokens[end - m]:
                    m += 1
                lengths.append(m)
            if max(lengths) > self.grams:                            # sorted() is stable: ties stay most recent first
                order = sorted(range(len(earlier)), key=lambda i: -lengths[i])
                ranked = [(lengths[i], tuple(tokens[earlier[i] + 1: earlier[i] + 1 + k])) for i in order]
        if not ranked:
            votes: Counter[tuple[int, ...]] = Counter()
            latest: dict[tuple[int, ...], int] = {}
            for i, p in enumerate(earlier):
                cont = tuple(tokens[p + 1: p + 1 + k])
                votes[cont] += 1
                latest.setdefault(cont, i)
            ranked = [(n, c) for c in sorted(votes, key=lambda c: (-votes[c], latest[c]))]
        out: list[tuple[int, list[int]]] = []
        for m, cont in ranked:
            if cont and not any(c[: len(cont)] == list(cont) for _, c in out):
                out.append((m, list(cont)))
                if len(out) == limit:
                    break
        return out
