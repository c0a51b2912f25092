"""Quality of each weight format against fp32 on a fixed text: top-1 agreement and mean KL(fp32 ‖ format)
of next-token distributions at every position. Run: python docs/weight_quality.py"""

import torch

from verispec.loaders.resolve import load_model
from verispec.models import KVCache

TEXT = '''def merge_intervals(intervals):
    """Merge overlapping intervals and return them sorted by start."""
    if not intervals:
        return []
    intervals = sorted(intervals, key=lambda pair: pair[0])
    merged = [list(intervals[0])]
    for start, end in intervals[1:]:
        if start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged

Speculative decoding lets a small model propose tokens that a large model verifies in one pass.
The output distribution is exactly the large model's, because rejected proposals are resampled
from the residual distribution max(0, p - q), normalised.'''


def all_logits(model, ids):
    t = ids.shape[1]
    cache = KVCache.for_model(model.config, 1, t, model.dtype)
    pos = torch.arange(t)[None]
    return model.logits(model(ids, pos, cache.view([0], pos)), pos)[0]          # (T, V)


for name in ["qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"]:
    ref = load_model(name, dtype="float32")
    ids = torch.tensor([ref.tokenizer.encode(TEXT)])
    base = torch.log_softmax(all_logits(ref.model, ids), -1)
    del ref
    for fmt in ["bfloat16", "int8"]:
        other = torch.log_softmax(all_logits(load_model(name, dtype=fmt).model, ids).float(), -1)
        agree = (base.argmax(-1) == other.argmax(-1)).float().mean().item()
        kl = (base.exp() * (base - other)).sum(-1).mean().item()
        print(f"| {name} | {fmt} | {ids.shape[1]} | {agree:.3f} | {kl:.4f} |", flush=True)
