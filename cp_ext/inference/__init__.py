"""Generation with context parallelism: CP prefill and decode on a CP-sharded KV cache."""

from cp_ext.inference.generate import Generation, Generator, Sampling, prefill_length
from cp_ext.inference.kv_cache import ShardedKVCache, decode_bytes_per_token_layer

__all__ = ["Generation", "Generator", "Sampling", "ShardedKVCache", "decode_bytes_per_token_layer",
           "prefill_length"]
