"""Checkpointing flags (Megatron-LM's spelling): save, load, resume and fine-tune."""

from cp_ext.flag_types import POSITIVE


def add_checkpoint_args(parser):
    g = parser.add_argument_group("checkpointing")
    g.add_argument("--save", default=None, help="directory to save checkpoints to")
    g.add_argument("--save-interval", type=POSITIVE, default=None, help="iterations between checkpoints")
    g.add_argument("--load", default=None, help="directory to resume from (its latest checkpoint)")
    g.add_argument("--exit-interval", type=POSITIVE, default=None,
                   help="stop after the iteration that is a multiple of this (saving first if --save)")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="on SIGTERM (SLURM's time limit or preemption), finish the current iteration, save a "
                        "checkpoint (with --save) and exit 0; resume with --load")
    g.add_argument("--override-opt_param-scheduler", action="store_true",
                   help="on --load, train with this run's LR/WD schedule flags instead of the checkpoint's")
    g.add_argument("--use-checkpoint-opt_param-scheduler", action="store_true",
                   help="on --load, keep the checkpoint's LR/WD schedule (with neither flag, a changed schedule "
                        "is an error, as in Megatron-LM)")
    g.add_argument("--no-load-optim", action="store_true",
                   help="on --load, do not load the optimizer state (fresh Adam moments; this run's schedule)")
    g.add_argument("--no-load-rng", action="store_true", help="on --load, do not restore the RNG states")
    g.add_argument("--ckpt-fallback", action="store_true",
                   help="on --load, if the latest checkpoint cannot be read (truncated or corrupt), load the newest "
                        "earlier complete one instead, saying so")
    g.add_argument("--finetune", action="store_true",
                   help="on --load, load the weights only and start at iteration 0 (no optimizer, RNG, data position)")



def checkpoint_flag_problems(args):
    if args.save_interval is not None and not args.save:
        return [f"--save-interval {args.save_interval} needs --save DIR (where to save); add it or drop the flag"]
    return []
