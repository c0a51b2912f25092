"""verispec: lossless speculative decoding for local LLMs."""

from verispec.engine.llm import LLM, RequestOutput
from verispec.engine.params import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
