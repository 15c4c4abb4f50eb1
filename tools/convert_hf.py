"""Hugging Face checkpoints in and out of cp_ext: ``import`` reads config.json and the safetensors, writes a
cp_ext checkpoint that loads at any grid, and the model's flags beside it; ``export`` writes one back.

    python tools/convert_hf.py import --hf-dir DIR --save CKPT
    python tools/convert_hf.py export --load CKPT --hf-dir OUT [--max-shard-size 5GB]
    torchrun ... pretrain_moe.py --config CKPT/model.yaml --load CKPT --finetune ...   # grid, training flags
    torchrun ... tools/generate.py --config CKPT/model.yaml --load CKPT --prompt ... --logprobs --output o.jsonl

Supported: `cp_ext.hf.families.ARCHITECTURES` (Mixtral, Qwen3-MoE, GPT-OSS). The model is built on one rank
(CP1, TP1) from megatron's own sharded-state-dict map (`cp_ext.models.layout`): every full tensor it
holds is assembled from Hugging Face's by the family's adapter, each HF tensor must be used, and the
checkpoint is megatron's dist_checkpointing format, which every grid reshards on load. The import keeps
config.json and the tokenizer files in CKPT/hf/; export loads the checkpoint's weights (any iteration),
splits each full tensor back into Hugging Face's by the same adapter, casts it to config.json's dtype, and
writes shards of at most --max-shard-size with an index, config.json and the tokenizer: HF -> cp_ext -> HF
gives every tensor back bit for bit (tests/tools/test_convert_hf.py).
"""

import argparse
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cp_ext.arguments import ConfigError, exit_with_config_error, parse_args, single_process_without_torchrun  # noqa: E402
from cp_ext.hf.families import adapter_for  # noqa: E402
from cp_ext.hf.reader import HFCheckpoint, HFError  # noqa: E402

MODEL_YAML = "model.yaml"
HF_FILES = "hf"  # CKPT/hf/: the import's config.json and tokenizer files, what export writes back
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "generation_config.json", "chat_template.jinja")


def yaml_lines(flags):
    """pretrain_moe.py's flags as YAML keys (`cp_ext.arguments.yaml_config`): ``--swiglu`` -> ``swiglu: true``."""
    lines, i = [], 0
    while i < len(flags):
        key = str(flags[i])[2:]
        if i + 1 < len(flags) and not str(flags[i + 1]).startswith("--"):
            lines.append(f"{key}: {json.dumps(flags[i + 1])}")
            i += 2
        else:
            lines.append(f"{key}: true")
            i += 1
    return lines


def import_checkpoint(hf_dir, save):
    hf = HFCheckpoint(hf_dir)
    adapter = adapter_for(hf.config, f"{hf.dir / 'config.json'}")
    problems = adapter.problems()
    if problems:
        raise HFError("; ".join(problems))
    flags = [str(x) for x in adapter.flags()]
    single_process_without_torchrun()
    args = parse_args(flags + ["--save", str(save), "--device", "cpu", "--train-iters", "1"])

    import torch

    from cp_ext.models.layout import iter_global_slices
    from cp_ext.training.trainer import Trainer

    trainer = Trainer(args)
    model = trainer.model[0].module
    unit, full = None, None
    with torch.no_grad():
        for piece in iter_global_slices(model):
            if piece.unit != unit:
                unit, full = piece.unit, adapter.unit(hf, piece.unit)
                if tuple(full.shape) != tuple(piece.unit_shape):
                    raise HFError(f"megatron's {unit} is {piece.unit_shape}, the Hugging Face tensors give "
                                  f"{tuple(full.shape)}")
            piece.local.copy_(full[piece.index].to(piece.local.dtype))
    left = sorted(hf.names() - adapter.used - adapter.unused_by_design(hf.names()))
    if left:
        raise HFError(f"--hf-dir {hf.dir}: {len(left)} tensor(s) left over after the mapping, e.g. {left[:3]}")
    trainer.checkpointer.save(save)
    kept = Path(save) / HF_FILES
    kept.mkdir(exist_ok=True)
    for name in ("config.json",) + TOKENIZER_FILES:
        if (hf.dir / name).is_file():
            shutil.copy(hf.dir / name, kept / name)
    (Path(save) / MODEL_YAML).write_text(
        f"# {hf.config['architectures'][0]} from {hf.dir} (tools/convert_hf.py import)\n" + "\n".join(yaml_lines(flags))
        + "\n")
    print(f"convert_hf: {hf.config['architectures'][0]} -> {save} (iteration 0); model flags in {Path(save) / MODEL_YAML}")
    trainer.shutdown()


def _bytes(text):
    units = {"KB": 2 ** 10, "MB": 2 ** 20, "GB": 2 ** 30}
    for unit, scale in units.items():
        if text.upper().endswith(unit):
            return int(float(text[:-2]) * scale)
    return int(text)


def export_checkpoint(load, out, max_shard_bytes, hf_files=None):
    """``hf_files``: the directory with config.json and the tokenizer files (default: what the import kept in
    the checkpoint; a run that trained on from it saves elsewhere, so name the import's CKPT/hf)."""
    out, load = Path(out), Path(load)
    if out.exists() and any(out.iterdir()):
        raise HFError(f"--hf-dir {out} exists and is not empty; give a new directory (nothing is overwritten)")
    kept = Path(hf_files) if hf_files else load / HF_FILES
    config_path = kept / "config.json"
    if not config_path.is_file():
        raise HFError(f"{config_path} is missing: export needs the Hugging Face config.json that "
                      f"tools/convert_hf.py import keeps in CKPT/{HF_FILES}/; for a checkpoint trained on from an "
                      f"import, give --hf-files IMPORTED_CKPT/{HF_FILES}")
    config = json.loads(config_path.read_text())
    adapter = adapter_for(config, str(config_path))
    single_process_without_torchrun()
    args = parse_args(["--load", str(load), "--use-checkpoint-args", "--finetune", "--device", "cpu",
                       "--train-iters", "1"])

    import torch
    from safetensors.torch import save_file

    from cp_ext.models.layout import iter_global_slices
    from cp_ext.training.trainer import Trainer

    dtype = getattr(torch, config.get("dtype") or config.get("torch_dtype") or "float32")
    trainer = Trainer(args)
    out.mkdir(parents=True, exist_ok=True)
    shards, pending, pending_bytes, total = [], {}, 0, 0

    def flush():
        nonlocal pending, pending_bytes
        if pending:
            shards.append(pending)
            save_file(pending, out / f"part-{len(shards):05d}.safetensors", metadata={"format": "pt"})
            pending, pending_bytes = {}, 0

    def write(unit, full):
        nonlocal pending_bytes, total
        for name, tensor in adapter.split(unit, full).items():
            tensor = tensor.to(dtype).contiguous()
            if pending_bytes + tensor.numel() * tensor.element_size() > max_shard_bytes:
                flush()
            pending[name] = tensor
            pending_bytes += tensor.numel() * tensor.element_size()
            total += tensor.numel() * tensor.element_size()

    # One full tensor (one layer's, one expert's) at a time: a unit's pieces come one after another.
    unit, full = None, None
    for piece in iter_global_slices(trainer.model[0].module):
        if piece.unit != unit:
            if unit is not None:
                write(unit, full)
            unit, full = piece.unit, torch.zeros(piece.unit_shape, dtype=piece.local.dtype)
        full[piece.index] = piece.local.detach()
    if unit is not None:
        write(unit, full)
    flush()
    count = len(shards)
    weight_map = {}
    for i, shard in enumerate(shards, start=1):  # Hugging Face's names: model-00001-of-00003.safetensors
        name = f"model-{i:05d}-of-{count:05d}.safetensors"
        (out / f"part-{i:05d}.safetensors").rename(out / name)
        weight_map.update({tensor: name for tensor in shard})
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    for name in ("config.json",) + TOKENIZER_FILES:
        if (kept / name).is_file():
            shutil.copy(kept / name, out / name)
    print(f"convert_hf: {load} -> {out}: {len(weight_map)} tensors in {count} shard(s), {total / 2 ** 20:.1f} MiB")
    trainer.shutdown()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="Hugging Face directory -> cp_ext checkpoint + model.yaml")
    imp.add_argument("--hf-dir", required=True)
    imp.add_argument("--save", required=True)
    exp = sub.add_parser("export", help="cp_ext checkpoint (made by import) -> Hugging Face directory")
    exp.add_argument("--load", required=True)
    exp.add_argument("--hf-dir", required=True, help="a new or empty directory")
    exp.add_argument("--max-shard-size", default="5GB", help="bytes per safetensors shard (5GB, 500MB, 40KB, ...)")
    exp.add_argument("--hf-files", default=None,
                     help="config.json and tokenizer files (default: --load's hf/, which the import wrote)")
    a = p.parse_args(argv)
    try:
        if a.command == "import":
            import_checkpoint(a.hf_dir, a.save)
        else:
            export_checkpoint(a.load, a.hf_dir, _bytes(a.max_shard_size), a.hf_files)
    except (HFError, ConfigError) as e:
        exit_with_config_error("convert_hf.py", ConfigError(f"  - {e}" if isinstance(e, HFError) else str(e)))


if __name__ == "__main__":
    main()
