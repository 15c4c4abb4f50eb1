"""tools/preprocess_data.py: JSONL -> P_text_document.bin/.idx that megatron's IndexedDataset reads back.

Bad input (non-string values, non-object lines, invalid JSON or UTF-8, no documents) is one
line on stderr naming the file, line and key, exit status 2, and never touches an earlier output."""

import json

import numpy as np
import pytest

from cp_ext.cli import preprocess_data as preprocess
from cp_ext.data.tokenizers import build_tokenizer
from tests.launch import REPO_ROOT, run_script

DOCS = [f"document {i}: the quick brown fox jumps over the lazy dog {i * 7}" for i in range(40)]


def _run(tmp_path, *flags, in_process=False):
    source = tmp_path / "corpus.jsonl"
    source.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(DOCS)))
    argv = ["--input", str(source), "--json-keys", "text", "--output-prefix", str(tmp_path / "out"), "--append-eod", *flags]
    if in_process:  # the tool's main(), without paying a second interpreter start
        preprocess.main(argv)
    else:  # the command line, with worker processes
        run_script(0, REPO_ROOT / "tools" / "preprocess_data.py", *argv)
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    return IndexedDataset(str(tmp_path / "out_text_document"))


def _check(data, tokenizer):
    assert len(data) == len(DOCS)
    for i, doc in enumerate(DOCS):
        assert data[i].tolist() == tokenizer.tokenize(doc).tolist() + [tokenizer.eod]


@pytest.mark.quick
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


def _fails(tmp_path, capsys, content: bytes, *flags):
    """Run main() in-process on `content`; returns its stderr after asserting exit status 2 and no output."""
    source = tmp_path / "bad.jsonl"
    source.write_bytes(content)
    with pytest.raises(SystemExit) as e:
        preprocess.main(["--input", str(source), "--output-prefix", str(tmp_path / "out"), *flags])
    assert e.value.code == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl"]  # no output, no temp files
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("preprocess_data.py: --input " + str(source))
    return err


GOOD = b'{"text": "fine"}\n{"text": "also fine", "n": 2}\n\n'


@pytest.mark.parametrize("value, kind", [("null", "null"), ('["a", "b"]', 'an array (["a", "b"])'),
                                         ("3.5", "a number (3.5)"), ('{"a": 1}', "an object"),
                                         ("true", "a boolean (true)")])
def test_non_string_value_is_an_error_naming_line_and_key(tmp_path, capsys, value, kind):
    err = _fails(tmp_path, capsys, GOOD + b'{"id": 7, "text": ' + value.encode() + b"}\n", "--append-eod")
    assert "line 4 key 'text' is " + kind in err and "not a string" in err


@pytest.mark.parametrize("line", [b"42", b'"text"', b"[1, 2]", b"null"])
def test_json_that_is_not_an_object_names_the_line(tmp_path, capsys, line):
    err = _fails(tmp_path, capsys, GOOD + line + b"\n")
    assert "line 4 is valid JSON but" in err and "not an object" in err


@pytest.mark.quick
def test_invalid_json_names_the_line(tmp_path, capsys):
    err = _fails(tmp_path, capsys, GOOD + b'{"text": "unterminated}\n')
    assert "line 4 is not valid JSON (" in err


def test_non_utf8_names_the_line(tmp_path, capsys):
    err = _fails(tmp_path, capsys, GOOD + b'{"text": "caf\xe9"}\n')  # Latin-1
    assert "line 4 is not UTF-8 (byte 0xe9" in err


@pytest.mark.parametrize("content", [b"", b"\n  \n\n"])
def test_empty_input_is_an_error(tmp_path, capsys, content):
    assert "holds no documents" in _fails(tmp_path, capsys, content)


def test_only_empty_documents_is_an_error(tmp_path, capsys):
    assert "every 'text' value is empty" in _fails(tmp_path, capsys, b'{"text": ""}\n{"text": ""}\n')


def test_utf8_byte_order_mark_is_accepted(tmp_path):
    source = tmp_path / "bom.jsonl"
    source.write_bytes(b'\xef\xbb\xbf{"text": "hi"}\n')
    preprocess.main(["--input", str(source), "--output-prefix", str(tmp_path / "out")])
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    data = IndexedDataset(str(tmp_path / "out_text_document"))  # held: its mmap backs data[0]
    assert data[0].tolist() == list(b"hi")


def test_failing_rerun_keeps_the_earlier_output(tmp_path):
    """A re-run onto an existing prefix that fails late (after writing most documents, in a worker)
    leaves the earlier .bin/.idx byte for byte, and no temporary files; a good re-run replaces them."""
    data = _run(tmp_path, "--tokenizer-type", "ByteTokenizer", in_process=True)
    _check(data, build_tokenizer("ByteTokenizer"))
    del data
    bin_path, idx_path = tmp_path / "out_text_document.bin", tmp_path / "out_text_document.idx"
    before = {p: p.read_bytes() for p in (bin_path, idx_path)}
    assert len(before[bin_path]) > 1000
    (tmp_path / "out_text_document.maxid.json").write_text("{}")  # a cache of the old files
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps({"text": f"new document {i}"}) + "\n" for i in range(300)) + '{"text": null}\n')
    argv = ["--input", str(bad), "--json-keys", "text", "--output-prefix", str(tmp_path / "out"), "--workers", "2"]
    proc = run_script(0, REPO_ROOT / "tools" / "preprocess_data.py", *argv, check=False)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == f"preprocess_data.py: --input {bad} line 301 key 'text' is null, not a string; " \
                          f"fix or drop the line (only strings are tokenized)\n"
    assert {p: p.read_bytes() for p in (bin_path, idx_path)} == before
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["bad.jsonl", "corpus.jsonl", "out_text_document.bin", "out_text_document.idx",
                     "out_text_document.maxid.json"]
    # a good re-run renames complete files over the old pair and drops the old pair's cache
    bad.write_text(json.dumps({"text": "replacement"}) + "\n")
    preprocess.main(argv[:-2])
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    data = IndexedDataset(str(tmp_path / "out_text_document"))
    assert len(data) == 1 and data[0].tolist() == list(b"replacement")
    assert sorted(p.name for p in tmp_path.iterdir()) == names[:-1]
