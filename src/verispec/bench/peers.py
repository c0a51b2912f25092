"""Peers measured in the same bench run, on the same weights and prompts.

`hf`: Hugging Face transformers `generate()` in three modes, as users run them: plain greedy/sampled
`generate`, assisted generation with the draft as `assistant_model`, and prompt lookup
(`prompt_lookup_num_tokens`). transformers loads the same GGUF file (dequantized to float32: its own
CPU default), so compare it with verispec's float32 modes for the engine, and with the default int8
for what a user gets.

`llamacpp`: llama.cpp through the llama-cpp-python package, on the GGUF file itself (its own
quantized kernels, same thread count): plain decoding and its prompt-lookup mode
(`LlamaPromptLookupDecoding`, the only speculative mode the Python package offers). llama.cpp's
sampling chain differs from ours, so only greedy outputs are compared token for token — and even
those may differ, as it computes with the file's 4/6-bit blocks and 8-bit activations.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from verispec.errors import VerispecError
from verispec.engine.loading import LoadedModel

HF_MODES = ("plain", "assisted", "lookup")
LOOKUP_TOKENS = 10          # transformers' documented example value


def _load_hf(model: LoadedModel):
    try:
        import transformers
    except ImportError:
        raise VerispecError("--peer hf needs transformers and accelerate: pip install 'verispec[test]'") from None
    src = Path(model.source)
    if src.suffix == ".gguf":
        return transformers.AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name,
                                                                 dtype=torch.float32).eval()
    return transformers.AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()


@dataclass
class HFPeer:
    """One transformers mode; `generate` mirrors LLM.generate's output for the bench."""

    kind: str                      # plain | assisted | lookup
    model: object
    assistant: object | None
    stop_ids: list[int]
    proposer: str = "peer"
    k: int | str = 0

    @property
    def label(self) -> str:
        return f"hf {self.kind}"

    def generate(self, prompt_ids: list[list[int]], temperature: float, max_tokens: int, seed: int,
                 top_k: int = 0, top_p: float = 1.0) -> list[dict]:
        outs = []
        for ids in prompt_ids:                   # transformers' assisted modes take one prompt at a time
            torch.manual_seed(seed)
            kw = dict(max_new_tokens=max_tokens, eos_token_id=self.stop_ids, pad_token_id=self.stop_ids[0],
                      do_sample=temperature > 0)
            if temperature > 0:
                kw |= dict(temperature=temperature, top_k=top_k, top_p=top_p)
            if self.kind == "assisted":
                kw["assistant_model"] = self.assistant
            elif self.kind == "lookup":
                kw["prompt_lookup_num_tokens"] = LOOKUP_TOKENS
            with torch.inference_mode():
                out = self.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                          **kw)
            new = out[0, len(ids):].tolist()
            cut = next((i for i, t in enumerate(new) if t in self.stop_ids), len(new))
            outs.append({"token_ids": new[:cut], "generated_tokens": cut})
        return outs


def hf_peers(target: LoadedModel, draft: LoadedModel | None, stop_ids: list[int]) -> list[HFPeer]:
    model = _load_hf(target)
    assistant = _load_hf(draft) if draft is not None else None
    kinds = [k for k in HF_MODES if k != "assisted" or assistant is not None]
    return [HFPeer(k, model, assistant, stop_ids) for k in kinds]


LLAMACPP_MODES = ("plain", "lookup")


@dataclass
class LlamaCppPeer:
    """One llama.cpp mode (one `llama_cpp.Llama`; the GGUF is memory-mapped, so two share pages)."""

    kind: str                      # plain | lookup
    llm: object
    stop_ids: list[int]
    proposer: str = "peer"
    k: int | str = 0

    @property
    def label(self) -> str:
        return f"llama.cpp {self.kind}"

    def generate(self, prompt_ids: list[list[int]], temperature: float, max_tokens: int, seed: int,
                 top_k: int = 0, top_p: float = 1.0) -> list[dict]:
        outs = []
        for ids in prompt_ids:
            self.llm.reset()                    # no KV reuse between prompts or repeats
            self.llm.set_seed(seed)
            new: list[int] = []
            for tok in self.llm.generate(ids, temp=temperature, top_k=top_k, top_p=top_p, min_p=0.0, typical_p=1.0,
                                         repeat_penalty=1.0):
                if tok in self.stop_ids:
                    break
                new.append(tok)
                if len(new) >= max_tokens:
                    break
            outs.append({"token_ids": new, "generated_tokens": len(new)})
        return outs


def llamacpp_peers(target: LoadedModel, stop_ids: list[int], context: int, threads: int) -> list[LlamaCppPeer]:
    """context: the longest prompt plus max_tokens (lookup keeps logits for every position)."""
    src = Path(target.source)
    if src.suffix != ".gguf":
        raise VerispecError(f"--peer llamacpp reads GGUF files only; {src} is not one")
    try:
        import llama_cpp
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    except ImportError:
        raise VerispecError("--peer llamacpp needs llama-cpp-python: pip install 'verispec[llamacpp]' "
                            "(it compiles llama.cpp once, about 10 minutes on 2 cores)") from None
    common = dict(model_path=str(src), n_ctx=context, n_batch=min(context, 512), n_threads=threads,
                  n_threads_batch=threads, verbose=False)
    return [LlamaCppPeer("plain", llama_cpp.Llama(**common), stop_ids),
            LlamaCppPeer("lookup", llama_cpp.Llama(**common, draft_model=LlamaPromptLookupDecoding(num_pred_tokens=LOOKUP_TOKENS)),
                         stop_ids)]
