#!/usr/bin/env python
"""Tokenize a JSONL corpus into Megatron indexed datasets (Megatron-LM's flag spellings).

    python tools/preprocess_data.py --input corpus.jsonl --json-keys text --output-prefix data/corpus \\
        --append-eod --tokenizer-type HuggingFaceTokenizer --tokenizer-model tokenizer.json --workers 4

writes data/corpus_text_document.bin/.idx (one per --json-keys key), built with megatron.core's
IndexedDatasetBuilder; train on it with `pretrain_moe.py --data-path data/corpus_text_document`
and the same --tokenizer-type/--tokenizer-model. One JSON object per line, one document each.
"""

import argparse
import json
import multiprocessing
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from cp_ext.data.tokenizers import TOKENIZER_TYPES, build_tokenizer  # noqa: E402

_TOKENIZER = None


def _init_worker(tokenizer_type, tokenizer_model):
    global _TOKENIZER
    _TOKENIZER = build_tokenizer(tokenizer_type, tokenizer_model)


def _encode(job):
    """(line number, line, keys, append_eod) -> {key: token ids} (or an error message)."""
    number, line, keys, append_eod = job
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        return number, f"not valid JSON ({e})"
    out = {}
    for key in keys:
        if key not in record:
            return number, f"has no key {key!r} (keys: {sorted(record)}); set --json-keys"
        ids = _TOKENIZER.tokenize(str(record[key])).tolist()
        if append_eod:
            ids.append(_TOKENIZER.eod)
        out[key] = ids
    return number, out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True, help="JSONL file, one document per line")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="keys to extract (default: text)")
    p.add_argument("--output-prefix", required=True, help="writes PREFIX_<key>_document.bin/.idx")
    p.add_argument("--append-eod", action="store_true", help="end every document with the EOD token")
    p.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default="ByteTokenizer")
    p.add_argument("--tokenizer-model", default=None, help="tokenizer.json for HuggingFaceTokenizer")
    p.add_argument("--workers", type=int, default=1, help="tokenizing processes")
    p.add_argument("--log-interval", type=int, default=10000, help="documents between progress lines")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if not os.path.isfile(args.input):
        sys.exit(f"preprocess_data.py: --input {args.input}: no such file")
    try:
        tokenizer = build_tokenizer(args.tokenizer_type, args.tokenizer_model)
    except ValueError as e:
        sys.exit(f"preprocess_data.py: {e}")
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    prefixes = {key: f"{args.output_prefix}_{key}_document" for key in args.json_keys}
    os.makedirs(os.path.dirname(os.path.abspath(args.output_prefix)), exist_ok=True)
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    builders = {key: IndexedDatasetBuilder(prefix + ".bin", dtype=dtype) for key, prefix in prefixes.items()}
    start, docs, tokens = time.time(), 0, 0
    with open(args.input, encoding="utf-8") as f:
        jobs = ((n, line, args.json_keys, args.append_eod) for n, line in enumerate(f, 1) if line.strip())
        if args.workers > 1:
            pool = multiprocessing.Pool(args.workers, _init_worker, (args.tokenizer_type, args.tokenizer_model))
            results = pool.imap(_encode, jobs, chunksize=64)
        else:
            _init_worker(args.tokenizer_type, args.tokenizer_model)
            results = map(_encode, jobs)
        for number, out in results:
            if isinstance(out, str):
                sys.exit(f"preprocess_data.py: --input {args.input} line {number} {out}")
            for key, ids in out.items():
                if ids:
                    builders[key].add_document(ids, [len(ids)])
                    tokens += len(ids)
            docs += 1
            if docs % args.log_interval == 0:
                print(f"processed {docs} documents ({docs / (time.time() - start):.0f} docs/s)", flush=True)
        if args.workers > 1:
            pool.close()
            pool.join()
    for key, builder in builders.items():
        builder.finalize(prefixes[key] + ".idx")
    print(f"wrote {', '.join(p + '.bin/.idx' for p in prefixes.values())}: {docs} documents, {tokens} tokens, "
          f"vocab {tokenizer.vocab_size} ({args.tokenizer_type}), {time.time() - start:.1f}s", flush=True)


if __name__ == "__main__":
    main()
