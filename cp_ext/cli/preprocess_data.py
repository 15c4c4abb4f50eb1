"""Tokenize a JSONL corpus into Megatron indexed datasets: the command line over
`cp_ext.data.preprocess` (Megatron-LM's tools/preprocess_data.py flag spellings).

    python tools/preprocess_data.py --input corpus.jsonl --json-keys text --output-prefix data/corpus \\
        --append-eod --tokenizer-type HuggingFaceTokenizer --tokenizer-model tokenizer.json --workers 4

writes data/corpus_text_document.bin/.idx (one per --json-keys key), built with megatron.core's
IndexedDatasetBuilder; train on it with `pretrain_moe.py --data-path data/corpus_text_document`
and the same --tokenizer-type/--tokenizer-model. One JSON object per line, one document each.
A bad input or output is one line on stderr and exit status 2; nothing is written then.
"""

import argparse
import sys

from cp_ext.data.preprocess import InputError, preprocess
from cp_ext.data.tokenizers import TOKENIZER_TYPES
from cp_ext.flag_types import POSITIVE


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True, help="JSONL file, one document per line")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="keys to extract (default: text)")
    p.add_argument("--output-prefix", required=True, help="writes PREFIX_<key>_document.bin/.idx")
    p.add_argument("--append-eod", action="store_true", help="end every document with the EOD token")
    p.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default="ByteTokenizer")
    p.add_argument("--tokenizer-model", default=None, help="tokenizer.json for HuggingFaceTokenizer")
    p.add_argument("--workers", type=POSITIVE, default=1, help="tokenizing processes")
    p.add_argument("--log-interval", type=POSITIVE, default=10000, help="documents between progress lines")
    return p.parse_args(argv)



def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        print(preprocess(args), flush=True)
    except InputError as e:
        print(f"preprocess_data.py: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    return 0
