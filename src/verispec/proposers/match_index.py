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

Edits. An answer that copies its input with a systematic change (a renamed variable, an added
argument) breaks its match at every place the change recurs. When the best occurrence of a 3-token-or-
longer match is preceded, a few tokens back, by text that agrees again (EDIT_ANCHOR tokens), the text
was copied with an edit: `a` earlier tokens A replaced by `b` tokens B (each at most EDIT_SPAN; the
smallest a + b that realigns, fewest earlier tokens first). The index remembers A -> B (an insertion,
A empty, as [t] -> [t] + B with t the token it follows) and applies its EDITS_KEPT most recent edits
to every continuation it proposes, where the replacement is not already there; an edit that the text
then refutes (where a proposal applied it, the text went on with A) is forgotten. The match length
reported for such an alignment runs back through the edit: the copy agrees, edit included, over all
of it. Edits only shape proposals; verification decides what is kept, as for any draft.

Worked example: tokens = [10 11 12 4 13 14 15 16 4 17 | 10 11 12 9 13 14 15] — [13 14 15] matched,
and before it the copy has 9 where the earlier text had 4, with [10 11 12] agreeing in front: the edit
[4] -> [9]. The match counts as 3 + 1 + 3 = 7 tokens, and with k = 3 proposes [16 9 17]: what followed
the earlier [13 14 15], with the edit applied to its 4.

The cost of `find` is bounded by RECENT × MAX_MATCH comparisons whatever the context length (and an
edit by (EDIT_SPAN + 1)² anchor checks, made once per break), so a round's lookup stays in the
microseconds at 32k tokens; the price is that a longest match whose 3-gram last occurred more than
RECENT times ago is not seen.
"""

from __future__ import annotations

from collections import Counter

RECENT = 32        # occurrences examined per lookup, most recent first
MAX_MATCH = 256    # a match is not extended further back than this
EDIT_SPAN = 8      # an edit replaces at most this many tokens by at most this many
EDIT_ANCHOR = 3    # tokens that must agree just before an edit
EDITS_KEPT = 16    # most recent edits applied to proposals


def edit_before(tokens: list[int], p: int, end: int, m: int) -> tuple[tuple[int, ...], tuple[int, ...], int] | None:
    """The edit that precedes a match: tokens[end-m+1 … end] == tokens[p-m+1 … p] (p < end) and the
    tokens just before differ. Returns (pattern, replacement, aligned length) — the earlier tokens A
    and the later tokens B between the match and EDIT_ANCHOR agreeing tokens (an insertion, A empty,
    with the agreeing token in front of it on both sides), and m + len(B) + the agreeing run before
    the edit — or None."""
    i, j = end - m, p - m                        # the last tokens before the two matching spans
    if j < 0 or m >= MAX_MATCH:
        return None
    for s in range(1, 2 * EDIT_SPAN + 1):        # a + b = s: the smallest edit first
        for a in range(max(0, s - EDIT_SPAN), min(s, EDIT_SPAN) + 1):
            b = s - a
            x, y = j - a, i - b                  # the last agreeing tokens, earlier and later
            if x - EDIT_ANCHOR + 1 < 0 or y < j or x >= y:   # in the text; B after A; two places
                continue
            if any(tokens[x - t] != tokens[y - t] for t in range(EDIT_ANCHOR)):
                continue
            run = EDIT_ANCHOR
            while run < MAX_MATCH and x - run >= 0 and tokens[x - run] == tokens[y - run]:
                run += 1
            c = 0 if a else 1                    # an insertion keeps the token it follows
            context = tuple(tokens[x - c + 1: x + 1])
            return context + tuple(tokens[j - a + 1: j + 1]), context + tuple(tokens[i - b + 1: i + 1]), m + b + run
    return None


def apply_edits(cont: list[int], edits: list[tuple[tuple[int, ...], tuple[int, ...]]]
                ) -> tuple[list[int], list[int | None], list[tuple[int, tuple[int, ...], tuple[int, ...]]]]:
    """cont with each occurrence of an edit's pattern replaced, left to right, the first edit in
    `edits` that matches at a position winning (a place that already reads the replacement is left).
    Returns the result; for each of its tokens the offset in cont of the token it stands for (a
    replacement's last token: the pattern's last; its others: None); and where each replacement
    starts in the result: (offset, pattern, replacement)."""
    out: list[int] = []
    src: list[int | None] = []
    applied = []
    i = 0
    while i < len(cont):
        for pat, rep in edits:
            if cont[i: i + len(pat)] == list(pat) and (not rep or cont[i: i + len(rep)] != list(rep)):
                applied.append((len(out), pat, rep))
                out.extend(rep)
                src.extend([None] * (len(rep) - 1) + [i + len(pat) - 1] if rep else [])
                i += len(pat)
                break
        else:
            out.append(cont[i])
            src.append(i)
            i += 1
    return out, src, applied


class MatchIndex:
    def __init__(self, grams: int = 3) -> None:
        self.grams = grams                                       # n-gram orders indexed: 1 … grams
        self.positions: dict[tuple[int, ...], list[int]] = {}   # n-gram -> end positions, ascending
        self.length = 0                                          # tokens indexed so far
        self.edits: dict[tuple[int, ...], tuple[int, ...]] = {}  # pattern -> replacement, oldest first
        self._breaks: dict[tuple[int, int], int] = {}           # (earlier, later) break -> aligned - m
        self._applied: list[tuple[int, tuple[int, ...], tuple[int, ...]]] = []   # (position, edit) proposed
        self._follow: tuple | None = None                       # (start, m, continuation, its sources)

    def extend(self, tokens: list[int]) -> None:
        """Index tokens[length:], the tokens appended since the last call (a shorter list — a sequence
        that was reset — is indexed anew)."""
        if len(tokens) < self.length:
            self.positions.clear()
            self.edits.clear()
            self._breaks.clear()
            self._applied = []
            self._follow = None
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
        if self._applied:
            self._forget_refuted(tokens)
        end = len(tokens) - 1
        for n in range(min(self.grams, end), 0, -1):
            found = self.positions.get(tuple(tokens[end - n + 1:]))
            earlier = [p for p in found[-RECENT - 1:] if p < end] if found else []
            if earlier:
                break
        else:
            return []
        earlier.reverse()                                            # most recent first
        ranked: list[tuple[int, int]] = []                           # (match length, occurrence)
        if n == self.grams:
            lengths = []
            for p in earlier:
                m = n
                while m < MAX_MATCH and p - m >= 0 and tokens[p - m] == tokens[end - m]:
                    m += 1
                lengths.append(m)
            best = max(range(len(earlier)), key=lambda i: lengths[i])   # the first of the longest
            aligned = self._edit(tokens, earlier[best], end, lengths[best])
            if aligned:
                lengths[best] = aligned
            if max(lengths) > self.grams:                            # sorted() is stable: ties stay most recent first
                order = sorted(range(len(earlier)), key=lambda i: -lengths[i])
                ranked = [(lengths[i], earlier[i]) for i in order]
        if not ranked:
            votes: Counter[tuple[int, ...]] = Counter()
            latest: dict[tuple[int, ...], int] = {}
            for i, p in enumerate(earlier):
                cont = tuple(tokens[p + 1: p + 1 + k])
                votes[cont] += 1
                latest.setdefault(cont, p)
            ranked = [(n, latest[c]) for c in sorted(votes, key=lambda c: (-votes[c], -latest[c]))]
        edits = list(self.edits.items())[::-1][:EDITS_KEPT]         # most recent first
        followed = self._followed(tokens, k, edits) if self._follow else None

        def continuations():                                         # made as needed, best first
            if followed:
                yield (True, *followed)
            for m, p in ranked:
                yield (False, m, *self._continuation(tokens, p, k, edits))

        self._follow = None
        out: list[tuple[int, list[int]]] = []
        for follows, m, cont, src, applied in continuations():
            if cont[:k] and not any(c[: len(cont[:k])] == cont[:k] for _, c in out):
                if not out:                                          # the proposal
                    pending = {a[0] for a in self._applied}
                    self._applied += [(end + 1 + o, pat, rep) for o, pat, rep in applied
                                      if o < k and end + 1 + o not in pending]
                    if applied or follows:
                        self._follow = (end + 1, m, cont, src)
                out.append((m, cont[:k]))
                if len(out) == limit:
                    break
        return out

    def _continuation(self, tokens: list[int], p: int, k: int, edits: list) -> tuple:
        """What followed position p (at least k tokens where the text has them), edited; each token's
        position in tokens (see apply_edits); the edits applied."""
        if not edits:
            return tokens[p + 1: p + 1 + k], list(range(p + 1, min(p + 1 + k, len(tokens)))), []
        cont, src, applied = apply_edits(tokens[p + 1: p + 1 + k + EDIT_SPAN], edits)
        return cont, [None if i is None else p + 1 + i for i in src], applied

    def _followed(self, tokens: list[int], k: int, edits: list) -> tuple | None:
        """A proposal that applied an edit copies from a known place. If the text went on exactly as
        it proposed, go on from the same place (match length: the alignment so far plus the tokens
        since), whatever the suffix now matches: a suffix that ends in an edit's replacement may occur
        nowhere earlier. None when the text went elsewhere."""
        start, m, cont, src = self._follow
        u = len(tokens) - start
        if not 0 < u <= len(cont) or tokens[start:] != cont[:u]:
            return None
        if src[u - 1] is None:                                       # inside a replacement
            return m + u, cont[u:], src[u:], []
        return (m + u, *self._continuation(tokens, src[u - 1], k, edits))

    def _forget_refuted(self, tokens: list[int]) -> None:
        """Drop an edit that the text refuted: where the last proposal applied it, the text went on
        with the pattern's own tokens instead of the replacement's."""
        keep = []
        for q, pat, rep in self._applied:
            got = tokens[q: q + max(len(pat), len(rep))]
            if len(got) < max(len(pat), len(rep)):
                keep.append((q, pat, rep))                           # not yet decided
            elif got[: len(pat)] == list(pat) and (not rep or got[: len(rep)] != list(rep)) and self.edits.get(pat) == rep:
                del self.edits[pat]
        self._applied = keep

    def _edit(self, tokens: list[int], p: int, end: int, m: int) -> int:
        """Learn the edit before the match of m tokens ending at p and end (once per break); returns
        the aligned length through it, or 0 without one."""
        key = (p - m, end - m)                   # the same break while the match grows
        if key not in self._breaks:
            if len(self._breaks) >= 4096:
                self._breaks.clear()
            found = edit_before(tokens, p, end, m)
            self._breaks[key] = found[2] - m if found else 0
            if found:
                pattern, replacement, _ = found
                self.edits.pop(pattern, None)
                self.edits[pattern] = replacement
        return m + self._breaks[key] if self._breaks[key] else 0
