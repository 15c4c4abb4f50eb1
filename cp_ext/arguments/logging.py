"""Logging flags: the run directory (metrics.jsonl, config.yaml), wandb and TensorBoard."""

import importlib.util
import os

from cp_ext.flag_types import POSITIVE

# Flags that only mean something with --tensorboard-dir (Megatron-LM ignores them without it).
TENSORBOARD_SWITCHES = ("log_validation_ppl_to_tensorboard", "log_timers_to_tensorboard")


def add_logging_args(parser):
    g = parser.add_argument_group("logging")
    g.add_argument("--log-dir", default=None,
                   help="run directory for metrics.jsonl and config.yaml (default runs/<exp name or time>)")
    g.add_argument("--wandb-project", default=None, help="log to wandb (WANDB_MODE=offline/disabled respected)")
    g.add_argument("--wandb-exp-name", default=None, help="wandb run name; also names the default --log-dir")
    g.add_argument("--wandb-save-dir", default=None, help="wandb's directory (default: the run directory)")
    g.add_argument("--wandb-entity", default=None)
    # Megatron-LM's TensorBoard flags, with its scalar names (cp_ext.training.tensorboard).
    g.add_argument("--tensorboard-dir", default=None,
                   help="write TensorBoard event files here (rank 0; Megatron-LM's scalar names: lm loss, "
                        "learning-rate, grad-norm, batch-size, load_balancing_loss, lm loss validation, ...)")
    g.add_argument("--tensorboard-log-interval", type=POSITIVE, default=1,
                   help="write the training scalars every N iterations")
    g.add_argument("--tensorboard-queue-size", type=POSITIVE, default=1000,
                   help="events the writer queues before one of its writes flushes them to disk")
    g.add_argument("--log-validation-ppl-to-tensorboard", action="store_true",
                   help="also write the validation perplexity (lm loss validation ppl)")
    g.add_argument("--log-timers-to-tensorboard", action="store_true",
                   help="also write iteration-time (seconds per iteration, averaged over --log-interval)")


def logging_problems(args):
    """--tensorboard-dir must be a directory rank 0 can create or write to, checked before any work
    (a run that trains for hours and then cannot open its event file has lost its curves)."""
    problems = []
    if args.tensorboard_dir is None:
        given = [name for name in TENSORBOARD_SWITCHES if getattr(args, name)]
        if given:
            flags = " and ".join("--" + name.replace("_", "-") for name in given)
            problems.append(f"{flags} need{'s' if len(given) == 1 else ''} --tensorboard-dir DIR (where to write the "
                            f"events); add it or drop the flag")
        return problems
    problem = _directory_problem(args.tensorboard_dir)
    if problem:
        problems.append(f"--tensorboard-dir {args.tensorboard_dir}: {problem}")
    elif importlib.util.find_spec("tensorboard") is None:
        problems.append("--tensorboard-dir needs the tensorboard package (pip install tensorboard), "
                        "a dependency of cp_ext; install it or drop the flag")
    return problems


def _directory_problem(path):
    """Why `path` cannot be used as a directory to write into (None when it can); creates nothing."""
    path = os.path.abspath(path)
    if os.path.exists(path):
        if not os.path.isdir(path):
            return "is a file, not a directory; give a directory"
        if not os.access(path, os.W_OK | os.X_OK):
            return "is not writable by this user; give a directory you can write to"
        return None
    parent = os.path.dirname(path)
    while not os.path.exists(parent):  # the nearest existing ancestor decides whether it can be made
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"cannot be created: {parent} is a file; give a directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"cannot be created: {parent} is not writable by this user; give a directory you can write to"
    return None
