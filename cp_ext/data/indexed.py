"""Megatron indexed datasets (PREFIX.bin + PREFIX.idx) on disk: writing and checking them.

Writing goes through megatron.core's `IndexedDatasetBuilder` (one document per
`add_document`), reading through its `IndexedDataset`; this module adds only what a
user needs when a file is wrong: a check that names the file and the fix, before any
training starts.
"""

import os

import numpy as np
from megatron.core.datasets.indexed_dataset import DType, IndexedDataset, IndexedDatasetBuilder

# Token ids are checked over this many documents per file: enough to catch a dataset
# made with another tokenizer, cheap for a corpus of any size.
CHECK_DOCUMENTS = 1000


def write_indexed_dataset(prefix: str, documents, vocab_size: int) -> int:
    """Write `documents` (iterable of int arrays) as PREFIX.bin/.idx; returns the document count."""
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=DType.optimal_dtype(vocab_size))
    count = 0
    for doc in documents:
        doc = np.asarray(doc)
        if doc.size:
            builder.add_document(doc, [doc.size])
            count += 1
    builder.finalize(prefix + ".idx")
    return count


def indexed_dataset_problems(prefix: str, vocab_size: int = None, flag: str = "--data-path") -> list:
    """What is wrong with PREFIX.bin/.idx (missing, corrupt, ids >= vocab_size), as messages."""
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
        n = min(len(lengths), CHECK_DOCUMENTS)
        top = max(int(data[i].max()) for i in range(n) if lengths[i])
        if top >= vocab_size:
            return [f"{flag} {prefix}: {bin_path} holds token id {top} (first {n} documents) but the model's "
                    f"vocab is {vocab_size}; preprocess with the same --tokenizer-type/--tokenizer-model, "
                    f"or raise --vocab-size above {top}"]
    return []
