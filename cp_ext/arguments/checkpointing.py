"""Checkpointing flags (Megatron-LM's spelling): save, load, resume and fine-tune."""

import os
import sys
from pathlib import Path

from cp_ext.flag_types import POSITIVE, number


def add_checkpoint_args(parser):
    g = parser.add_argument_group("checkpointing")
    g.add_argument("--save", default=None, help="directory to save checkpoints to")
    g.add_argument("--save-interval", "--persistent-save-interval", type=POSITIVE, default=None,
                   help="iterations between (persistent) checkpoints")
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
    add_save_mode_args(parser)


CKPT_FORMATS = ("torch", "torch_dist", "torch_dcp", "fsdp_dtensor")  # Megatron-LM's choices; cp_ext writes torch_dist
STRICTNESS = ("assume_ok_unexpected", "log_unexpected", "log_all", "raise_unexpected", "raise_all",
              "return_unexpected", "return_all", "ignore_all")  # megatron-core's StrictHandling values


def add_save_mode_args(parser):
    """How checkpoints are written and read: Megatron-LM's flags, spelling and meaning."""
    g = parser.add_argument_group("checkpoint writing")
    g.add_argument("--ckpt-format", default="torch_dist", choices=CKPT_FORMATS,
                   help="checkpoint format; cp_ext reads and writes torch_dist (megatron-core's distributed "
                        "checkpoint, reshardable to any grid), Megatron-LM's default")
    g.add_argument("--async-save", action="store_true",
                   help="write checkpoints in the background while training goes on (megatron-core's async "
                        "save); a checkpoint is published (meta.json, tracker) only once every rank's write has "
                        "finished, checked every iteration")
    g.add_argument("--use-persistent-ckpt-worker", action="store_true",
                   help="Megatron-LM's: with --async-save, one long-lived writer process per rank instead of one "
                        "forked per save; it needs a GPU (its worker selects a CUDA device), so on a CPU host the "
                        "forked writer is used, said once")
    g.add_argument("--no-ckpt-fully-parallel-save", dest="ckpt_fully_parallel_save", action="store_false",
                   help="write each replicated tensor from its first replica's rank instead of spreading the "
                        "writes over the DP×CP group (Megatron-LM's fully parallel save, the default)")
    g.add_argument("--ckpt-fully-parallel-save", dest="ckpt_fully_parallel_save_deprecated", action="store_true",
                   help="deprecated in Megatron-LM, no effect: fully parallel save is the default")
    g.add_argument("--ckpt-fully-parallel-load", action="store_true",
                   help="each rank of the DP×CP group reads a share of the replicated tensors and they are "
                        "exchanged (broadcast), instead of every rank reading all it needs")
    g.add_argument("--ckpt-assume-constant-structure", action="store_true",
                   help="the state to save has the same structure at every save: the save plan and the fully "
                        "parallel distribution are computed at the first save and reused")
    g.add_argument("--dist-ckpt-strictness", default="assume_ok_unexpected", choices=STRICTNESS,
                   help="what a load does when the checkpoint and this run differ in their tensors "
                        "(megatron-core's StrictHandling): raise_* refuse, log_* say and load what matches, "
                        "return_* count them, ignore_all loads what matches silently")
    g.add_argument("--non-persistent-save-interval", type=POSITIVE, default=None,
                   help="iterations between non-persistent checkpoints (cheap, frequent, only the newest kept); "
                        "needs --non-persistent-ckpt-type")
    g.add_argument("--non-persistent-ckpt-type", default=None, choices=("global", "local", "in_memory"),
                   help="global: a checkpoint like the persistent ones, in --non-persistent-global-ckpt-dir "
                        "(default SAVE/non_persistent); local: each rank's part in its node's "
                        "--non-persistent-local-ckpt-dir (nvidia-resiliency-ext); in_memory is not supported, "
                        "as in Megatron-LM")
    g.add_argument("--non-persistent-global-ckpt-dir", default=None,
                   help="where global non-persistent checkpoints go (default: SAVE/non_persistent)")
    g.add_argument("--non-persistent-local-ckpt-dir", default=None,
                   help="a node-local directory (SSD, ramdisk) for local non-persistent checkpoints")
    g.add_argument("--non-persistent-local-ckpt-algo", default="fully_parallel", choices=("fully_parallel", "atomic"),
                   help="fully_parallel: each replicated tensor written by one rank of DP×CP, exchanged on load; "
                        "atomic: every rank writes all it holds")



def checkpoint_flag_problems(args):
    problems = []
    if args.save_interval is not None and not args.save:
        problems.append(f"--save-interval {args.save_interval} needs --save DIR (where to save); add it or drop the flag")
    if args.ckpt_format != "torch_dist":
        what = "--async-save needs" if args.async_save else "cp_ext reads and writes"
        problems.append(f"--ckpt-format {args.ckpt_format}: {what} --ckpt-format torch_dist (megatron-core's "
                        f"distributed checkpoint, Megatron-LM's default); give that or drop the flag")
    problems += _non_persistent_problems(args)
    return problems


def has_local_checkpoints():
    """Whether nvidia-resiliency-ext's local checkpoint manager is installed: found, not imported (it imports
    torch; parse time stays light)."""
    import importlib.util

    spec = importlib.util.find_spec("nvidia_resiliency_ext")
    return spec is not None and any(
        Path(location, "checkpointing", "local", "ckpt_managers", "local_manager.py").exists()
        for location in (spec.submodule_search_locations or []))


def _non_persistent_problems(args):
    kind, interval = args.non_persistent_ckpt_type, args.non_persistent_save_interval
    if kind is None:
        if interval is not None:
            return [f"--non-persistent-save-interval {interval} needs --non-persistent-ckpt-type global or local "
                    f"(where the non-persistent checkpoints go)"]
        return []
    if kind == "in_memory":
        return ["--non-persistent-ckpt-type in_memory is not supported (nor by Megatron-LM); give global (a "
                "directory) or local (a node-local directory)"]
    if interval is None:
        return [f"--non-persistent-ckpt-type {kind} needs --non-persistent-save-interval N (how often to save one)"]
    if kind == "global" and not (args.non_persistent_global_ckpt_dir or args.save):
        return ["--non-persistent-ckpt-type global needs --non-persistent-global-ckpt-dir DIR, or --save DIR "
                "(they then go to DIR/non_persistent)"]
    if kind == "local":
        if not args.non_persistent_local_ckpt_dir:
            return ["--non-persistent-ckpt-type local needs --non-persistent-local-ckpt-dir DIR (a node-local "
                    "directory: an SSD or a ramdisk)"]
        if not has_local_checkpoints():
            return ["--non-persistent-ckpt-type local writes through nvidia-resiliency-ext's local checkpoints, "
                    "which is not installed: pip install nvidia-resiliency-ext (or use --non-persistent-ckpt-type "
                    "global)"]
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
