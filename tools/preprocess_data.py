#!/usr/bin/env python
"""Tokenize a JSONL corpus into Megatron indexed datasets (the code: `cp_ext.data.preprocess`, its command line `cp_ext.cli.preprocess_data`).

    python tools/preprocess_data.py --input corpus.jsonl --json-keys text --output-prefix data/corpus \\
        --append-eod --tokenizer-type HuggingFaceTokenizer --tokenizer-model tokenizer.json --workers 4

``python tools/preprocess_data.py --help`` says the rest.
"""

import sys
import warnings

# megatron.core's import notes that Transformer Engine / Apex are absent: irrelevant to tokenizing
warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*", category=UserWarning)

from cp_ext.cli.preprocess_data import main  # noqa: E402  (after the filter: it may import megatron.core)

if __name__ == "__main__":
    sys.exit(main())
