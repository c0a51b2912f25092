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

import signal
import subprocess
import sys
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
    build: str = ""                # the package and version, for results files

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
    build = hf_build()
    return [HFPeer(k, model, assistant, stop_ids, build=build) for k in kinds]


def hf_build() -> str:
    """'transformers <version>', for results files."""
    import transformers

    return f"transformers {transformers.__version__}"


LLAMACPP_MODES = ("plain", "lookup")


@dataclass
class LlamaCppPeer:
    """One llama.cpp mode (one `llama_cpp.Llama`; the GGUF is memory-mapped, so two share pages)."""

    kind: str                      # plain | lookup
    llm: object
    stop_ids: list[int]
    proposer: str = "peer"
    k: int | str = 0
    build: str = ""                # the package, version and CPU features llama.cpp was built with

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


def system_info_features(info: str) -> list[str]:
    """The features llama.cpp's system info reports on ('CPU : SSE3 = 1 | AVX512 = 1 | AMX_INT8 = 0 | …' ->
    ['SSE3', 'AVX512']), as llama_print_system_info() and its programs' 'system_info:' line print them."""
    return [part.split("=")[0].strip() for part in info.replace("CPU :", "").split("|") if part.strip().endswith("= 1")]


def llamacpp_build() -> str:
    """'llama-cpp-python <version> (<the CPU features its llama.cpp was built with>)', for results files."""
    import llama_cpp

    info = llama_cpp.llama_print_system_info().decode(errors="replace")
    return f"llama-cpp-python {llama_cpp.__version__} ({' '.join(system_info_features(info)) or info.strip()})"


# A few tokens through the file in a child process: a prompt-sized pass and a one-token step.
_PROBE = ("import sys, llama_cpp\n"
          "m = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=64, n_batch=32, n_threads=int(sys.argv[2]), verbose=False)\n"
          "ids = m.tokenize(b'def add(a, b):\\n    return a + b\\n')\n"
          "m.eval(ids[:-1]); m.eval(ids[-1:])\n")


def probe_llamacpp(path: Path, threads: int) -> None:
    """Runs llama.cpp on the file once in a child process, so that a build which crashes on this CPU ends
    in an error that names the signal and the way out, not in the death of the bench that loaded it (seen:
    llama.cpp's AMX matmul on an AMX Xeon, ggml-org/llama.cpp#20824)."""
    try:
        r = subprocess.run([sys.executable, "-c", _PROBE, str(path), str(threads)], capture_output=True, text=True,
                           timeout=600)
    except subprocess.TimeoutExpired:
        raise VerispecError(f"llama.cpp did not get through the first tokens of {path.name} in 10 minutes") from None
    if r.returncode < 0:
        build = llamacpp_build()
        way_out = ("its AMX matmul is the known cause (ggml-org/llama.cpp#20824): rebuild it without AMX, e.g. "
                   "CMAKE_ARGS='-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON "
                   "-DGGML_BMI2=ON -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON' pip install "
                   "--force-reinstall --no-deps --no-binary llama-cpp-python llama-cpp-python==0.3.36"
                   if "AMX_INT8" in build else "rebuild it for this CPU, or report it to llama.cpp")
        raise VerispecError(f"llama.cpp ({build}) died with {signal.Signals(-r.returncode).name} on its first "
                            f"tokens of {path.name} on this CPU; {way_out}")
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["no message"])[-1]
        raise VerispecError(f"llama.cpp could not run {path.name}: {last}")


def llamacpp_peers(target: LoadedModel, stop_ids: list[int], context: int, threads: int) -> list[LlamaCppPeer]:
    """context: the longest prompt plus max_tokens (lookup keeps logits for every position). The file is
    first run in a child process (`probe_llamacpp`)."""
    src = Path(target.source)
    if src.suffix != ".gguf":
        raise VerispecError(f"--peer llamacpp reads GGUF files only; {src} is not one")
    try:
        import llama_cpp
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    except ImportError:
        raise VerispecError("--peer llamacpp needs llama-cpp-python: pip install 'verispec[llamacpp]' "
                            "(it compiles llama.cpp once, about 10 minutes on 2 cores)") from None
    probe_llamacpp(src, threads)
    common = dict(model_path=str(src), n_ctx=context, n_batch=min(context, 512), n_threads=threads,
                  n_threads_batch=threads, verbose=False)
    build = llamacpp_build()
    return [LlamaCppPeer("plain", llama_cpp.Llama(**common), stop_ids, build=build),
            LlamaCppPeer("lookup", llama_cpp.Llama(**common, draft_model=LlamaPromptLookupDecoding(num_pred_tokens=LOOKUP_TOKENS)),
                         stop_ids, build=build)]
