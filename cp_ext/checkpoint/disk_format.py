"""The checkpoint directory on disk, with no torch or megatron: what a path, the tracker and meta.json
mean, and how a finished checkpoint is published atomically. Everything that reads or writes a
checkpoint directory (training, the parse-time checks, tools/convert_hf.py) goes through here.

    SAVE/
      latest_checkpointed_iteration.txt   "100": the last *complete* checkpoint (Megatron-LM's tracker)
      iter_0000100/
        metadata.json, .metadata          dist_checkpointing's: backend, content metadata, tensor index
        common.pt                         plain values (rank 0): iteration, args, scheduler, Adam step
                                          (megatron-core 0.19 writes them into the .distcp files instead)
        __<rank>_<i>.distcp               tensors: model, Adam moments, main params, RNG per rank
        meta.json                         cp_ext's summary (`META_SCHEMA`), read at parse time before any
                                          model exists

Atomicity (`publish`): everything is written into a staging directory; its files and directories are
fsynced, it is renamed into place, and then the tracker is replaced (write + fsync + ``os.replace``).
A kill at any moment leaves the previous checkpoint, and the tracker pointing at it, intact.
"""

import json
import os
import time
from pathlib import Path

from cp_ext.grid import GRID_FLAGS as GRID_SIZE_FLAGS
from cp_ext.perf.model_shape import SHAPE_FLAGS

TRACKER = "latest_checkpointed_iteration.txt"
META = "meta.json"  # cp_ext's summary of a checkpoint, read before anything is built
TENSOR_INDEX = "metadata.json"  # dist_checkpointing's: present once its writers finished

# meta.json's schema, by section: which flags each records.
# The LR / weight-decay schedule a checkpoint was trained with, compared at parse time as Megatron's
# OptimizerParamScheduler compares them at load time.
SCHEDULE_FLAGS = {
    "lr": "--lr", "min_lr": "--min-lr", "lr_warmup_iters": "--lr-warmup-iters",
    "lr_decay_iters": "--lr-decay-iters", "lr_decay_style": "--lr-decay-style", "weight_decay": "--weight-decay",
}
# What decides the parameters' shapes: a checkpoint of another shape is refused at parse time. The
# planner's model description (`cp_ext.perf.model_shape`) names them; MLA's YaRN values too (not
# shapes, but what the weights were trained to mean).
MODEL_FLAGS = {**SHAPE_FLAGS, "rotary_scaling_factor": "--rotary-scaling-factor", "mscale": "--mscale",
               "mscale_all_dim": "--mscale-all-dim",
               "yarn_original_max_position_embeddings": "--yarn-original-max-position-embeddings",
               "yarn_beta_fast": "--yarn-beta-fast", "yarn_beta_slow": "--yarn-beta-slow",
               # DeepSeek-V4's parts (a hash layer's table, a layer's compressor, the streams) exist or not by these
               **{name: "--" + name.replace("_", "-") for name in (
                   "csa_compress_ratios", "csa_compress_ratio_for_c", "csa_compress_ratio_for_h", "csa_window_size",
                   "csa_no_attention_sink", "csa_dense_mode", "o_groups", "o_lora_rank", "dsa_indexer_n_heads",
                   "dsa_indexer_head_dim", "enable_hyper_connections", "num_residual_streams", "moe_n_hash_layers")}}
# The grid it was saved at (`cp_ext.grid.Grid.as_meta`) and the optimizer's sharding.
GRID_FLAGS = (*GRID_SIZE_FLAGS.values(), "use_distributed_optimizer")


def iteration_dir(root, iteration):
    return Path(root) / f"iter_{iteration:07d}"


def staging_dir(root, iteration):
    """Where a save of ``iteration`` is written before `publish` renames it into place."""
    return Path(root) / f"iter_{iteration:07d}.tmp"


def remove_staging_debris(root):
    """Staging directories a killed or failed save left in ``root`` (never a published checkpoint): removed by
    the run that holds the save lock, before it trains, so a disk they filled has room again. Returns their
    names."""
    import shutil

    debris = sorted(p for p in Path(root).glob("iter_*.tmp") if p.is_dir())
    for path in debris:
        shutil.rmtree(path, ignore_errors=True)
    return [p.name for p in debris]


NON_PERSISTENT_SUBDIR = "non_persistent"  # Megatron-LM's: where global non-persistent checkpoints go by default


def non_persistent_dir(args, root):
    """Where --non-persistent-ckpt-type global checkpoints live: --non-persistent-global-ckpt-dir, else
    ``non_persistent`` under ``root`` (the --save or --load directory), as Megatron-LM places them."""
    if args.non_persistent_global_ckpt_dir:
        return Path(args.non_persistent_global_ckpt_dir)
    return None if root is None else Path(root) / NON_PERSISTENT_SUBDIR


def remove_older_iterations(root, iteration):
    """Delete the published checkpoints under ``root`` older than ``iteration`` (non-persistent ones: only
    the newest is kept). Returns their names."""
    import shutil

    older = [d for d in Path(root).glob("iter_*") if d.is_dir() and d.name[5:].isdigit() and int(d.name[5:]) < iteration]
    for path in older:
        shutil.rmtree(path, ignore_errors=True)
    return sorted(p.name for p in older)


def latest_iteration(root):
    """The tracker's iteration, or None where there is no tracker (or no ``root``)."""
    if root is None:
        return None
    tracker = Path(root) / TRACKER
    if not tracker.exists():
        return None
    text = tracker.read_text().strip()
    if not text.isdigit():
        raise RuntimeError(f"--load {root}: {TRACKER} holds {text!r}, not an iteration number")
    return int(text)


def is_complete(directory):
    """Both the tensor index and meta.json are there: the writers finished and the checkpoint was published."""
    return (Path(directory) / META).exists() and (Path(directory) / TENSOR_INDEX).exists()


def complete_iterations(root):
    """Iterations under `root` whose directory holds a finished checkpoint, newest first."""
    found = []
    for d in Path(root).glob("iter_*"):
        if d.is_dir() and d.name[5:].isdigit() and is_complete(d):
            found.append(int(d.name[5:]))
    return sorted(found, reverse=True)


def meta_to_load(root, fallback):
    """(iteration, meta.json) of the checkpoint a --load of `root` will read, or None if there is none.

    The latest one; with --ckpt-fallback (`fallback`) and its meta.json missing, the newest complete one."""
    iteration = latest_iteration(root)
    if iteration is None:
        return None
    meta_file = iteration_dir(root, iteration) / META
    if not meta_file.exists() and fallback and complete_iterations(root):
        iteration = complete_iterations(root)[0]
        meta_file = iteration_dir(root, iteration) / META
    if not meta_file.exists():
        return iteration, None
    return iteration, read_meta(meta_file.parent)


def read_meta(directory):
    return json.loads((Path(directory) / META).read_text())


def write_meta(directory, meta):
    (Path(directory) / META).write_text(json.dumps(meta, indent=1))


def fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(directory):
    """Every file, then every directory, bottom up: the bytes are on disk before the rename."""
    for dirpath, _, filenames in os.walk(directory, topdown=False):
        for name in filenames:
            with open(os.path.join(dirpath, name), "rb+") as f:
                os.fsync(f.fileno())
        fsync_dir(dirpath)


def write_durably(path, text):
    """``text`` into ``path`` all or nothing: a temporary file, fsynced, then renamed over it."""
    tmp = Path(str(path) + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_tracker(root, iteration):
    """Point the tracker at ``iteration`` (all or nothing)."""
    write_durably(Path(root) / TRACKER, f"{iteration}\n")


def publish_root(staged, root):
    """Make the staged directory ``staged`` ``root``, which must be absent or empty: fsynced, then renamed
    into place. tools/convert_hf.py writes a whole checkpoint (tracker included) this way, and an export."""
    root = Path(root)
    fsync_tree(staged)
    if root.exists():
        root.rmdir()  # empty, or this raises: nothing is overwritten
    os.replace(staged, root)
    fsync_dir(root.parent)


def publish(staged, root, iteration, replaceable=False):
    """Make the staged checkpoint directory ``staged`` iteration ``iteration`` of ``root``, and the latest.

    Its contents are fsynced, it is renamed to ``iter_XXXXXXX``, then the tracker is replaced. A directory
    already there is deleted only when ``replaceable`` (this run's own earlier save of the iteration);
    another run's is moved aside, never deleted. Returns a note on what was moved aside, or None."""
    final, note = iteration_dir(root, iteration), None
    fsync_tree(staged)
    if final.exists():
        if replaceable:
            import shutil

            shutil.rmtree(final)
        else:  # another run's (after --ckpt-fallback, say): kept beside, never deleted
            aside = final.with_name(f"{final.name}.replaced-{int(time.time())}")
            os.replace(final, aside)
            note = f"{final} existed (not saved by this run): moved to {aside}"
    os.replace(staged, final)
    fsync_dir(Path(root))
    write_tracker(root, iteration)
    return note
