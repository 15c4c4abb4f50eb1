"""tools/preprocess_data.py: JSONL -> P_text_document.bin/.idx that megatron's IndexedDataset reads back."""

import importlib.util
import json
import subprocess
import sys

import numpy as np

from cp_ext.data.tokenizers import build_tokenizer
from tests.launch import REPO_ROOT

DOCS = [f"document {i}: the quick brown fox jumps over the lazy dog {i * 7}" for i in range(40)]


def _run(tmp_path, *flags, in_process=False):
    source = tmp_path / "corpus.jsonl"
    source.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(DOCS)))
    argv = ["--input", str(source), "--json-keys", "text", "--output-prefix", str(tmp_path / "out"), "--append-eod", *flags]
    if in_process:  # the tool's main(), without paying a second interpreter start
        spec = importlib.util.spec_from_file_location("preprocess_data", REPO_ROOT / "tools" / "preprocess_data.py")
        tool = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(tool)
        tool.main(argv)
    else:  # the command line, with worker processes
        subprocess.run([sys.executable, "tools/preprocess_data.py", *argv],
                       cwd=REPO_ROOT, check=True, capture_output=True, text=True, timeout=300)
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    return IndexedDataset(str(tmp_path / "out_text_document"))


def _check(data, tokenizer):
    assert len(data) == len(DOCS)
    for i, doc in enumerate(DOCS):
        assert data[i].tolist() == tokenizer.tokenize(doc).tolist() + [tokenizer.eod]


def test_byte_tokenizer(tmp_path):
    _check(_run(tmp_path, "--tokenizer-type", "ByteTokenizer", in_process=True), build_tokenizer("ByteTokenizer"))


def test_huggingface_tokenizer_json_with_workers(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    hf = Tokenizer(models.WordLevel(unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.train_from_iterator(DOCS, trainers.WordLevelTrainer(special_tokens=["<unk>", "</s>"]))
    path = tmp_path / "tokenizer.json"
    hf.save(str(path))
    tokenizer = build_tokenizer("HuggingFaceTokenizer", str(path))
    assert tokenizer.eod == 1 and tokenizer.vocab_size == hf.get_vocab_size()
    data = _run(tmp_path, "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(path), "--workers", "2")
    _check(data, tokenizer)
    assert np.asarray(data[0]).dtype == np.uint16
