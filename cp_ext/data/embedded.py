"""The embedded default corpus: real text that every machine already has, no download.

It is the source code of the running Python's standard library, read in a fixed
order and tokenized as bytes. Enough for a small model's loss to fall visibly, and
identical on every rank and every machine with the same Python version.
"""

import os
import sysconfig
from functools import lru_cache

import numpy as np

BYTE_VOCAB_SIZE = 256


@lru_cache(maxsize=2)
def stdlib_corpus(max_bytes: int = 8 << 20) -> np.ndarray:
    """Up to `max_bytes` bytes of stdlib `.py` sources, sorted by path, as uint8 tokens."""
    root = sysconfig.get_paths()["stdlib"]
    chunks, total = [], 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__", "test", "tests"))
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            with open(os.path.join(dirpath, name), "rb") as f:
                data = f.read()
            chunks.append(data)
            total += len(data)
            if total >= max_bytes:
                return np.frombuffer(b"".join(chunks)[:max_bytes], dtype=np.uint8)
    return np.frombuffer(b"".join(chunks), dtype=np.uint8)


class EmbeddedTextDataset:
    """Non-overlapping windows of seq_length + 1 byte tokens; sample i is always the same window."""

    vocab_size = BYTE_VOCAB_SIZE

    def __init__(self, seq_length: int, max_bytes: int = 8 << 20):
        self.tokens = stdlib_corpus(max_bytes)
        self.seq_length = seq_length
        self.num_samples = (len(self.tokens) - 1) // seq_length
        if self.num_samples < 1:
            raise ValueError(f"--seq-length {seq_length} is longer than the embedded corpus ({len(self.tokens)} bytes)")

    def __len__(self):
        return self.num_samples

    def __getitem__(self, index: int) -> np.ndarray:
        start = (index % self.num_samples) * self.seq_length
        return self.tokens[start : start + self.seq_length + 1].astype(np.int64)
