"""Hugging Face checkpoints in and out of cp_ext: ``import`` reads config.json and the safetensors, writes a
cp_ext checkpoint that loads at any grid, and the model's flags beside it; ``export`` writes one back.

    python tools/convert_hf.py import --hf-dir DIR --save CKPT
    python tools/convert_hf.py export --load CKPT --hf-dir OUT [--max-shard-size 5GB]
    torchrun ... pretrain_moe.py --config CKPT/model.yaml --load CKPT --finetune ...   # grid, training flags
    torchrun ... tools/generate.py --config CKPT/model.yaml --load CKPT --prompt ... --logprobs --output o.jsonl

Supported: `cp_ext.hf.families.ARCHITECTURES` (Mixtral, Qwen3-MoE, DeepSeek-V3, GPT-OSS; FP8 and MXFP4
releases are dequantized by the reader). Neither direction holds the model: it is built on the meta device
for megatron's sharded-state-dict map (`cp_ext.hf.streaming`). The whole mapping is first checked on the
safetensors headers (every HF tensor used, every shape as config.json implies); then import writes
megatron's dist_checkpointing (torch_dist) checkpoint chunk by chunk, each chunk's full tensor assembled
from Hugging Face's by the family's adapter when the writer asks for it (under torchrun at a grid, each rank
its own chunks), and export reads one layer's units at a time, splits each back into Hugging Face's by the
same adapter, casts to config.json's dtype and writes shards of at most --max-shard-size with an index,
config.json and the tokenizer the import kept in CKPT/hf/. Both write into DIR.partial, renamed at the end.
HF -> cp_ext -> HF gives every tensor back bit for bit (tests/hf/test_convert.py).
"""

import argparse
from pathlib import Path

from cp_ext.console import exit_with_config_error, print_rank_0
from cp_ext.errors import ConfigError
from cp_ext.hf.convert import MODEL_YAML, export_checkpoint, import_checkpoint, size_in_bytes
from cp_ext.hf.reader import HFError

# What an import may be given besides its directories: the grid it runs at under torchrun (each rank then
# reads only the Hugging Face tensors of the units it holds) and the weights' dtype (default fp32).
IMPORT_FLAGS = ("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--expert-model-parallel-size",
                "--expert-tensor-parallel-size", "--sequence-parallel", "--bf16")


def _grid_flags(rest):
    flags = [t for t in rest if t.startswith("--")]
    other = [f for f in flags if f.split("=")[0] not in IMPORT_FLAGS]
    if other or (rest and not rest[0].startswith("--")):
        raise ConfigError(f"  - convert_hf.py import: {' '.join(other or rest[:1])} is not an import flag; besides "
                          f"--hf-dir and --save it takes {', '.join(IMPORT_FLAGS)} (the model's flags come from "
                          f"config.json, training flags go to pretrain_moe.py)")
    return rest


def _parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="Hugging Face directory -> cp_ext checkpoint + model.yaml (under torchrun "
                         "at a grid: " + ", ".join(IMPORT_FLAGS) + ")")
    imp.add_argument("--hf-dir", required=True)
    imp.add_argument("--save", required=True)
    exp = sub.add_parser("export", help="cp_ext checkpoint (made by import) -> Hugging Face directory")
    exp.add_argument("--load", required=True)
    exp.add_argument("--hf-dir", required=True, help="a new or empty directory")
    exp.add_argument("--max-shard-size", default="5GB", help="bytes per safetensors shard (5GB, 500MB, 40KB, ...)")
    exp.add_argument("--hf-files", default=None,
                     help="config.json and tokenizer files (default: --load's hf/, which the import wrote)")
    return p


def main(argv=None) -> int:
    a, rest = _parser().parse_known_args(argv)
    try:
        if a.command == "import":
            architecture = import_checkpoint(a.hf_dir, a.save, _grid_flags(rest))
            save = Path(a.save)
            print_rank_0(f"convert_hf: {architecture} -> {save} (weights; start from them with --finetune); "
                         f"model flags in {save / MODEL_YAML}")
        else:
            done = export_checkpoint(a.load, a.hf_dir, size_in_bytes(a.max_shard_size), a.hf_files)
            dropped = done.quantization
            note = f" (dequantized: config.json's {dropped.get('quant_method')} quantization_config dropped)" if dropped else ""
            print(f"convert_hf: {Path(a.load)} -> {Path(a.hf_dir)}: {done.tensors} tensors in {done.shards} shard(s), "
                  f"{done.total_bytes / 2 ** 20:.1f} MiB{note}", flush=True)
    except (HFError, ConfigError) as e:
        exit_with_config_error("convert_hf.py", ConfigError(f"  - {e}" if isinstance(e, HFError) else str(e)))
    return 0
