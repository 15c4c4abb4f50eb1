"""Parse-time checks on --load and --save: everything about checkpoints that is wrong is said
before any process group or model exists (`cp_ext.arguments` calls `checkpoint_problems`).

Nothing is lost: a ``--save`` directory that holds a checkpoint newer than where the run starts
(e.g. ``--load`` at a wrong path) is an error, never a tracker rolled back; ``--save`` must be a
writable directory with room for a checkpoint (else a warning). A checkpoint of another model
shape is refused listing the differing flags; a changed LR schedule needs Megatron's
``--override-opt_param-scheduler`` or ``--use-checkpoint-opt_param-scheduler``. Another grid or
optimizer kind is fine: checkpoints reshard (`cp_ext.checkpoint.checkpointer`).
"""

import os
import shutil
from pathlib import Path

from cp_ext.checkpoint.disk_format import (
    MODEL_FLAGS, META, SCHEDULE_FLAGS, TRACKER, iteration_dir, latest_iteration, meta_to_load,
)




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
    from cp_ext.perf.model_shape import ModelShape, total_params

    shape = ModelShape.from_args(args)
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
        try:
            import psutil  # noqa: F401  megatron-core's checkpoint writers need it (pip install psutil)
        except ImportError:
            p.append("--save needs the psutil package (megatron-core's checkpoint writers use it): pip install psutil")
    return p


def megatron_core_problem(root, iteration, saved):
    """Why this megatron-core cannot read the checkpoint another one wrote (None if it can; a checkpoint
    written by a newer one that reads is said once, as a note). meta.json names the writer from cp_ext
    0.1 on megatron-core 0.17+; checkpoints without the field were written by 0.16.1."""
    from cp_ext import MEGATRON_CORE_VERSION as running
    from cp_ext.megatron_compat import unreadable_reason
    from cp_ext.megatron_version import at_least

    writer = saved.get("megatron_core") or "0.16.1"
    if unreadable_reason(iteration_dir(root, iteration)):
        return (f"--load {root}: iteration {iteration} was written by megatron-core {writer}, which keeps the "
                f"checkpoint's plain values inside its torch_dist files (no common.pt); megatron-core {running}, "
                f"installed here, cannot read that form. Load it with megatron-core 0.19 or later (pip install "
                f"'megatron-core>=0.19,<0.20', Python 3.12), or with 0.16.1")
    if writer != running and at_least(writer, running) and os.environ.get("RANK", "0") == "0":
        import sys

        print(f"note: --load {root}: iteration {iteration} was written by megatron-core {writer}; reading it with "
              f"{running}", file=sys.stderr, flush=True)
    return None


def _dsa_stage_problem(root, iteration, saved, args):
    """A checkpoint of DSA's dense warm-up (optimizer state for the indexer only) resumed by a run that trains
    every parameter, or the other way round: the optimizer states do not match the parameters."""
    warmup = bool(getattr(args, "dsa_dense_warmup", False))
    if bool(saved.get("dsa_dense_warmup")) == warmup or args.finetune or args.no_load_optim:
        return None
    if saved.get("dsa_dense_warmup"):
        return (f"--load {root}: iteration {iteration} was written by DSA's dense warm-up (--dsa-dense-warmup), whose "
                f"optimizer state holds the indexer's parameters only; add --no-load-optim to continue into sparse "
                f"training with every parameter (the weights, iteration and data position load; the optimizer "
                f"starts fresh)")
    return (f"--load {root}: iteration {iteration} trained every parameter, and --dsa-dense-warmup trains the "
            f"indexer only: add --no-load-optim (a fresh optimizer for the indexer), or drop --dsa-dense-warmup")


def layout_problems(root, args):
    """Why the latest checkpoint under `root` cannot load with `args` (checked at parse time).

    Not the grid or the optimizer kind: a checkpoint loads at any of them."""
    found = meta_to_load(root, args.ckpt_fallback)
    if found is None:
        return []
    iteration, saved = found
    if saved is None:
        return [f"--load {root}: {iteration_dir(root, iteration) / META} is missing; the checkpoint is incomplete or "
                f"not a cp_ext checkpoint"
                f"{'' if args.ckpt_fallback else ' (--ckpt-fallback loads the newest complete one instead)'}"]
    if saved.get("format") != "torch_dist":
        return [f"--load {root}: iteration {iteration} was written by an earlier cp_ext in per-rank files "
                f"(mp_rank_*/model_optim_rng.pt), which this version does not read; resume it with the cp_ext "
                f"that wrote it, or start a new --save directory"]
    version_problem = megatron_core_problem(root, iteration, saved)
    if version_problem:
        return [version_problem]
    model = saved.get("model")  # absent in checkpoints written before it was recorded
    if model:
        changed = [f"{flag} {getattr(args, name)} (checkpoint: {model[name]})"
                   for name, flag in MODEL_FLAGS.items() if name in model and model[name] != getattr(args, name)]
        if changed:
            return [f"--load {root}: the checkpoint is of another model: {', '.join(changed)}; give the saving "
                    f"run's model flags (its config.yaml in the run's --log-dir lists them)"]
    p = []
    if saved.get("weights_only") and not args.finetune:
        # tools/convert_hf.py's import writes weights only: no optimizer state, schedule or data position
        p.append(f"--load {root}: the checkpoint holds weights only ({saved['weights_only']}); add --finetune to "
                 f"start from them at iteration 0 (Megatron-LM's meaning)")
    if iteration > args.train_iters and not args.finetune and not args.skip_train:
        p.append(f"--train-iters {args.train_iters} is below the checkpoint's iteration {iteration} (--load {root}): "
                 f"there is nothing left to train; raise --train-iters above {iteration} to train on, or add "
                 f"--finetune to start a new run from its weights")
    stage_problem = _dsa_stage_problem(root, iteration, saved, args)
    if stage_problem:
        p.append(stage_problem)
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
