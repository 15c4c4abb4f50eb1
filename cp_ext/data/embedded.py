"""The embedded default corpus: real text every machine already has, built once into a cache.

The Python standard library's own sources (with their docstrings, and `pydoc_data`'s
documentation topics), one document per file in sorted path order, byte-tokenized with
an EOD after each file and written as a Megatron indexed dataset::

    <cache>/embedded/stdlib-py3.11-<hash>/text_document.bin/.idx    (cache: --data-cache-path
                                                                     or ~/.cache/cp_ext)

Race-free: the dataset is written into a private temporary directory and renamed into
place in one step, so any number of ranks or jobs may start at once; in a distributed
run rank 0 builds and the others wait on a barrier.
"""

import hashlib
import os
import shutil
import sys
import sysconfig
import tempfile

import numpy as np

from cp_ext.data.indexed import write_indexed_dataset
from cp_ext.data.tokenizers import ByteTokenizer

MAX_BYTES = 8 << 20
_SKIP_DIRS = ("site-packages", "dist-packages", "__pycache__", "test", "tests", "idlelib")


def default_cache_dir():
    return os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "cp_ext")


def stdlib_files(max_bytes: int = MAX_BYTES):
    """pydoc_data's documentation topics, then sorted stdlib .py files, up to about `max_bytes`."""
    root = sysconfig.get_paths()["stdlib"]
    docs = os.path.join(root, "pydoc_data", "topics.py")
    files = [docs] if os.path.isfile(docs) else []
    total = sum(map(os.path.getsize, files))
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for name in sorted(filenames):
            path = os.path.join(dirpath, name)
            if name.endswith(".py") and path not in files:
                files.append(path)
                total += os.path.getsize(path)
                if total >= max_bytes:
                    return files
    return files


def embedded_prefix(cache_dir: str = None, max_bytes: int = MAX_BYTES) -> str:
    """The PREFIX of the embedded dataset, building it first if it is not cached yet (collective)."""
    import torch.distributed as dist

    files = stdlib_files(max_bytes)
    tag = hashlib.md5("\n".join(f"{f}:{os.path.getsize(f)}" for f in files).encode()).hexdigest()[:10]
    parent = os.path.join(cache_dir or default_cache_dir(), "embedded")
    final = os.path.join(parent, f"stdlib-py{sys.version_info[0]}.{sys.version_info[1]}-{tag}")
    prefix = os.path.join(final, "text_document")
    distributed = dist.is_available() and dist.is_initialized()
    if not os.path.isdir(final) and (not distributed or dist.get_rank() == 0):
        _build(files, parent, final)
    if distributed:
        dist.barrier()
    return prefix


def _build(files, parent, final):
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".building-", dir=parent)
    os.chmod(tmp, 0o755)
    tokenizer = ByteTokenizer()

    def documents():
        for path in files:
            with open(path, "rb") as f:
                data = np.frombuffer(f.read(), dtype=np.uint8).astype(np.int32)
            yield np.append(data, tokenizer.eod)

    try:
        write_indexed_dataset(os.path.join(tmp, "text_document"), documents(), tokenizer.vocab_size)
        os.rename(tmp, final)  # atomic; fails if another job got there first, which is fine
    except OSError:
        if not os.path.isdir(final):
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
