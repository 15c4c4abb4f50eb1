"""Checkpoints: atomic save, exact resume, loadable at another CP (or DP) size.

megatron-core's dist_checkpointing did not finish saving on CPU/gloo within minutes
(shared/MEGATRON_ON_CPU.md), so cp_ext writes per-rank files in Megatron-LM's legacy
layout, with Megatron's tracker file::

    SAVE/
      latest_checkpointed_iteration.txt          "100": the last *complete* checkpoint
      iter_0000100/
        mp_rank_00_000_ep000_etp00/model_optim_rng.pt   one per (TP, PP, EP, ETP) rank
        meta.json                                the saving run's TP, PP, EP, ETP sizes
        rng/rank_00003.pt                        every global rank's RNG states

Parameters are sharded by TP, PP and EP (ETP) only; CP and DP hold replicas. So the
lowest global rank of each (TP, PP, EP, ETP) shard writes it, and a run with another
CP or DP size reads the same files (RNG files are per global
rank and are skipped when the world changed; they matter only with dropout).

Atomicity: every rank writes into ``iter_XXXXXXX.tmp``; after a barrier rank 0 renames
the directory and then replaces the tracker file (write + fsync + ``os.replace``). A
kill at any moment leaves the previous checkpoint and the tracker pointing at it intact.
"""

import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from megatron.core import parallel_state

from cp_ext.training.logging import print_rank_0

TRACKER = "latest_checkpointed_iteration.txt"
META = "meta.json"  # the saving run's model-parallel sizes, read before anything is built
SHARDING_FLAGS = {
    "tensor_model_parallel_size": "--tensor-model-parallel-size",
    "pipeline_model_parallel_size": "--pipeline-model-parallel-size",
    "expert_model_parallel_size": "--expert-model-parallel-size",
    "expert_tensor_parallel_size": "--expert-tensor-parallel-size",
}


def _iter_dir(root, iteration):
    return Path(root) / f"iter_{iteration:07d}"


def _shard_name():
    return (
        f"mp_rank_{parallel_state.get_tensor_model_parallel_rank():02d}_"
        f"{parallel_state.get_pipeline_model_parallel_rank():03d}_"
        f"ep{parallel_state.get_expert_model_parallel_rank():03d}_"
        f"etp{parallel_state.get_expert_tensor_parallel_rank():02d}"
    )


def _is_writer():
    """The lowest global rank of each (TP, PP, EP, ETP) shard writes it (collective)."""
    names = [None] * dist.get_world_size()
    dist.all_gather_object(names, _shard_name())
    return names.index(_shard_name()) == dist.get_rank()


def _rng_state():
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    return {"torch": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def _fsync_write(path, text):
    tmp = Path(str(path) + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_checkpoint(trainer, root):
    """Save model, optimizer, LR scheduler, RNG, iteration and consumed samples (collective)."""
    iteration = trainer.iteration
    final, tmp = _iter_dir(root, iteration), Path(str(_iter_dir(root, iteration)) + ".tmp")
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # debris of a save that was killed
        (tmp / "rng").mkdir(parents=True)
        meta = {name: getattr(trainer.args, name) for name in SHARDING_FLAGS}
        (tmp / META).write_text(json.dumps({"iteration": iteration, **meta}, indent=1))
    dist.barrier()
    if _is_writer():
        state = {
            "model": trainer.model[0].module.state_dict(),
            "optimizer": trainer.optimizer.state_dict(),
            "scheduler": trainer.scheduler.state_dict(),
            "iteration": iteration,
            "consumed_samples": trainer.consumed_samples,
            "args": {k: v for k, v in vars(trainer.args).items() if isinstance(v, (int, float, str, bool, list, type(None)))},
        }
        (tmp / _shard_name()).mkdir(exist_ok=True)
        torch.save(state, tmp / _shard_name() / "model_optim_rng.pt")
    torch.save({"world_size": dist.get_world_size(), "rng": _rng_state()}, tmp / "rng" / f"rank_{dist.get_rank():05d}.pt")
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        _fsync_write(Path(root) / TRACKER, f"{iteration}\n")
        print_rank_0(f"saved checkpoint at iteration {iteration} to {final}")
    dist.barrier()


def latest_iteration(root):
    tracker = Path(root) / TRACKER
    if not tracker.exists():
        return None
    text = tracker.read_text().strip()
    if not text.isdigit():
        raise RuntimeError(f"--load {root}: {TRACKER} holds {text!r}, not an iteration number")
    return int(text)


def layout_problems(root, args):
    """Why the latest checkpoint under `root` cannot load with `args` (checked at parse time)."""
    iteration = latest_iteration(root)
    if iteration is None:
        return []
    meta_file = _iter_dir(root, iteration) / META
    if not meta_file.exists():
        return [f"--load {root}: {meta_file} is missing; the checkpoint is incomplete or not a cp_ext checkpoint"]
    saved = json.loads(meta_file.read_text())
    return [
        f"--load {root}: the checkpoint was saved with {flag} {saved[name]}, this run has {getattr(args, name)}; "
        f"checkpoints load at any CP/DP size but need the saving run's TP, PP, EP and ETP"
        for name, flag in SHARDING_FLAGS.items()
        if saved[name] != getattr(args, name)
    ]


def load_checkpoint(trainer, root):
    """Restore the latest checkpoint under `root` into `trainer`; returns its iteration (0: none)."""
    iteration = latest_iteration(root)
    if iteration is None:
        print_rank_0(f"--load {root}: no checkpoint there yet ({TRACKER} missing); starting from scratch")
        return 0
    directory = _iter_dir(root, iteration)
    shard = directory / _shard_name() / "model_optim_rng.pt"
    if not shard.exists():
        raise RuntimeError(
            f"--load {root}: {shard} is missing; checkpoints load at any CP/DP size but need the "
            f"saving run's --tensor-model-parallel-size, --pipeline-model-parallel-size and "
            f"--expert-model-parallel-size"
        )
    state = torch.load(shard, map_location="cpu", weights_only=False)
    trainer.model[0].module.load_state_dict(state["model"])
    trainer.optimizer.load_state_dict(state["optimizer"])
    trainer.scheduler.load_state_dict(state["scheduler"])
    trainer.iteration = state["iteration"]
    trainer.consumed_samples = state["consumed_samples"]
    rng_file = directory / "rng" / f"rank_{dist.get_rank():05d}.pt"
    if rng_file.exists():
        rng = torch.load(rng_file, map_location="cpu", weights_only=False)
        if rng["world_size"] == dist.get_world_size():
            _restore_rng(rng["rng"])
    print_rank_0(f"loaded checkpoint of iteration {iteration} from {directory}")
    return iteration


def _restore_rng(rng):
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    torch.set_rng_state(rng["torch"])
    get_cuda_rng_tracker().set_states(rng["tracker"])
    if rng["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
