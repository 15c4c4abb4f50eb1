"""Command line and YAML configuration, in Megatron-LM's flag spellings, and their validation.

Precedence: built-in defaults < ``--config FILE.yaml`` < flags on the command line.
YAML keys are the flag names without the leading dashes, with ``-`` or ``_``
(``num-layers: 4`` or ``num_layers: 4``); an unknown key is an error, not a silent no-op.

The flags come in option groups by concern, as Megatron-LM groups its arguments, each module
with its flags, the defaults that depend on other flags, and its rules:

    network      cp_ext.arguments.network          shape, GQA, norms, activations, biases, positions
    attention    cp_ext.arguments.attention        kernel, qk-norm, windows, sinks, MLA
    MoE          cp_ext.arguments.moe              experts, layer pattern, shared experts, router
    parallelism  cp_ext.arguments.parallel         TP x PP x CP x DP (x EP), Ulysses x ring, device
    training     cp_ext.arguments.training         batches, schedule, Adam, recompute
    data         cp_ext.arguments.data             datasets, splits, evaluation, tokenizer, documents
    logging      cp_ext.arguments.logging          run directory, wandb, TensorBoard
    checkpoints  cp_ext.arguments.checkpointing    save, load, exits (interval, duration, signal)
    SLURM        cp_ext.arguments.slurm            requeue without --save, a step's nodes against torchrun's
    (others)     cp_ext.arguments.implementations  numerically equal implementation choices

`validate_args` checks the whole grid before any process group or model exists, and reports
every problem at once, each naming the flags and the fix.
"""

import os
import sys
import time

from cp_ext import __version__
from cp_ext.arguments.attention import ATTENTION_BACKENDS  # noqa: F401 (re-exported)
from cp_ext.arguments.attention import add_attention_group, attention_problems, fill_attention_defaults
from cp_ext.arguments.data import add_data_args, data_problems, evaluation_splits, split_weights  # noqa: F401 (re-exported)
from cp_ext.arguments.checkpointing import (
    MODEL_ARG_GROUPS, NOT_MODEL_ARGS, UNLESS_GIVEN, add_checkpoint_args, apply_checkpoint_args, checkpoint_flag_problems,
)
from cp_ext.arguments.dynamic_cp import dynamic_cp_problems, fill_dynamic_cp_defaults
from cp_ext.arguments.implementations import add_implementation_args, modelopt_flags, modelopt_problem
from cp_ext.arguments.logging import add_logging_args, logging_problems
from cp_ext.arguments.moe import add_moe_args, fill_moe_defaults, moe_problems
from cp_ext.arguments.network import add_network_args, fill_network_defaults, network_problems
from cp_ext.arguments.parallel import add_parallel_args, fill_parallel_defaults, parallel_problems, runs_on_cpu
from cp_ext.arguments.slurm import requeue_warning, slurm_problems
from cp_ext.arguments.training import add_recompute_args, add_training_args, fill_training_defaults, training_problems
from cp_ext.arguments.yaml_config import read_yaml, yaml_tokens
from cp_ext.console import exit_with_config_error  # noqa: F401 (re-exported: tools import it from here)
from cp_ext.errors import ConfigError
from cp_ext.megatron_version import versions_line
from cp_ext.flag_types import FRACTION, NON_NEGATIVE, POSITIVE, ArgumentParser, RunArgs, number  # noqa: F401 (re-exported)

ALL_GROUPS = (add_network_args, add_attention_group, add_moe_args, add_parallel_args, add_training_args,
              add_recompute_args, add_data_args, add_logging_args, add_checkpoint_args, add_implementation_args)


def build_parser():
    parser = ArgumentParser(
        prog="pretrain_moe.py",
        allow_abbrev=False,  # as in Megatron-LM: --num-layer is a typo, not --num-layers
        description="Train a MoE GPT with megatron-core and cp_ext (Megatron-LM flag names).",
    )
    parser.add_argument("--config", default=None, help="YAML file of defaults; flags override it")
    parser.add_argument("--version", action="version", version=versions_line(__version__),
                        help="print the versions of cp_ext, megatron-core, torch and Python, and exit")
    for add in ALL_GROUPS:
        add(parser)
    return parser


def parse_args(argv=None, world_size=None):
    """Parse flags (+ YAML), fill derived values and validate; the result is frozen. Raises ConfigError."""
    argv = sys.argv[1:] if argv is None else list(argv)
    post_training = modelopt_flags(argv)
    if post_training:  # before argparse, which would call them unrecognized
        raise ConfigError(f"  - {modelopt_problem(post_training)}")
    parser = build_parser()
    pre, _ = parser.parse_known_args(argv)
    # YAML first, the command line after it: a flag given twice takes its last value.
    tokens = yaml_tokens(parser, pre.config, read_yaml(pre.config), build_parser) if pre.config else []
    args = parser.parse_args(tokens + argv, namespace=RunArgs())
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    args.world_size = world_size
    problems = apply_checkpoint_args(args, parser, tokens + argv)  # the checkpoint's model flags, before what derives from them
    if problems:
        raise ConfigError("\n".join(f"  - {p}" for p in problems))
    _fill_derived(args)
    problems = validate_args(args)
    if problems:
        raise ConfigError("\n".join(f"  - {p}" for p in problems))
    warning = requeue_warning(args)
    if warning:
        print(warning, flush=True)
    return args.freeze()


def _fill_derived(args):
    """Defaults that depend on other flags (every value here is >= 1 already: `number`)."""
    fill_network_defaults(args)
    fill_moe_defaults(args)
    fill_parallel_defaults(args)
    fill_training_defaults(args)
    fill_attention_defaults(args)
    fill_dynamic_cp_defaults(args)
    if args.use_flash_attn and args.attention_backend == "auto" and not runs_on_cpu(args):
        args.attention_kernel = "flash"  # Megatron-LM's legacy --use-flash-attn, where a flash kernel runs
    if args.log_dir is None:  # read by rank 0 only (metrics.jsonl, config.yaml, wandb)
        args.log_dir = os.path.join("runs", args.wandb_exp_name or time.strftime("run-%Y%m%d-%H%M%S"))


def model_args(args):
    """The model's own flags (dest: value) of a parsed run, for meta.json and --use-checkpoint-args."""
    parser = build_parser()
    dests = {action.dest for group in parser._action_groups if group.title in MODEL_ARG_GROUPS
             for action in group._group_actions}
    dests = (dests - NOT_MODEL_ARGS) | set(UNLESS_GIVEN)
    return {dest: getattr(args, dest) for dest in sorted(dests) if hasattr(args, dest)}


def validate_args(args):
    """Every problem with the grid and shapes, as messages that name flags and fixes."""
    p = parallel_problems(args) + network_problems(args) + moe_problems(args)
    p += attention_problems(args) + training_problems(args) + data_problems(args) + checkpoint_flag_problems(args)
    p += logging_problems(args) + dynamic_cp_problems(args) + slurm_problems(args)
    if (args.load or args.save or args.finetune) and not p:
        from cp_ext.checkpoint.checks import checkpoint_problems

        p.extend(checkpoint_problems(args))
    return p


def single_process_without_torchrun():
    """``python pretrain_moe.py ...`` (or a tool) runs as one rank, as torchrun --nproc-per-node 1 would.

    MASTER_PORT 0: the one rank's TCPStore listens on a port the OS picks when it binds, so no other
    process can take it in between (a port chosen free, released and bound later can be)."""
    if "RANK" in os.environ or "WORLD_SIZE" in os.environ:
        return
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="0")


def parse_args_or_exit(argv=None):
    """`parse_args`, but a ConfigError prints once (rank 0) and exits with status 2 on every rank."""
    try:
        return parse_args(argv)
    except ConfigError as e:
        exit_with_config_error("pretrain_moe.py", e)



# What other modules import from here (the flag types and data helpers live in their own modules).
__all__ = ["ATTENTION_BACKENDS", "ConfigError", "FRACTION", "NON_NEGATIVE", "POSITIVE", "RunArgs", "number",
           "build_parser", "evaluation_splits", "exit_with_config_error", "model_args", "parse_args", "parse_args_or_exit",
           "single_process_without_torchrun", "split_weights", "validate_args"]
