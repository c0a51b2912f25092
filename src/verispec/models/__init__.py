from verispec.models.kv_cache import CacheView, KVCache
from verispec.models.transformer import Transformer

__all__ = ["CacheView", "KVCache", "Transformer"]
