"""Model argument -> loaded model. A model argument is a built-in name, a `.gguf` file, or a directory.

GGUF files are slow to parse and dequantize, so the first load of a GGUF writes a *prepared*
directory to the cache (fp32 `model.safetensors`, `tokenizer.json`, `verispec.json`); later loads
read that directory, which is the same code path as a Hugging Face model directory.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from verispec import kernels
from verispec.cache import atomic_directory, atomic_file, cache_dir, save_tensors
from verispec.config import ModelConfig
from verispec.errors import InvalidModelFile, ModelNotFound, UnsupportedModel, VerispecError
from verispec.huge_pages import drop_page_cache
from verispec.loaders import builtin
from verispec.loaders.checkpoint import check_state, fuse_projections
from verispec.loaders.safetensors_file import read_header, read_safetensors
from verispec.loaders.tokenizer import TextTokenizer
from verispec.models import Transformer
from verispec.models.quant import quantize_linears
from verispec.models.build import build_model, build_quantized, looked_up

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}
# Weight-only formats: the linears are quantized, everything else computes in the paired dtype.
QUANTIZED = {"int8": torch.float32, "int4": torch.float32, "int4-all": torch.float32}
PREPARED_VERSION = 2        # 2: q/k/v and gate/up stored fused (loading then copies nothing)


@dataclass
class LoadedModel:
    name: str
    model: Transformer
    tokenizer: TextTokenizer | None
    source: Path
    load_s: float
    cold: bool          # True when this load had to parse/dequantize a GGUF

    @property
    def config(self) -> ModelConfig:
        return self.model.config


def auto_dtype(dtype: str | torch.dtype, device: str) -> str | torch.dtype:
    """"auto" -> the fastest accurate format measured for the device: int4 on CPU (Q4_K tensors as the
    GGUF stores them, the rest int8: faster than int8 and closer to fp32, docs/PERFORMANCE.md),
    bfloat16 on GPUs. Where the CPU cannot run the native kernels, float32: the torch path would
    keep a float32 copy of every packed layer beside it (the 1.5B's peak RSS 7.5 against 6.2 GiB in
    float32, at the same speed: docs/PERFORMANCE_LOG.md)."""
    if dtype != "auto":
        return dtype
    if str(device) != "cpu":
        return "bfloat16"
    return "int4" if kernels.available() else "float32"


def draft_auto_dtype(dtype: str | torch.dtype, device: str) -> str | torch.dtype:
    """"auto" for a draft model -> int4-all on CPU: every linear 4-bit (a draft step reads ~0.6x the
    bytes of int4's; its weights move acceptance a little, never the output), else as auto_dtype."""
    if dtype == "auto" and str(device) == "cpu" and kernels.available():
        return "int4-all"
    return auto_dtype(dtype, device)


def kv_auto_dtype(model) -> torch.dtype | None:
    """"auto" for the KV cache: bfloat16 where the model runs the native pass (its attention reads bf16
    in place — with `vdpbf16ps` on AVX512_BF16 CPUs — at half the bytes of float32: on the embedded 1.5B
    KL 0.0011 against the float cache, decode after a 1,872-token prompt 1.18x faster, docs/PERFORMANCE.md),
    else the model's own dtype (None): the torch layers would convert a bf16 cache at every layer."""
    return torch.bfloat16 if model.runs_native() else None


def parse_dtype(dtype: str | torch.dtype) -> tuple[torch.dtype, str | None]:
    """-> (compute dtype, weight-only quantization format or None)."""
    if isinstance(dtype, torch.dtype):
        return dtype, None
    if dtype in QUANTIZED:
        return QUANTIZED[dtype], dtype
    try:
        return DTYPES[dtype], None
    except KeyError:
        raise VerispecError(f"unknown dtype {dtype!r}; choose one of {', '.join([*DTYPES, *QUANTIZED])}") from None


def load_model(arg: str | Path, dtype: str | torch.dtype = "auto", device: str = "cpu",
               progress: bool = False) -> LoadedModel:
    """Load a model argument; dtype is a compute dtype, a weight-only format ("int8"), or "auto"."""
    torch_dtype, quant = parse_dtype(auto_dtype(dtype, device))
    start = time.perf_counter()
    name = str(arg)
    if name in builtin.BUILTIN_MODELS:
        path = builtin.ensure_assembled(name, progress=progress)
        key = builtin.BUILTIN_MODELS[name].sha256[:16]
    else:
        path = Path(name).expanduser()
        if not path.exists():
            raise ModelNotFound(f"no model {name!r}: not a file, a directory, or a built-in name "
                                f"({', '.join(builtin.BUILTIN_MODELS)})")
        if path.is_dir():
            model, tok = load_directory(path, torch_dtype, device, quant)
            _check_template(tok, path)
            return LoadedModel(path.name, model, tok, path, time.perf_counter() - start, False)
        stat = path.stat()
        key = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
        name = path.stem
    prepared = cache_dir() / "prepared" / f"{path.stem}-{key}"
    cold = _prepared_version(prepared) != PREPARED_VERSION
    if not cold:
        try:
            model, tok = load_directory(prepared, torch_dtype, device, quant)
        except (VerispecError, OSError, RuntimeError, ValueError) as err:     # a damaged cache: prepare anew
            print(f"verispec: the prepared copy of {path.name} is damaged ({str(err)[:120]}); preparing it again",
                  file=sys.stderr)
            shutil.rmtree(prepared, ignore_errors=True)
            cold = True
    if cold:
        _prepare_gguf(path, prepared, progress)
        model, tok = load_directory(prepared, torch_dtype, device, quant)     # as every later load does
    _check_template(tok, path)
    return LoadedModel(name, model, tok, path, time.perf_counter() - start, cold)


def _check_template(tok, path: Path) -> None:
    """A chat template that does not compile fails the load, not every request that uses it."""
    if tok is not None and tok.chat_template:
        try:
            tok.compiled_template()
        except UnsupportedModel as err:
            raise InvalidModelFile(path, str(err)) from None


QUANT_LAYOUT = 8            # bump when a quantized model's saved layout changes (2: packed int8 blocks,
                            # 3: fused qkv_proj and gate_up_proj, 4: int8 blocks k-pair-major,
                            # 5: int4 in gemm4.c's blocks with fp16 scales, 6: int4 as Q4_K stores it,
                            # 7: int4 token embeddings, 8: Q6_K linears in int6)


def _prepared_version(prepared: Path) -> int | None:
    try:
        return json.loads((prepared / "verispec.json").read_text()).get("version")
    except (OSError, ValueError):
        return None


def _quant_file(quant: str | None) -> str:
    return f"model.{quant}.v{QUANT_LAYOUT}.safetensors"


def _quantize_and_cache(model: Transformer, quant: str, prepared: Path | None, gguf: Path | None = None) -> None:
    """Quantize in place; in a prepared directory, keep the result so later loads skip the work. int4
    reads its 4- and 6-bit weights from the GGUF the model came from (without one, every linear is int8;
    int4-all rounds every linear instead)."""
    fields = None
    if quant in ("int4", "int4-all") and gguf is not None:
        if gguf.is_file():
            from verispec.loaders.gguf_blocks import block_fields, q4k_fields
            fields = block_fields(gguf) if quant == "int4" else q4k_fields(gguf)
        elif quant == "int4":
            print(f"verispec: int4 takes its 4-bit weights from the model's GGUF, and {gguf} is gone: "
                  "every linear is int8", file=sys.stderr)
    quantize_linears(model, quant, fields=fields)
    if prepared is not None and (prepared / "verispec.json").is_file():
        target = prepared / _quant_file(quant)
        with atomic_file(target) as tmp:
            save_tensors({k: v.contiguous() for k, v in model.state_dict().items()}, tmp)
        drop_page_cache(target)                 # so that loads map it in 2 MiB pages (huge_pages.py)
        for stale in prepared.glob(f"model.{quant}.*safetensors"):     # caches in an older layout
            if stale != target:
                stale.unlink(missing_ok=True)


def _prepare_gguf(path: Path, prepared: Path, progress: bool) -> None:
    """Parse and dequantize the GGUF once and write its prepared directory (float32 weights, tokenizer,
    config), which this load and every later one then read."""
    from verispec.loaders.gguf_loader import load_gguf, open_reader
    from verispec.loaders.tokenizer import tokenizer_from_gguf

    def report(i: int, n: int) -> None:
        if progress and (i == n or i % max(1, n // 20) == 0):
            print(f"\rpreparing {path.name} (first load only): {100 * i // n}%", end="" if i < n else "\n",
                  file=sys.stderr, flush=True)

    cfg, state = load_gguf(path, torch.float32, on_tensor=report)
    check_state(cfg, state, path)
    fuse_projections(state)                     # stored fused, so a warm load copies nothing
    tok, info = tokenizer_from_gguf(open_reader(path), path, cfg.vocab_size)
    with atomic_directory(prepared) as tmp:
        save_tensors({k: v for k, v in state.items() if not (cfg.tie_word_embeddings and k == "lm_head.weight")},
                      tmp / "model.safetensors")
        if tok is not None:
            tok.save(str(tmp / "tokenizer.json"))
        meta = {"version": PREPARED_VERSION, "source": str(path), "config": asdict(cfg), "tokenizer": info}
        (tmp / "verispec.json").write_text(json.dumps(meta, indent=1))
    drop_page_cache(prepared / "model.safetensors")


def load_directory(directory: Path, dtype: torch.dtype, device: str,
                   quant: str | None = None) -> tuple[Transformer, TextTokenizer | None]:
    """A prepared directory (verispec.json) or a Hugging Face directory (config.json + safetensors).
    With `quant`, a prepared directory's cached quantized weights are used when present."""
    meta_path, hf_config = directory / "verispec.json", directory / "config.json"
    if meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        cfg, info = ModelConfig(**meta["config"]), meta.get("tokenizer", {})
    elif hf_config.is_file():
        try:
            cfg = ModelConfig.from_hf_dict(json.loads(hf_config.read_text()))
        except (KeyError, ValueError) as exc:
            raise InvalidModelFile(hf_config, f"bad config ({type(exc).__name__}: {exc})") from None
        info = _hf_tokenizer_info(directory, json.loads(hf_config.read_text()))
    else:
        raise ModelNotFound(f"{directory} is not a model directory (no config.json)")
    tok_file = directory / "tokenizer.json"
    tok = TextTokenizer.from_files(tok_file, info) if tok_file.is_file() else None
    cached = directory / _quant_file(quant)
    if quant is None or not (meta_path.is_file() and cached.is_file()):
        files = [f for f in sorted(directory.glob("*.safetensors"))
                 if not f.name.startswith(tuple(f"model.{q}." for q in QUANTIZED))]     # any layout's quant cache
        if not files:
            raise InvalidModelFile(directory, "no *.safetensors weight files")
        model = build_model(cfg, _read_safetensors(files, cfg, quantized=False), dtype, device, directory)
        if quant is None:
            return model, tok
        source = Path(meta["source"]) if meta_path.is_file() and meta.get("source") else None
        _quantize_and_cache(model, quant, directory if meta_path.is_file() else None, source)
        if not (meta_path.is_file() and cached.is_file()):
            return model, tok                   # nowhere to keep it: the weights stay where quantizing left them
        del model                               # read back what was kept, as every later load does
    return build_quantized(cfg, _read_safetensors([cached], cfg, quantized=True), quant, device, directory), tok


def _read_safetensors(files: list[Path], cfg: ModelConfig, quantized: bool) -> dict[str, torch.Tensor]:
    """The files' tensors, in 2 MiB pages where the machine allows (loaders/safetensors_file.py), but for
    the token embedding's, which stay where a lookup reads them on first touch."""
    state: dict[str, torch.Tensor] = {}
    names: list[str] = []
    for f in files:
        try:
            names += read_header(f)[1]
        except OSError as exc:
            raise InvalidModelFile(f, f"cannot read safetensors ({exc})") from None
    by_rows = looked_up(names, cfg, quantized)
    for f in files:
        try:
            state.update(read_safetensors(f, by_rows))
        except InvalidModelFile:
            raise
        except Exception as exc:
            raise InvalidModelFile(f, f"cannot read safetensors ({exc})") from None
    return state


def _hf_tokenizer_info(directory: Path, config: dict) -> dict:
    info: dict = {"eos_token_id": config.get("eos_token_id"), "bos_token_id": config.get("bos_token_id")}
    tc = directory / "tokenizer_config.json"
    if tc.is_file():
        data = json.loads(tc.read_text())
        info["chat_template"] = data.get("chat_template")
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        info["chat_template"] = jinja.read_text()
    gen = directory / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        info["stop_token_ids"] = eos if isinstance(eos, list) else ([eos] if eos is not None else [])
    return info
