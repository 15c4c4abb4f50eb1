"""Checkpointing flags (Megatron-LM's spelling): save, load, resume and fine-tune."""

import os
import sys

from cp_ext.flag_types import POSITIVE, number


def add_checkpoint_args(parser):
    g = parser.add_argument_group("checkpointing")
    g.add_argument("--save", default=None, help="directory to save checkpoints to")
    g.add_argument("--save-interval", type=POSITIVE, default=None, help="iterations between checkpoints")
    g.add_argument("--load", default=None, help="directory to resume from (its latest checkpoint)")
    g.add_argument("--exit-interval", type=POSITIVE, default=None,
                   help="stop after the iteration that is a multiple of this (saving first if --save)")
    g.add_argument("--exit-duration-in-mins", type=number(float, 0, above=True), default=None,
                   help="stop after the iteration that ends this many minutes after the run started (saving first "
                        "if --save), as Megatron-LM's; a fraction of a minute is accepted")
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
    g.add_argument("--use-checkpoint-args", action="store_true",
                   help="Megatron-LM's: the model flags the --load checkpoint was saved with (its meta.json) "
                        "override the command line's; give only grid and training flags")
    g.add_argument("--finetune", action="store_true",
                   help="on --load, load the weights only and start at iteration 0 (no optimizer, RNG, data position)")



def checkpoint_flag_problems(args):
    if args.save_interval is not None and not args.save:
        return [f"--save-interval {args.save_interval} needs --save DIR (where to save); add it or drop the flag"]
    return []


# What --use-checkpoint-args carries (as Megatron-LM's load_args_from_checkpoint): every flag of these
# option groups, less those that choose an implementation or a training knob rather than the model.
MODEL_ARG_GROUPS = ("network size", "attention", "mixture of experts")
NOT_MODEL_ARGS = {"attention_backend", "attention_kernel", "use_flash_attn", "attention_softmax_in_fp32",
                  "cp_mla_exchange", "moe_token_dispatcher_type", "moe_grouped_gemm", "moe_shared_expert_overlap",
                  "moe_layer_recompute", "moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_router_bias_update_rate",
                  "mtp_loss_scaling_factor", "dsa_indexer_loss_coeff", "dsa_indexer_use_sparse_loss", "dsa_dense_warmup", "hidden_dropout", "attention_dropout", "bf16", "init_method_std"}
# Restored only where the run does not give them (Megatron-LM's ``_set_arg`` without force): the sequence a
# run trains or scores on may differ from the checkpoint's, but unset they are the checkpoint's, so a
# learned position table is built at the size it was saved with.
UNLESS_GIVEN = ("seq_length", "max_position_embeddings")


def apply_checkpoint_args(args, parser, tokens):
    """--use-checkpoint-args: the --load checkpoint's model flags onto ``args`` (before the derived
    defaults are filled), as Megatron-LM's ``load_args_from_checkpoint``: every flag that shapes a tensor,
    and --seq-length / --max-position-embeddings where the run gives none (`UNLESS_GIVEN`); the problems,
    if it cannot. ``tokens``: the run's flags. A value the command line gave that the checkpoint overrides
    is said once, on rank 0 (Megatron-LM's flag overrides silently)."""
    if not args.use_checkpoint_args:
        return []
    if not args.load:
        return ["--use-checkpoint-args reads the model flags of the --load checkpoint: add --load DIR"]
    from cp_ext.checkpoint.disk_format import meta_to_load

    found = meta_to_load(args.load, args.ckpt_fallback)
    meta = (found[1] or {}) if found else {}
    model = {**meta.get("model", {}), **meta.get("model_args", {})}  # shapes; all model flags where recorded
    if not model:
        return [f"--use-checkpoint-args: --load {args.load} holds no checkpoint with its model flags (meta.json); "
                f"give the model flags (or --config FILE.yaml) instead"]
    actions = parser._option_string_actions  # the flags this run gave (command line and --config YAML)
    given = {actions[t.split("=", 1)[0]].dest for t in tokens if t.split("=", 1)[0] in actions}
    model = {name: value for name, value in model.items() if not (name in UNLESS_GIVEN and name in given)}
    overridden = [f"{name} {getattr(args, name)!r} -> {value!r}" for name, value in model.items()
                  if name in given and getattr(args, name) != value]
    if overridden and os.environ.get("RANK", "0") == "0":
        print(f"note: --use-checkpoint-args: the checkpoint's model flags override the command line's: "
              f"{', '.join(overridden)}", file=sys.stderr)
    for name, value in model.items():
        setattr(args, name, value)
    return []
