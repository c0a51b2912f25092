"""How many more tokens an answer is expected to run: what a one-off catch-up is amortised over.

A draft model must first prefill what it has not seen (a sequence's prompt, the first time it
drafts for it) before it can draft, and the K policy pays that only when speculating over the
tokens still to come saves more (k_policy.py). A request's max_tokens is only a cap: an open-ended
answer's is the rest of the context, thousands of tokens, while a chat or agent answer often stops
after ten. Counting on the cap, a 3,000-token prompt was prefilled into the draft (~7 s on a 2-core
CPU) for an answer that then ran 20 tokens.

Before anything is known, a scale-free prior (Lomax, shape 1, scale G0): an answer that has run g
tokens runs past x > g with probability (g + G0) / (x + G0) — the longer it has run, the longer it
is expected to go on. Its expected remainder up to the cap c is

    E[min(L, c) − g | L > g] = (g + G0) · ln((c + G0) / (g + G0)).

As answers finish, the ones that ran past g say how much further they went (an answer cut by its
own smaller cap counts to that cap and the prior's tail beyond it); the prior counts as
PRIOR_ANSWERS of them. A seeded sampled request uses the prior alone: its K schedule must depend
on nothing but its own history (KPolicy.choose).
"""

from __future__ import annotations

import math
from collections import deque

G0 = 16                 # the prior's scale, in tokens
PRIOR_ANSWERS = 2.0     # the prior's weight, in finished answers
KEEP = 256              # the most recent finished answers kept


def prior_remaining(generated: int, cap: int) -> float:
    """The prior's expected tokens still to come after `generated`, up to the cap."""
    if cap <= generated:
        return 0.0
    return (generated + G0) * math.log((cap + G0) / (generated + G0))


class AnswerLengths:
    """Lengths of the answers an engine has finished, and the expected remainder of a running one."""

    def __init__(self, keep: int = KEEP):
        self._done: deque[tuple[int, bool]] = deque(maxlen=keep)     # (tokens generated, cut by its cap)

    def record(self, generated: int, capped: bool) -> None:
        """A finished answer: `generated` tokens, ended by a stop (False) or by its max_tokens (True)."""
        if generated > 0:
            self._done.append((generated, capped))

    def expected_remaining(self, generated: int, cap: int, learned: bool = True) -> float:
        """Tokens an answer that has run `generated` tokens, with max_tokens `cap`, is expected to add."""
        prior = prior_remaining(generated, cap)
        if not learned:
            return prior
        total, n = PRIOR_ANSWERS * prior, PRIOR_ANSWERS
        for length, capped in self._done:
            if length <= generated:
                continue
            if length >= cap:
                total += cap - generated
            else:                   # stopped there, or cut by a smaller cap: the prior's tail beyond it
                total += length - generated + (prior_remaining(length, cap) if capped else 0.0)
            n += 1
        return total / n
