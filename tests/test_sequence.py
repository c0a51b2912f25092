"""Where generation stops, token by token, and what a stream may show before it stops."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models

from verispec.engine.metrics import SpecMetrics
from verispec.engine.params import SamplingParams
from verispec.engine.sequence import Sequence
from verispec.loaders.tokenizer import TextTokenizer

VOCAB = {"<s>": 0, "ab": 1, "cd": 2, "ef": 3, "<eos>": 4, "x": 5}


def make_seq(**params) -> Sequence:
    tok = Tokenizer(models.WordLevel(VOCAB, unk_token="x"))
    tok.decoder = decoders.Fuse()
    text_tok = TextTokenizer(tok, stop_token_ids=[4])
    return Sequence(0, [0], SamplingParams(**params), None, 0, frozenset([4]), text_tok, SpecMetrics("none", 0))


def test_stop_string_spanning_tokens_cuts_text_and_finishes():
    seq = make_seq(stop=["bcd"], max_tokens=10)
    assert not seq.append(1)            # "ab"
    assert seq.append(2)                # "abcd" contains "bcd" -> cut to "a"
    assert seq.text == "a" and seq.finish_reason == "stop"


def test_stream_holds_back_a_possible_stop_prefix():
    seq = make_seq(stop=["cdX"], max_tokens=10)
    seq.append(1)
    seq.append(2)                        # "abcd": "cd" might start "cdX"
    assert seq.take_stream_delta() == "ab"
    seq.append(3)                        # "abcdef": no stop string after all
    assert seq.take_stream_delta() == "cd"
    seq.append(4)                        # eos
    assert seq.finish_reason == "stop" and seq.take_stream_delta() == "ef"
    assert seq.generated == [1, 2, 3]   # the stop token itself is not output


def test_max_tokens_finishes_with_length():
    seq = make_seq(max_tokens=2)
    assert not seq.append(1)
    assert seq.append(3)
    assert seq.finish_reason == "length" and seq.text == "abef"
