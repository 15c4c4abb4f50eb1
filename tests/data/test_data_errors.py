"""Bad data input stops at argument validation with a message naming the file or flag and the fix."""

import os

import numpy as np
import pytest

from cp_ext.arguments import ConfigError, parse_args
from cp_ext.data.indexed import write_indexed_dataset
from tests.launch import REPO_ROOT, run_script


@pytest.fixture
def corpus(tmp_path):
    prefix = str(tmp_path / "corpus_text_document")
    rng = np.random.default_rng(0)
    write_indexed_dataset(prefix, [rng.integers(0, 256, size=50) for _ in range(20)] + [np.array([299])], 300)
    return prefix


def _error(*argv, world_size=1):
    with pytest.raises(ConfigError) as e:
        parse_args(list(argv), world_size=world_size)
    return str(e.value)


def test_good_files_pass(corpus):
    parse_args(["--data-path", corpus, "--vocab-size", "300"], world_size=1)


@pytest.mark.quick
def test_missing_bin(corpus):
    os.remove(corpus + ".bin")
    msg = _error("--data-path", corpus, "--vocab-size", "300")
    assert "--data-path" in msg and corpus + ".bin not found" in msg


def test_corrupt_idx(corpus):
    with open(corpus + ".idx", "r+b") as f:
        f.truncate(20)
    msg = _error("--data-path", corpus, "--vocab-size", "300")
    assert corpus + ".idx is corrupt" in msg and "preprocess_data.py" in msg


def test_truncated_bin(corpus):
    with open(corpus + ".bin", "r+b") as f:
        f.truncate(100)
    assert "truncated or mismatched" in _error("--data-path", corpus, "--vocab-size", "300")


def test_token_ids_beyond_the_vocab(corpus):
    msg = _error("--data-path", corpus)  # ByteTokenizer: vocab 257, the data holds id 299
    assert "- --data-path " + corpus + ": " in msg
    assert corpus + ".bin holds token id 299" in msg and "vocab is 257 (--tokenizer-type ByteTokenizer)" in msg
    assert "--tokenizer-type/--tokenizer-model the data was preprocessed with" in msg and "--vocab-size" in msg


def test_every_token_is_checked_once_per_file(tmp_path, monkeypatch):
    """An id past the first 1000 documents, below the padded vocab (257 -> 384) that would have
    trained silently, is found; the scan's result is cached next to the index and reused, and a
    changed .bin (same size, new mtime) is scanned again."""
    import json

    from cp_ext.data import indexed

    prefix = str(tmp_path / "big_text_document")
    docs = [np.full(30, i % 256) for i in range(1500)]
    docs[1400] = docs[1400].copy()
    docs[1400][17] = 300
    write_indexed_dataset(prefix, docs, 300)
    scans = []
    scan = indexed._scan_ids
    monkeypatch.setattr(indexed, "_scan_ids", lambda *a: scans.append(a) or scan(*a))
    monkeypatch.setattr(indexed, "SCAN_CHUNK_TOKENS", 4096)  # several chunks: the bad id is in a later one

    msg = _error("--data-path", prefix)
    assert prefix + ".bin holds token id 300" in msg and "45000 tokens" in msg and "vocab is 257" in msg
    cache = json.loads(open(prefix + ".maxid.json").read())
    assert cache["max"] == 300 and cache["bin_size"] == 90000 and len(scans) == 1
    assert "holds token id 300" in _error("--data-path", prefix, "--vocab-size", "299")
    assert len(scans) == 1  # from the cache
    parse_args(["--data-path", prefix, "--vocab-size", "301"], world_size=1)
    assert len(scans) == 1

    with open(prefix + ".bin", "r+b") as f:  # fix the bad token in place: same size, new mtime
        f.seek((1400 * 30 + 17) * 2)
        f.write(np.array([5], dtype=np.uint16).tobytes())
    st = os.stat(prefix + ".bin")
    os.utime(prefix + ".bin", ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    parse_args(["--data-path", prefix], world_size=1)
    assert len(scans) == 2 and json.loads(open(prefix + ".maxid.json").read())["max"] == 255
    parse_args(["--data-path", prefix], world_size=1)
    assert len(scans) == 2


def test_uncachable_directory_still_checks(corpus, monkeypatch):
    """Where the cache cannot be written (a read-only dataset directory), the check runs, silently, each time."""
    from cp_ext.data import indexed

    os.mkdir(corpus + ".maxid.json")  # neither readable nor replaceable as a file, even as root
    scans = []
    scan = indexed._scan_ids
    monkeypatch.setattr(indexed, "_scan_ids", lambda *a: scans.append(a) or scan(*a))
    for _ in range(2):
        assert "holds token id 299" in _error("--data-path", corpus)
    assert len(scans) == 2
    assert sorted(os.listdir(os.path.dirname(corpus))) == sorted(
        os.path.basename(corpus) + s for s in (".bin", ".idx", ".maxid.json"))  # no temp files left


def test_negative_token_ids(tmp_path):
    prefix = str(tmp_path / "signed_text_document")
    write_indexed_dataset(prefix, [np.array([1, 2, 3]), np.array([4, -1, 6])], 100_000)  # int32 on disk
    msg = _error("--data-path", prefix, "--vocab-size", "100000")
    assert prefix + ".bin holds token id -1" in msg and "ids must be >= 0" in msg


def test_valid_data_path_problems_name_their_flag(corpus):
    msg = _error("--data-path", corpus, "--valid-data-path", corpus)
    assert "--data-path " + corpus + ": " in msg and "--valid-data-path " + corpus + ": " in msg


def test_vocab_size_below_the_tokenizer():
    assert "--vocab-size 100 is smaller than the tokenizer's vocab 257" in _error("--vocab-size", "100")


def test_missing_tokenizer_model(tmp_path, corpus):
    msg = _error("--data-path", corpus, "--tokenizer-type", "HuggingFaceTokenizer",
                 "--tokenizer-model", str(tmp_path / "nope.json"))
    assert "--tokenizer-model" in msg and "no such file" in msg


def test_malformed_blend(corpus):
    assert "weights and prefixes must alternate" in _error("--data-path", "0.5", corpus, corpus, "0.5")


@pytest.mark.quick
def test_seq_length_the_cp_layout_cannot_split():
    msg = _error("--context-parallel-size", "2", "--seq-length", "30", world_size=2)
    assert "--seq-length 30 is not divisible by 4" in msg
    msg = _error("--context-parallel-size", "4", "--cp-load-balance", "none", "--seq-length", "30", world_size=4)
    assert "--seq-length 30 is not divisible by 4" in msg


@pytest.mark.quick
def test_pretrain_prints_once_and_exits_2(tmp_path):
    proc = run_script(0, REPO_ROOT / "pretrain_moe.py", "--data-path", tmp_path / "missing", check=False)
    assert proc.returncode == 2
    assert proc.stderr.count("missing.bin and") == 1 and "configuration error" in proc.stderr
