"""Tokenize a JSONL corpus into Megatron indexed datasets (Megatron-LM's flag spellings; the command
line is `cp_ext.cli.preprocess_data`).

    python tools/preprocess_data.py --input corpus.jsonl --json-keys text --output-prefix data/corpus \\
        --append-eod --tokenizer-type HuggingFaceTokenizer --tokenizer-model tokenizer.json --workers 4

writes data/corpus_text_document.bin/.idx (one per --json-keys key), built with megatron.core's
IndexedDatasetBuilder; train on it with `pretrain_moe.py --data-path data/corpus_text_document`
and the same --tokenizer-type/--tokenizer-model. One JSON object per line, one document each.
"""

import json
import multiprocessing
import os
import time

from cp_ext.data.tokenizers import build_tokenizer

_TOKENIZER = None  # this process's tokenizer: each worker builds its own (`_init_worker`)


class InputError(Exception):
    """A problem with --input or the output, named with its flag and the fix (the command line prints it
    as one line and exits 2: `cp_ext.cli.preprocess_data`)."""


def _init_worker(tokenizer_type, tokenizer_model):
    global _TOKENIZER
    _TOKENIZER = build_tokenizer(tokenizer_type, tokenizer_model)


def _json_kind(value):
    """How a non-string JSON value reads in a message: 'null', 'a number (3.5)', 'an array (["a", "b"])'."""
    if value is None:
        return "null"
    kind = {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "an array",
            dict: "an object"}.get(type(value), "a value")
    text = json.dumps(value)
    return f"{kind} ({text if len(text) <= 40 else text[:37] + '...'})"


def _encode(job):
    """(line number, raw line bytes, keys, append_eod) -> (line number, {key: token ids} or an error message)."""
    number, raw, keys, append_eod = job
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return number, (f"is not UTF-8 (byte 0x{raw[e.start]:02x} at byte {e.start + 1} of the line); "
                        f"convert the file, e.g. iconv -f LATIN1 -t UTF-8")
    if number == 1:
        line = line.lstrip("\ufeff")  # a UTF-8 byte-order mark
    try:
        record = json.loads(line.strip())
    except json.JSONDecodeError as e:
        return number, f"is not valid JSON ({e.msg} at column {e.colno}); give one JSON object per line"
    if not isinstance(record, dict):
        return number, (f"is valid JSON but {_json_kind(record)}, not an object; give one JSON object "
                        f"per line, e.g. {{\"text\": \"...\"}}")
    out = {}
    for key in keys:
        if key not in record:
            return number, f"has no key {key!r} (keys: {sorted(record)}); set --json-keys"
        value = record[key]
        if not isinstance(value, str):
            return number, (f"key {key!r} is {_json_kind(value)}, not a string; fix or drop the line "
                            f"(only strings are tokenized)")
        ids = _TOKENIZER.tokenize(value).tolist()
        if append_eod:
            ids.append(_TOKENIZER.eod)
        out[key] = ids
    return number, out


def _tokenize_into(args, writers, start):
    """Tokenize --input into `writers` ({key: IndexedDatasetWriter}); returns the document count."""
    docs = 0
    with open(args.input, "rb") as f:
        jobs = ((n, line, args.json_keys, args.append_eod) for n, line in enumerate(f, 1) if line.strip())
        if args.workers > 1:
            pool = multiprocessing.Pool(args.workers, _init_worker, (args.tokenizer_type, args.tokenizer_model))
            results = pool.imap(_encode, jobs, chunksize=64)
        else:
            pool = None
            _init_worker(args.tokenizer_type, args.tokenizer_model)
            results = map(_encode, jobs)
        try:
            for number, out in results:
                if isinstance(out, str):
                    raise InputError(f"--input {args.input} line {number} {out}")
                for key, ids in out.items():
                    writers[key].add(ids)
                docs += 1
                if docs % args.log_interval == 0:
                    print(f"processed {docs} documents ({docs / (time.time() - start):.0f} docs/s)", flush=True)
        finally:
            if pool is not None:
                pool.terminate()  # results are all in (or an error stops the run): no work is lost
                pool.join()
    return docs


def preprocess(args) -> str:
    """Tokenize ``args.input`` (the command line's flags) into PREFIX_<key>_document.bin/.idx; returns the
    summary line. Raises `InputError` for a bad input or output, having written nothing."""
    if not os.path.isfile(args.input):
        raise InputError(f"--input {args.input}: no such file")
    try:
        tokenizer = build_tokenizer(args.tokenizer_type, args.tokenizer_model)
    except ValueError as e:
        raise InputError(str(e)) from None
    from megatron.core.datasets.indexed_dataset import DType

    from cp_ext.data.indexed import IndexedDatasetWriter

    prefixes = {key: f"{args.output_prefix}_{key}_document" for key in args.json_keys}
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    start, writers = time.time(), {}
    # Everything goes to temporary files beside the output; only a complete run renames them
    # onto PREFIX_<key>_document.bin/.idx, so a failure leaves an earlier good output as it was.
    try:
        for key, prefix in prefixes.items():
            writers[key] = IndexedDatasetWriter(prefix, dtype)
        docs = _tokenize_into(args, writers, start)
        if docs == 0:
            raise InputError(f"--input {args.input} holds no documents (every line is blank); nothing written")
        for key, writer in writers.items():
            if writer.documents == 0:
                raise InputError(f"--input {args.input}: every {key!r} value is empty; nothing written "
                                 f"(an index without documents cannot be trained on)")
        for writer in writers.values():
            writer.finalize()
        for writer in writers.values():
            writer.commit()
    except (InputError, OSError) as e:
        for writer in writers.values():
            writer.discard()
        if isinstance(e, InputError):
            raise
        raise InputError(f"--output-prefix {args.output_prefix}: {e}; nothing written") from None
    except BaseException:
        for writer in writers.values():
            writer.discard()
        raise
    tokens = sum(w.tokens for w in writers.values())
    return (f"wrote {', '.join(p + '.bin/.idx' for p in prefixes.values())}: {docs} documents, {tokens} tokens, "
            f"vocab {tokenizer.vocab_size} ({args.tokenizer_type}), {time.time() - start:.1f}s")
