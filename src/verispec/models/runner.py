"""ModelRunner: a model plus the KV cache the engine allocated for it (static or paged), and ragged
batched passes."""

from __future__ import annotations

import torch

from verispec.models import KVCache, Transformer

# Up to this many new tokens per row a pass is bound by reading the weights, so sequences share one
# pass; beyond it every row is compute-bound and padding the batch to its longest chunk would be
# wasted work (a 500-token prompt next to a 50-token one: 2,000 rows computed for 550), so each
# sequence's chunk gets a pass of its own.
SHARED_PASS_MAX = 16
PIECE_WASTE = 0.15        # padding a prefill pass may carry to keep its pieces wide (piece_width)
# Prefill and catch-up pieces are at most this many rows, a multiple of 16, though a row-exact pass may
# hold one more (a verify pass of 64 drafts): the amx kernels multiply 16 rows per tile, and a 65th
# row costs nearly a tile sweep of its own (a 3,090-token prompt prefilled 1.12x faster in pieces of 64
# than of 65 on a Xeon; the same speed either way with the avx512bf16 kernels; docs/PERFORMANCE_LOG.md).
PIECE_ROWS = 64


class ModelRunner:
    def __init__(self, model: Transformer, num_slots: int = 0, max_len: int = 0, cache=None):
        self.model = model
        self.cache = cache if cache is not None else KVCache.for_model(
            model.config, num_slots, max_len, model.dtype, model.device)

    def length(self, slot: int) -> int:
        return self.cache.lengths[slot]

    @classmethod
    def static(cls, num_slots: int, max_len: int):
        """A factory of runners over static caches of num_slots × max_len (Proposer.start's argument)."""
        return lambda model: cls(model, num_slots, max_len)

    def forward(self, slots: list[int], chunks: list[list[int]], rows: list[list[int]] | None,
                vocab: torch.Tensor | None = None, states: bool = False, starts: list[int] | None = None,
                pad_beyond: bool = False):
        """Feed chunks[b] at positions length(slot_b) … (or starts[b] …) and return logits at rows[b]
        (indices into the chunk), shape (B', R, V) with B' = len(rows) and R = max len(rows[b]) (short
        rows repeat their last index). Entries past len(rows) are fed only (pieces of a prefill riding
        along, `pieces`); an entry's slot may repeat, its pieces at their own starts.

        vocab: logits for these token ids only, (B, R, N) (a truncated draft vocabulary).
        states: return (logits, h) with h the final-normed states those logits came from, (B, R, C)
        (what drafting heads read).
        Chunks are right-padded; padding writes only beyond each sequence's real tokens, which the
        next pass overwrites and no real query can see. pad_beyond: padding rows sit past the pass's
        last real position instead of right after their own chunk — needed when one slot has several
        entries (pieces), where one piece's padding would land on another's tokens. Does not move the
        length pointers.
        """
        t = max(len(c) for c in chunks)
        device = self.model.device
        start = starts if starts is not None else [self.length(s) for s in slots]
        # Built as lists, then one tensor each: a pass's Python runs with cold caches (the weights have
        # just streamed through them), where every small torch op costs tens of microseconds.
        ids = torch.tensor([c + [0] * (t - len(c)) for c in chunks], dtype=torch.long, device=device)    # (B, T)
        top = max(s + len(c) for s, c in zip(start, chunks))              # past the last real position
        pos = [[s + j if j < len(c) or not pad_beyond else top + j for j in range(t)] for s, c in zip(start, chunks)]
        positions = torch.tensor(pos, dtype=torch.long, device=device)                                 # (B, T)
        view = self.cache.view(slots, positions, kv_len=max(max(row) for row in pos) + 1)
        if rows is None:                                 # a prefill: keys and values only
            self.model(ids, positions, view, keep=torch.empty(0, dtype=torch.long))
            return None
        r = max(len(x) for x in rows)
        idx = torch.tensor([x + [x[-1]] * (r - len(x)) for x in rows], dtype=torch.long, device=device)   # (B', R)
        logits, h = self.model.forward_logits(ids, positions, view, idx, vocab)   # (B', R, V or N), (B', R, C)
        return (logits, h) if states else logits

    @staticmethod
    def pieces(parts: list[tuple[int, int, list[int]]], width: int) -> list[tuple[int, int, list[int]]]:
        """Prefill parts (slot, start, tokens) cut into pieces of at most `width` tokens, each with its
        own start: one pass can then hold several prompts' chunks (and decode rows) as rows of equal
        width instead of padding every row to the longest chunk. A piece's rows see the pieces before
        it through the cache (a pass writes every row's keys and values before any row attends), so
        a row computes exactly what it would in a pass of its own."""
        return [(slot, start + at, tokens[at: at + width]) for slot, start, tokens in parts
                for at in range(0, len(tokens), width)]

    @staticmethod
    def piece_width(lengths: list[int], exact: int, least: int = 1) -> int:
        """The widest piece width (least … min(exact, PIECE_ROWS)) that pads chunks of these lengths by at most
        PIECE_WASTE of their rows, else the one that pads fewest. Wide pieces run faster per row
        (one prompt of ~100 tokens, 1.5B on Zen 4: 5.7 ms per row in pieces of 65, 6.7 in pieces of
        2), but a pass pads every piece to its widest, and the padding is computed too."""
        exact = max(min(exact, PIECE_ROWS), least)
        longest = max(max(lengths), least)
        balanced = [-(-n // -(-n // exact)) for n in lengths]       # a chunk in equal pieces of ≤ exact
        fixed = [w for w in (1, 2, 4, 8, 16, 32, 48) if w < exact]
        widths = sorted({min(max(w, least), longest) for w in (*fixed, exact, *balanced)}, reverse=True)
        rows = sum(lengths)
        padded = {w: sum(-(-n // w) for n in lengths) * w for w in widths}
        return next((w for w in widths if padded[w] <= rows * (1 + PIECE_WASTE)), min(widths, key=padded.get))

    def prefill(self, parts: list[tuple[int, int, list[int]]]) -> None:
        """Write each part's tokens at its start and move the lengths past them: with a row-exact pass,
        every part in one pass, cut into pieces as wide as that pass allows; else as `feed` does."""
        parts = [p for p in parts if p[2]]
        if not parts:
            return
        exact = self.model.exact_pass_rows(self.cache.store)
        if exact is None:
            for slot, start, _ in parts:
                self.cache.set_length(slot, start)
            self.feed([p[0] for p in parts], [p[2] for p in parts])
            return
        cut = self.pieces(parts, self.piece_width([len(p[2]) for p in parts], exact))
        self.forward([p[0] for p in cut], [p[2] for p in cut], rows=None, starts=[p[1] for p in cut])
        for slot, start, tokens in parts:
            self.cache.set_length(slot, start + len(tokens))

    def extend(self, slots: list[int], token_lists: list[list[int]], chunk: int = 512) -> None:
        """Catch up: write token_lists[b][length(slot_b):-1], whatever each slot has not cached yet, in
        chunks so a long prompt never materialises one huge activation.
        Short catch-ups share a pass; longer ones run one sequence per pass (SHARED_PASS_MAX)."""
        todo = [(s, toks[self.length(s):-1]) for s, toks in zip(slots, token_lists)]
        offset = 0
        while True:
            part = [(s, toks[offset: offset + chunk]) for s, toks in todo if len(toks) > offset]
            if not part:
                break
            self.feed([s for s, _ in part], [c for _, c in part])
            offset += chunk

    def feed(self, slots: list[int], chunks: list[list[int]]) -> None:
        """Write chunks[b] at positions length(slot_b) … and move the lengths past them. Short chunks
        share a pass; longer ones run one sequence per pass (SHARED_PASS_MAX), each in passes the model
        computes row-exactly (`exact_pass_rows`): a position's keys and values are then the same bits
        whichever way its prompt was split — prefilled whole, after a prefix-cache hit, or in chunks."""
        part = [(s, c) for s, c in zip(slots, chunks) if c]
        if not part:
            return
        shared = max(len(c) for _, c in part) <= SHARED_PASS_MAX
        exact = self.model.exact_pass_rows(self.cache.store)
        for group in [part] if shared else [[p] for p in part]:
            step = min(exact, PIECE_ROWS) if exact else max(len(c) for _, c in group)
            for at in range(0, max(len(c) for _, c in group), step):
                pieces = [(s, c[at: at + step]) for s, c in group if len(c) > at]
                self.forward([s for s, _ in pieces], [c for _, c in pieces], rows=None)
                for s, c in pieces:
                    self.cache.set_length(s, self.cache.lengths[s] + len(c))
