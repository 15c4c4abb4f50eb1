"""DeepSeek-V4's attention (sliding window, HCA, CSA with its lightning indexer) under every CP layout.

``context_parallel.py`` is the entry point (`compressed_attention`); ``plan.py`` who holds and needs
what, ``exchange.py`` what crosses ranks, ``compressor.py`` the entries, ``selection.py`` CSA's top-k,
``attention.py`` the one softmax.
"""

from cp_ext.attention.compressed.compressor import Compressor, interleaved_rope, rms_norm
from cp_ext.attention.compressed.context_parallel import CompressedAttentionSpec, Indexer, compressed_attention

__all__ = ["Compressor", "CompressedAttentionSpec", "Indexer", "compressed_attention", "interleaved_rope", "rms_norm"]
