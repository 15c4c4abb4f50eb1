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

Atomicity: every rank writes into ``iter_XXXXXXX.tmp`` and fsyncs its files; after a barrier
rank 0 fsyncs the directories, renames the directory and then replaces the tracker file
(write + fsync + ``os.replace``). A kill at any moment leaves the previous checkpoint and the
tracker pointing at it intact.

Nothing is lost (checked at parse time, `checkpoint_problems`): a ``--save`` directory that
holds a checkpoint newer than where the run starts (e.g. ``--load`` at a wrong path) is an
error, never a tracker rolled back; ``--save`` must be a writable directory. Files load with
``weights_only=True`` and errors name the file. Megatron's resume flags:
``--override-opt_param-scheduler`` / ``--use-checkpoint-opt_param-scheduler`` (with neither, a
changed LR schedule is an error), ``--no-load-optim``, ``--no-load-rng``, ``--finetune``.
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
# The LR / weight-decay schedule a checkpoint was trained with (meta.json), compared at parse
# time as Megatron's OptimizerParamScheduler compares them at load time.
SCHEDULE_FLAGS = {
    "lr": "--lr", "min_lr": "--min-lr", "lr_warmup_iters": "--lr-warmup-iters",
    "lr_decay_iters": "--lr-decay-iters", "lr_decay_style": "--lr-decay-style", "weight_decay": "--weight-decay",
}
# What decides the parameters' shapes: a checkpoint of another shape is refused at parse time.
MODEL_FLAGS = {
    "num_layers": "--num-layers", "hidden_size": "--hidden-size", "ffn_hidden_size": "--ffn-hidden-size",
    "num_attention_heads": "--num-attention-heads", "num_query_groups": "--num-query-groups",
    "kv_channels": "--kv-channels", "num_experts": "--num-experts", "moe_ffn_hidden_size": "--moe-ffn-hidden-size",
    "normalization": "--normalization", "swiglu": "--swiglu",
    "untie_embeddings_and_output_weights": "--untie-embeddings-and-output-weights",
    "vocab_size": "--vocab-size", "make_vocab_size_divisible_by": "--make-vocab-size-divisible-by",
}
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


def _durable_save(obj, path):
    """torch.save, then fsync: the bytes are on disk before the directory is renamed into place."""
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_checkpoint_file(path):
    """torch.load with ``weights_only=True`` (no pickled code runs), and errors that name the file."""
    import pickle
    import zipfile

    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise RuntimeError(f"{path}: refused to load: it holds objects other than tensors and plain data "
                           f"(checkpoints load with weights_only=True, so a crafted file cannot run code): "
                           f"{str(e).splitlines()[0]}") from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError) as e:
        size = Path(path).stat().st_size if Path(path).exists() else 0
        raise RuntimeError(f"{path}: unreadable checkpoint file (truncated or corrupt? {size} bytes): "
                           f"{str(e).splitlines()[0]}; load an earlier iteration (its directory's "
                           f"iteration number in {TRACKER})") from None


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
        schedule = {name: getattr(trainer.args, name) for name in SCHEDULE_FLAGS}
        model = {name: getattr(trainer.args, name) for name in MODEL_FLAGS}
        (tmp / META).write_text(json.dumps({"iteration": iteration, **meta, "schedule": schedule, "model": model},
                                           indent=1))
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
        _durable_save(state, tmp / _shard_name() / "model_optim_rng.pt")
    _durable_save({"world_size": dist.get_world_size(), "rng": _rng_state()}, tmp / "rng" / f"rank_{dist.get_rank():05d}.pt")
    dist.barrier()
    if dist.get_rank() == 0:
        for directory in [*tmp.iterdir(), tmp]:  # the shard directories' entries, then the checkpoint's
            if directory.is_dir():
                _fsync_dir(directory)
        if final.exists():  # only this run's own earlier save of this iteration (checked at startup)
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(Path(root))
        _fsync_write(Path(root) / TRACKER, f"{iteration}\n")
        print_rank_0(f"saved checkpoint at iteration {iteration} to {final}")
    dist.barrier()


LOCK = ".cp_ext_save.lock"


def _pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def acquire_save_lock(root):
    """One job saves into a directory at a time (collective; call before building the model).

    Rank 0 creates ``root/.cp_ext_save.lock`` naming its host and pid (``O_EXCL``). A lock whose
    process is gone from this host is stale and taken over; a live one, or one from another host,
    stops every rank with exit status 2 and one message naming the other job. Released by
    `release_save_lock` (and left behind only by a killed job, where it is stale).
    """
    import socket
    import sys

    problem = None
    if dist.get_rank() == 0:
        root = Path(root)
        root.mkdir(parents=True, exist_ok=True)
        lock, me = root / LOCK, {"host": socket.gethostname(), "pid": os.getpid()}
        for _ in range(2):
            try:
                fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                try:
                    other = json.loads(lock.read_text())
                except (OSError, ValueError):
                    other = {}
                if other.get("host") == me["host"] and isinstance(other.get("pid"), int) and not _pid_alive(other["pid"]):
                    lock.unlink(missing_ok=True)  # a killed job's lock: take it over
                    continue
                problem = (f"--save {root}: another job is saving there (host {other.get('host', '?')}, pid "
                           f"{other.get('pid', '?')}, lock file {lock}); give this run its own --save directory, "
                           f"or delete the lock file if that job is gone")
                break
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
            break
    decision = [problem]
    dist.broadcast_object_list(decision, src=0)
    if decision[0] is not None:
        if dist.get_rank() == 0:
            print(f"pretrain_moe.py: configuration error:\n  - {decision[0]}", file=sys.stderr, flush=True)
        sys.exit(2)


def release_save_lock(root):
    if dist.get_rank() == 0:
        lock = Path(root) / LOCK
        try:
            if json.loads(lock.read_text()).get("pid") == os.getpid():
                lock.unlink()
        except (OSError, ValueError):
            pass


def latest_iteration(root):
    tracker = Path(root) / TRACKER
    if not tracker.exists():
        return None
    text = tracker.read_text().strip()
    if not text.isdigit():
        raise RuntimeError(f"--load {root}: {TRACKER} holds {text!r}, not an iteration number")
    return int(text)


def _load_path_problems(args):
    root = Path(args.load)
    if root.exists() and not root.is_dir():
        return [f"--load {root} is a file; give the checkpoint directory (the one holding {TRACKER})"]
    if latest_iteration(root) is None and root.name.startswith("iter_") and (root.parent / TRACKER).exists():
        return [f"--load {root} is one iteration's directory; give its parent, --load {root.parent} (it resumes "
                f"from the iteration in {TRACKER})"]
    return []


def _save_problems(args, start_iteration):
    """--save must be a writable directory that holds no checkpoint newer than where this run starts."""
    root = Path(args.save)
    if root.exists() and not root.is_dir():
        return [f"--save {root} is a file, not a directory; give a directory for the checkpoints"]
    existing = root if root.exists() else next((p for p in root.parents if p.exists()), None)
    if existing is None or not os.access(existing, os.W_OK | os.X_OK):
        return [f"--save {root}: {existing} is not writable; choose a directory this job can write"]
    _warn_if_disk_is_short(args, existing)
    saved = latest_iteration(root) if root.exists() else None
    if saved is not None and saved > start_iteration:
        how = (f"--load {args.load} starts at iteration {start_iteration}" if args.load and start_iteration
               else "this run starts at iteration 0" + (f" (--load {args.load} holds no checkpoint)" if args.load else ""))
        return [f"--save {root} already holds a checkpoint of iteration {saved} and {how}: its saves would roll "
                f"{TRACKER} back and replace newer checkpoints. Resume it with --load {root}, or save to a new "
                f"directory"]
    return []


def checkpoint_bytes_estimate(args):
    """One checkpoint's bytes, all ranks together (`cp_ext.perf.memory`): fp32 weights + Adam's
    two moments (+ the fp32 main copy of bf16 weights, which the optimizer state holds)."""
    from cp_ext.perf.memory import ModelShape, total_params

    shape = ModelShape(layers=args.num_layers, hidden=args.hidden_size, heads=args.num_attention_heads,
                       kv_heads=args.num_query_groups, ffn=args.ffn_hidden_size,
                       vocab=args.vocab_size or 32000, experts=args.num_experts or 0, topk=args.moe_router_topk,
                       moe_ffn=args.moe_ffn_hidden_size, swiglu=args.swiglu,
                       tied_embeddings=not args.untie_embeddings_and_output_weights)
    return total_params(shape) * (4 + 8 + (4 if args.bf16 else 0))


def _warn_if_disk_is_short(args, directory):
    """A warning, not an error, on rank 0: the estimate is rough and the disk may be freed meanwhile."""
    if int(os.environ.get("RANK", "0")) != 0:
        return
    need, free = checkpoint_bytes_estimate(args), shutil.disk_usage(directory).free
    if free < need:
        import sys

        print(f"pretrain_moe.py: warning: --save {args.save}: {free / 2**30:.1f} GiB free on its disk, one "
              f"checkpoint needs about {need / 2**30:.1f} GiB (planner estimate)", file=sys.stderr, flush=True)


def checkpoint_problems(args):
    """Everything about --load / --save that is wrong before any process group exists (parse time)."""
    p = []
    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        p.append("--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler contradict each other; "
                 "give one")
    start = 0
    if args.load:
        p.extend(_load_path_problems(args))
        if not p:
            iteration = latest_iteration(args.load)
            start = 0 if iteration is None or args.finetune else iteration
            if iteration is not None:
                p.extend(layout_problems(args.load, args))
    elif args.finetune:
        p.append("--finetune needs --load (the checkpoint whose weights to start from)")
    if args.save:
        p.extend(_save_problems(args, start))
    return p


def layout_problems(root, args):
    """Why the latest checkpoint under `root` cannot load with `args` (checked at parse time)."""
    iteration = latest_iteration(root)
    if iteration is None:
        return []
    meta_file = _iter_dir(root, iteration) / META
    if not meta_file.exists():
        return [f"--load {root}: {meta_file} is missing; the checkpoint is incomplete or not a cp_ext checkpoint"]
    saved = json.loads(meta_file.read_text())
    model = saved.get("model")  # absent in checkpoints written before it was recorded
    if model:
        changed = [f"{flag} {getattr(args, name)} (checkpoint: {model[name]})"
                   for name, flag in MODEL_FLAGS.items() if name in model and model[name] != getattr(args, name)]
        if changed:
            return [f"--load {root}: the checkpoint is of another model: {', '.join(changed)}; give the saving "
                    f"run's model flags (its config.yaml in the run's --log-dir lists them)"]
    p = [
        f"--load {root}: the checkpoint was saved with {flag} {saved[name]}, this run has {getattr(args, name)}; "
        f"checkpoints load at any CP/DP size but need the saving run's TP, PP, EP and ETP"
        for name, flag in SHARDING_FLAGS.items()
        if saved[name] != getattr(args, name)
    ]
    schedule = saved.get("schedule")  # absent in checkpoints written before it was recorded
    resumes_schedule = not (args.finetune or args.no_load_optim or args.override_opt_param_scheduler
                            or args.use_checkpoint_opt_param_scheduler)
    if schedule and resumes_schedule:
        changed = [f"{flag} {getattr(args, name)} (checkpoint: {schedule[name]})"
                   for name, flag in SCHEDULE_FLAGS.items() if name in schedule and schedule[name] != getattr(args, name)]
        if changed:
            p.append(f"--load {root}: the learning-rate schedule differs from the checkpoint's: {', '.join(changed)}. "
                     f"Add --override-opt_param-scheduler to train with the new values, or "
                     f"--use-checkpoint-opt_param-scheduler to keep the checkpoint's (as in Megatron-LM)")
    return p


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
    state = read_checkpoint_file(shard)
    args = trainer.args
    trainer.model[0].module.load_state_dict(state["model"])
    if args.finetune:  # Megatron's --finetune: the weights only, from iteration 0
        print_rank_0(f"--finetune: loaded the weights of iteration {iteration} from {directory}; starting at iteration 0")
        return 0
    if not args.no_load_optim:
        trainer.optimizer.load_state_dict(state["optimizer"])
        if args.override_opt_param_scheduler:
            # megatron's param groups carry their own max_lr / min_lr, restored from the checkpoint
            # just now, and its scheduler reads those before its own: give them this run's values.
            for group in trainer.optimizer.param_groups:
                group["max_lr"], group["min_lr"] = args.lr, args.min_lr
        trainer.scheduler.load_state_dict(state["scheduler"])  # keeps or overrides per the two flags
    else:  # Megatron's --no-load-optim: fresh optimizer state, the new schedule from this iteration on
        trainer.scheduler.step(increment=state["iteration"])
    trainer.iteration = state["iteration"]
    trainer.consumed_samples = state["consumed_samples"]
    rng_file = directory / "rng" / f"rank_{dist.get_rank():05d}.pt"
    if rng_file.exists() and not args.no_load_rng:
        rng = read_checkpoint_file(rng_file)
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
