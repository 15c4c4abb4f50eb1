"""Hugging Face checkpoints in and out of cp_ext (the code: `cp_ext.cli.convert_hf`, also installed as
``cp-ext-convert-hf``; the conversion itself: `cp_ext.hf.convert`).

    python tools/convert_hf.py import --hf-dir DIR --save CKPT
    python tools/convert_hf.py export --load CKPT --hf-dir OUT [--max-shard-size 5GB]
    torchrun ... pretrain_moe.py --config CKPT/model.yaml --load CKPT --finetune ...   # grid, training flags
    torchrun ... tools/generate.py --config CKPT/model.yaml --load CKPT --prompt ... --logprobs --output o.jsonl

``python tools/convert_hf.py --help`` says the rest.
"""

import sys

from cp_ext.cli.convert_hf import main

if __name__ == "__main__":
    sys.exit(main())
