"""One request's state: its tokens, its generator, and the exact place generation stops.

Invariant shared with the runners: a model's cache holds `tokens[:-1]`; the last token is
*pending* and is the first input of the next round's verify pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from verispec.engine.metrics import SpecMetrics
from verispec.engine.params import SamplingParams
from verispec.loaders.tokenizer import IncrementalDecoder, TextTokenizer


@dataclass
class Sequence:
    index: int                      # position in the caller's output list
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    slot: int
    stop_ids: frozenset[int]
    tokenizer: TextTokenizer | None
    metrics: SpecMetrics
    tokens: list[int] = field(init=False)
    finish_reason: str | None = None
    text: str = ""                  # generated text so far (truncated at a stop string)
    streamed: int = 0               # characters of `text` already handed to a stream
    # The target's final-normed states at the last settled positions, oldest first, (m, C): row i
    # scored tokens[-m + i]. What drafting heads read: kept by the round when the proposer asks for
    # them (m ≤ Proposer.state_window); None before the first round.
    recent_states: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.tokens = list(self.prompt_ids)
        self._decoder = IncrementalDecoder(self.tokenizer) if self.tokenizer else None
        self._hold = max((len(s) for s in self.params.stop), default=1) - 1

    @property
    def pending_state(self) -> torch.Tensor | None:
        """The target's state at the row that scored the pending token, (C,)."""
        return None if self.recent_states is None else self.recent_states[-1]

    @property
    def generated(self) -> list[int]:
        return self.tokens[len(self.prompt_ids):]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, token: int) -> bool:
        """Add one generated token, exactly as plain decoding would. Returns True when finished."""
        if token in self.stop_ids:
            self.finish_reason = "stop"          # the stop token itself is not part of the output
        else:
            self.tokens.append(token)
            if self._decoder is not None:
                self.text += self._decoder.push([token])
                self._check_stop_strings()
        if not self.finished and len(self.generated) >= self.params.max_tokens:
            self.finish_reason = "length"
        if self.finished and self._decoder is not None and self.finish_reason == "length":
            self.text += self._decoder.flush()
            self._check_stop_strings()
        return self.finished

    def _check_stop_strings(self) -> None:
        """Cut the text at the earliest stop string, which the last token may have completed."""
        cuts = [i for i in (self.text.find(s) for s in self.params.stop) if i != -1]
        if cuts:
            self.text = self.text[:min(cuts)]
            self.finish_reason = "stop"

    def take_stream_delta(self) -> str:
        """Text not yet streamed, holding back a tail that could still become a stop string."""
        safe = len(self.text) if self.finished else max(self.streamed, len(self.text) - self._hold)
        delta = self.text[self.streamed:safe]
        self.streamed = safe
        return delta
