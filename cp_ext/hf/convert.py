"""Hugging Face checkpoint -> cp_ext checkpoint (`import_checkpoint`) and back (`export_checkpoint`);
the command line is `cp_ext.cli.convert_hf` (``tools/convert_hf.py``, ``cp-ext-convert-hf``).

Neither direction holds the model: it is built on the meta device for megatron's sharded-state-dict map
(`cp_ext.hf.streaming`). The whole mapping is first checked on the safetensors headers (every HF tensor
used, every shape as config.json implies); then import writes megatron's dist_checkpointing (torch_dist)
checkpoint chunk by chunk, each chunk's full tensor assembled from Hugging Face's by the family's adapter
when the writer asks for it (under torchrun at a grid, each rank its own chunks), and export reads one
layer's units at a time, splits each back into Hugging Face's by the same adapter, casts to config.json's
dtype (a tensor the release stored in another dtype, as transformers keeps a router or a bias in fp32: in that
dtype, `TENSORS`) and writes shards of at most ``max_shard_bytes`` with an index, config.json and the tokenizer the
import kept in CKPT/hf/. Both write into DIR.partial, renamed at the end (`cp_ext.checkpoint.disk_format`'s
publish). HF -> cp_ext -> HF gives every tensor back bit for bit (tests/hf/test_convert.py).
"""

import itertools
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from cp_ext.arguments import ConfigError, parse_args, single_process_without_torchrun
from cp_ext.hf.families import adapter_for
from cp_ext.hf.reader import HFCheckpoint, HFError

MODEL_YAML = "model.yaml"
HF_FILES = "hf"  # CKPT/hf/: the import's config.json and tokenizer files, what export writes back
# CKPT/hf/tensors.json: {HF tensor name: its stored dtype} of the imported checkpoint (dequantized tensors left out):
# the export writes each in that dtype, and an adapter that reads one of two namings writes the one it read
TENSORS = "tensors.json"
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


def size_in_bytes(text):
    """--max-shard-size's value in bytes: ``5GB``, ``500MB``, ``40KB`` (powers of 1024) or a plain number."""
    units = {"KB": 2 ** 10, "MB": 2 ** 20, "GB": 2 ** 30}
    for unit, scale in units.items():
        if text.upper().endswith(unit):
            return int(float(text[:-2]) * scale)
    return int(text)


def _fresh(path, flag):
    path = Path(path)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise HFError(f"{flag} {path} exists and is not empty; give a new directory (nothing is overwritten)")
    return path


def _staging(final):
    """Everything is written beside ``final`` and renamed into place at the end: a failed or killed
    conversion leaves nothing behind under ``final`` (only this ``.partial`` directory, removed on error)."""
    tmp = final.with_name(final.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def _start(argv_flags, device_flags=("--device", "cpu", "--train-iters", "1")):
    """Parse pretrain_moe.py's flags and join this rank's process groups (one process without torchrun):
    torch.distributed, the grid in the flags (`Grid.initialize`), and the seeds megatron's model
    construction reads, as the trainer starts them."""
    from cp_ext.grid import initialize_distributed
    from cp_ext.platform import setup_platform

    single_process_without_torchrun()
    args = parse_args([str(x) for x in argv_flags] + list(device_flags))
    initialize_distributed(args, setup_platform("cpu"))
    return args


def _gather(value):
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


MAX_LISTED = 12  # problems named one by one; the rest are counted


def _mapping_problems(hf, adapter, model):
    """Map every unit this rank holds on headers alone (names and shapes, no data), then check on all ranks
    together that every HF tensor was used: all before anything is written. Every unit is tried, so every
    missing tensor and wrong shape is named (each once, however many ranks hold the unit)."""
    from cp_ext.models.parameter_slices import sharded_tensors

    shapes, problems = hf.shapes_only(), []
    for t in sharded_tensors(model.sharded_state_dict()):
        p = t.prepend_axis_num
        for offsets in itertools.product(*map(range, t.global_shape[:p])):  # each layer (expert) of a stack
            unit, want = ".".join(map(str, (t.key, *offsets))), tuple(t.global_shape[p:])
            try:
                got = tuple(adapter.unit(shapes, unit).shape)
            except HFError as e:
                problems.append(str(e))
                continue
            if got != want:
                problems.append(f"megatron's {unit} is {want}, the Hugging Face tensors give {got}")
    results = _gather((problems, sorted(adapter.used)))
    problems = list(dict.fromkeys(p for rank_problems, _ in results for p in rank_problems))
    used = set().union(*(set(u) for _, u in results))
    left = sorted(hf.names() - used - adapter.unused_by_design(hf.names()))
    if left:
        problems.append(f"--hf-dir {hf.dir}: {len(left)} tensor(s) left over after the mapping, e.g. {left[:3]}")
    adapter.used = set()
    return problems


def _one_error(problems):
    """Every problem of a checkpoint in one HFError, a line each (the command line prefixes "  - ")."""
    listed = problems[:MAX_LISTED] + ([f"... and {len(problems) - MAX_LISTED} more"]
                                      if len(problems) > MAX_LISTED else [])
    return HFError("\n  - ".join(listed))


def import_checkpoint(hf_dir, save, grid_flags=()):
    """Write the Hugging Face checkpoint in ``hf_dir`` as a cp_ext checkpoint (weights only) at ``save``,
    with its model flags in ``save``/model.yaml and its config.json and tokenizer in ``save``/hf/.
    ``grid_flags``: the grid it runs at under torchrun, and ``--bf16``. Collective; returns the
    architecture (config.json's ``architectures[0]``)."""
    hf = HFCheckpoint(hf_dir)
    adapter = adapter_for(hf.config, f"{hf.dir / 'config.json'}")
    # Every problem at once, as the flag parser reports them: --save, config.json's settings that cannot
    # be expressed, then (when the sizes still give a model) every tensor missing, misshapen or left over.
    problems = adapter.problems()
    try:
        save = _fresh(save, "--save")
    except HFError as e:
        problems.insert(0, str(e))
    try:
        flags = [str(x) for x in adapter.flags()]
        args = _start(flags + list(grid_flags))
    except (HFError, ConfigError) as e:  # no model to map the tensors onto: what stops it is the problem
        raise _one_error(problems + [str(e).strip().removeprefix("- ")]) from None

    import torch.distributed as dist
    from torch.distributed.checkpoint.api import CheckpointException

    from cp_ext.hf.streaming import meta_model, save_streaming
    from cp_ext.arguments import model_args
    from cp_ext.checkpoint.common_state import checkpoint_meta
    from cp_ext.checkpoint.disk_format import iteration_dir, publish_root, write_meta, write_tracker
    from cp_ext.checkpoint.state import CONTENT_METADATA

    architecture = hf.config["architectures"][0]
    model = meta_model(args)
    problems += _mapping_problems(hf, adapter, model)
    if problems:
        raise _one_error(problems)
    rank0 = dist.get_rank() == 0
    tmp = _staging(save) if rank0 else save.with_name(save.name + ".partial")
    if rank0:
        iteration_dir(tmp, 0).mkdir()
    dist.barrier()
    current = {}  # the unit being written: its full tensor, read once for its chunks on this rank

    def materialize(unit, index):
        if current.get("unit") != unit:
            current.update(unit=unit, full=adapter.unit(hf, unit))
        return current["full"][index]

    try:
        save_streaming(model, iteration_dir(tmp, 0), materialize, content_metadata=CONTENT_METADATA)
    except CheckpointException as e:  # torch.distributed.checkpoint gathers every rank's failure
        failures = [f for f in e.failures.values() if isinstance(f, HFError)] or list(e.failures.values())
        if rank0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise HFError(str(failures[0]).strip().splitlines()[-1]) from None
    reads = _gather(sorted(adapter.used))  # what each rank read: the HF tensors of the chunks it wrote
    if rank0:
        meta = checkpoint_meta(args, 0, 0, 0, model_args(args))
        meta["weights_only"] = f"tools/convert_hf.py import of {hf.dir}"
        meta["hf_tensors_read"] = {"per_rank": [len(r) for r in reads], "distinct": len(set().union(*map(set, reads)))}
        write_meta(iteration_dir(tmp, 0), meta)
        write_tracker(tmp, 0)
        kept = tmp / HF_FILES
        kept.mkdir()
        for name in ("config.json",) + TOKENIZER_FILES:
            if (hf.dir / name).is_file():
                shutil.copy(hf.dir / name, kept / name)
        (kept / TENSORS).write_text(json.dumps(hf.stored_dtypes(), indent=1, sort_keys=True) + "\n")
        (tmp / MODEL_YAML).write_text(f"# {architecture} from {hf.dir} (tools/convert_hf.py import)\n"
                                      + "\n".join(yaml_lines(flags)) + "\n")
        publish_root(tmp, save)
    dist.barrier()
    return architecture


@dataclass
class Exported:
    """What `export_checkpoint` wrote."""

    tensors: int
    shards: int
    total_bytes: int
    quantization: Optional[dict]  # config.json's quantization_config: the import dequantized, the export drops it


def export_checkpoint(load, out, max_shard_bytes, hf_files=None) -> Exported:
    """``hf_files``: the directory with config.json and the tokenizer files (default: what the import kept in
    the checkpoint; a run that trained on from it saves elsewhere, so name the import's CKPT/hf).
    Streams: one layer's tensors are read from the checkpoint at a time (no model is built) and written
    into shards of at most ``max_shard_bytes``."""
    load = Path(load)
    out = _fresh(out, "--hf-dir")
    kept = Path(hf_files) if hf_files else load / HF_FILES
    config_path = kept / "config.json"
    if not config_path.is_file():
        raise HFError(f"{config_path} is missing: export needs the Hugging Face config.json that "
                      f"tools/convert_hf.py import keeps in CKPT/{HF_FILES}/; for a checkpoint trained on from an "
                      f"import, give --hf-files IMPORTED_CKPT/{HF_FILES}")
    config = json.loads(config_path.read_text())
    adapter = adapter_for(config, str(config_path))
    stored = json.loads((kept / TENSORS).read_text()) if (kept / TENSORS).is_file() else {}  # older imports: none
    adapter.import_names = frozenset(stored)
    args = _start(["--load", load, "--use-checkpoint-args", "--finetune"])

    import torch
    from safetensors.torch import save_file

    from cp_ext.hf.streaming import load_units, meta_model
    from cp_ext.checkpoint.disk_format import iteration_dir, latest_iteration, publish_root

    quantized = config.pop("quantization_config", None)  # the import dequantized: the export is not quantized
    dtype = getattr(torch, config.get("dtype") or config.get("torch_dtype") or "float32")
    tmp = _staging(out)
    shards, pending, pending_bytes, total = [], {}, 0, 0

    def flush():
        nonlocal pending, pending_bytes
        if pending:
            shards.append(sorted(pending))
            save_file(pending, tmp / f"part-{len(shards):05d}.safetensors", metadata={"format": "pt"})
            pending, pending_bytes = {}, 0

    try:
        for unit, full in load_units(meta_model(args), iteration_dir(load, latest_iteration(load))):
            for name, tensor in adapter.split(unit, full).items():
                if tensor.is_floating_point():  # an integer table (V4's tid2eid) keeps its integers
                    tensor = tensor.to(getattr(torch, stored[name]) if name in stored else dtype)
                tensor = tensor.contiguous()
                size = tensor.numel() * tensor.element_size()
                if pending_bytes + size > max_shard_bytes:
                    flush()
                pending[name] = tensor
                pending_bytes += size
                total += size
        flush()
        count, weight_map = len(shards), {}
        for i, names in enumerate(shards, start=1):  # Hugging Face's names: model-00001-of-00003.safetensors
            name = f"model-{i:05d}-of-{count:05d}.safetensors"
            (tmp / f"part-{i:05d}.safetensors").rename(tmp / name)
            weight_map.update({tensor: name for tensor in names})
        (tmp / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
        for name in TOKENIZER_FILES:
            if (kept / name).is_file():
                shutil.copy(kept / name, tmp / name)
        (tmp / "config.json").write_text(json.dumps(adapter.export_config(config), indent=2) + "\n")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    publish_root(tmp, out)
    return Exported(len(weight_map), count, total, quantized)
