"""Megatron indexed datasets (PREFIX.bin + PREFIX.idx) on disk: writing and checking them.

Writing goes through megatron.core's `IndexedDatasetBuilder` (one document per
`add_document`), reading through its `IndexedDataset`; this module adds only what a
user needs when a file is wrong: a check that names the file and the fix, before any
training starts, and a writer that never leaves a half-written pair under PREFIX.

The token-id check covers every token of the .bin (a chunked numpy max over the
memory-mapped file, ~GB/s); its result is cached in PREFIX.maxid.json, keyed by the
size and mtime of the .bin and .idx, so each file is scanned once.
"""

import json
import os
import secrets

import numpy as np
from megatron.core.datasets.indexed_dataset import DType, IndexedDataset, IndexedDatasetBuilder

# Tokens per memory-mapped chunk of the id scan: bounds the resident memory (64 MiB of uint16).
SCAN_CHUNK_TOKENS = 1 << 25
CACHE_SUFFIX = ".maxid.json"


def _temp_path(path: str) -> str:
    """A fresh hidden name beside `path` (same directory, so os.replace onto `path` is atomic)."""
    directory, name = os.path.split(os.path.abspath(path))
    return os.path.join(directory, f".{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")


class IndexedDatasetWriter:
    """IndexedDatasetBuilder into temporary files beside PREFIX.bin/.idx.

    `add(ids)` appends one document (empty ones are skipped), `finalize()` completes and
    syncs both temporary files, `commit()` renames them onto PREFIX.bin then PREFIX.idx
    (a reader never pairs a new .idx with an old .bin), `discard()` removes them. Until
    `commit()`, an existing PREFIX.bin/.idx is untouched."""

    def __init__(self, prefix: str, dtype):
        self.prefix, self.documents, self.tokens = prefix, 0, 0
        os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
        self.tmp_bin, self.tmp_idx = _temp_path(prefix + ".bin"), _temp_path(prefix + ".idx")
        self._builder = IndexedDatasetBuilder(self.tmp_bin, dtype=dtype)

    def add(self, ids) -> None:
        ids = np.asarray(ids)
        if ids.size:
            self._builder.add_document(ids, [ids.size])
            self.documents += 1
            self.tokens += int(ids.size)

    def finalize(self) -> None:
        self._builder.finalize(self.tmp_idx)  # closes the .bin, writes the .idx
        for path in (self.tmp_bin, self.tmp_idx):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)  # the data is on disk before the rename makes it visible
            finally:
                os.close(fd)

    def commit(self) -> None:
        os.replace(self.tmp_bin, self.prefix + ".bin")
        os.replace(self.tmp_idx, self.prefix + ".idx")
        try:  # the cache is keyed by size and mtime anyway; a coarse-mtime filesystem could miss a rewrite
            os.remove(self.prefix + CACHE_SUFFIX)
        except OSError:
            pass

    def discard(self) -> None:
        try:
            self._builder.data_file.close()
        except Exception:
            pass
        for path in (self.tmp_bin, self.tmp_idx):
            try:
                os.remove(path)
            except OSError:
                pass


def write_indexed_dataset(prefix: str, documents, vocab_size: int) -> int:
    """Write `documents` (iterable of int arrays) as PREFIX.bin/.idx; returns the document count."""
    writer = IndexedDatasetWriter(prefix, DType.optimal_dtype(vocab_size))
    try:
        for doc in documents:
            writer.add(doc)
        writer.finalize()
        writer.commit()
    except BaseException:
        writer.discard()
        raise
    return writer.documents


def _file_key(bin_path: str, idx_path: str) -> dict:
    b, i = os.stat(bin_path), os.stat(idx_path)
    return {"bin_size": b.st_size, "bin_mtime_ns": b.st_mtime_ns, "idx_size": i.st_size, "idx_mtime_ns": i.st_mtime_ns}


def _scan_ids(bin_path: str, dtype, start: int, stop: int) -> tuple:
    """(min, max) token id of bytes [start, stop) of `bin_path`: a numpy min/max per chunk.

    Each chunk is its own read-only memmap, unmapped before the next, so the process never holds
    more than one chunk of the file resident however large the file is (uint8..int64 alike)."""
    dtype = np.dtype(dtype)
    count = (stop - start) // dtype.itemsize
    if count <= 0:
        return None, None
    signed = dtype.kind != "u"
    lo, hi = None, None
    for begin in range(0, count, SCAN_CHUNK_TOKENS):
        n = min(SCAN_CHUNK_TOKENS, count - begin)
        chunk = np.memmap(bin_path, dtype=dtype, mode="r", offset=start + begin * dtype.itemsize, shape=(n,))
        top = chunk.max()
        hi = top if hi is None else max(hi, top)
        if signed:
            bottom = chunk.min()
            lo = bottom if lo is None else min(lo, bottom)
        del chunk  # unmaps it
    return (int(lo) if signed else 0), int(hi)


def token_id_range(prefix: str, dtype=None, start: int = 0, stop: int = None, cache: bool = True) -> tuple:
    """(min, max) token id over all of PREFIX.bin, from PREFIX.maxid.json when it matches the files.

    A miss scans the file and rewrites the cache atomically; a read-only directory skips caching."""
    bin_path, idx_path, cache_path = prefix + ".bin", prefix + ".idx", prefix + CACHE_SUFFIX
    key = _file_key(bin_path, idx_path)  # before the scan: a file changed meanwhile is re-checked next time
    if cache:
        try:
            with open(cache_path) as f:
                cached = json.load(f)
            if all(cached.get(k) == v for k, v in key.items()):
                return cached["min"], cached["max"]
        except (OSError, ValueError, KeyError, AttributeError, TypeError):
            pass
    if dtype is None:
        dtype = IndexedDataset(prefix, mmap=True).index.dtype
    stop = key["bin_size"] if stop is None else stop
    lo, hi = _scan_ids(bin_path, dtype, start, stop)
    if cache:
        tmp = _temp_path(cache_path)
        try:
            with open(tmp, "x") as f:
                json.dump({**key, "dtype": np.dtype(dtype).name, "min": lo, "max": hi}, f)
            os.replace(tmp, cache_path)
        except OSError:  # read-only dataset directory: check again next time
            try:
                os.remove(tmp)
            except OSError:
                pass
    return lo, hi


def indexed_dataset_problems(prefix: str, vocab_size: int = None, flag: str = "--data-path",
                             vocab_from: str = None) -> list:
    """What is wrong with PREFIX.bin/.idx (missing, corrupt, ids >= vocab_size), as messages.

    `vocab_from` names where vocab_size came from (e.g. "--tokenizer-type ByteTokenizer")."""
    bin_path, idx_path = prefix + ".bin", prefix + ".idx"
    missing = [p for p in (bin_path, idx_path) if not os.path.isfile(p)]
    if missing:
        return [f"{flag} {prefix}: {' and '.join(missing)} not found; give the prefix that "
                f"tools/preprocess_data.py wrote (--output-prefix P makes P_text_document.bin/.idx)"]
    try:
        data = IndexedDataset(prefix, mmap=True)
        lengths, pointers = data.sequence_lengths, data.index.sequence_pointers
        itemsize = DType.size(data.index.dtype)
        expected = int(pointers[-1]) + int(lengths[-1]) * itemsize if len(lengths) else 0
        if data.document_indices[-1] != len(lengths) or len(pointers) != len(lengths):
            raise ValueError("document and sequence counts disagree")
    except Exception as e:  # megatron asserts / numpy errors on a truncated or foreign file
        return [f"{flag} {prefix}: {idx_path} is corrupt or not a Megatron index ({type(e).__name__}: {e}); "
                f"re-run tools/preprocess_data.py"]
    size = os.path.getsize(bin_path)
    if size != expected:
        return [f"{flag} {prefix}: {bin_path} has {size} bytes but {idx_path} describes {expected}; "
                f"the pair is truncated or mismatched, re-run tools/preprocess_data.py"]
    if vocab_size is not None and len(lengths):
        lo, top = token_id_range(prefix, data.index.dtype, int(pointers[0]), expected)
        if top is None:
            return []
        source = f" ({vocab_from})" if vocab_from else ""
        fix = ("re-run tools/preprocess_data.py with the tokenizer you train with, or give the "
               "--tokenizer-type/--tokenizer-model the data was preprocessed with")
        tokens = (expected - int(pointers[0])) // itemsize
        if top >= vocab_size:
            return [f"{flag} {prefix}: {bin_path} holds token id {top} (the largest of its {tokens} tokens) but "
                    f"the model's vocab is {vocab_size}{source}, ids 0..{vocab_size - 1}; the data was tokenized "
                    f"with a larger vocabulary: {fix}, or raise --vocab-size above {top}"]
        if lo < 0:
            return [f"{flag} {prefix}: {bin_path} holds token id {lo}; ids must be >= 0: {fix}"]
    return []
