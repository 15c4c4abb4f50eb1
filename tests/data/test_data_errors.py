"""Bad data input stops at argument validation with a message naming the file or flag and the fix."""

import os
import subprocess
import sys

import numpy as np
import pytest

from cp_ext.arguments import ConfigError, parse_args
from cp_ext.data.indexed import write_indexed_dataset
from tests.launch import REPO_ROOT


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
    assert corpus + ".bin holds token id 299" in msg and "vocab is 257" in msg and "--vocab-size" in msg


def test_vocab_size_below_the_tokenizer():
    assert "--vocab-size 100 is smaller than the tokenizer's vocab 257" in _error("--vocab-size", "100")


def test_missing_tokenizer_model(tmp_path, corpus):
    msg = _error("--data-path", corpus, "--tokenizer-type", "HuggingFaceTokenizer",
                 "--tokenizer-model", str(tmp_path / "nope.json"))
    assert "--tokenizer-model" in msg and "no such file" in msg


def test_malformed_blend(corpus):
    assert "weights and prefixes must alternate" in _error("--data-path", "0.5", corpus, corpus, "0.5")


def test_seq_length_the_cp_layout_cannot_split():
    msg = _error("--context-parallel-size", "2", "--seq-length", "30", world_size=2)
    assert "--seq-length 30 is not divisible by 4" in msg
    msg = _error("--context-parallel-size", "4", "--cp-load-balance", "none", "--seq-length", "30", world_size=4)
    assert "--seq-length 30 is not divisible by 4" in msg


def test_pretrain_prints_once_and_exits_2(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run([sys.executable, "pretrain_moe.py", "--data-path", str(tmp_path / "missing")],
                          cwd=REPO_ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.count("missing.bin and") == 1 and "configuration error" in proc.stderr
