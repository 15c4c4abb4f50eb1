"""What a checkpoint says about itself beside its tensors: meta.json (read before any model exists), and the
common state as the ranks compare it before rank 0 writes it."""

import argparse

import torch.distributed as dist

from cp_ext import MEGATRON_CORE_VERSION
from cp_ext.checkpoint.disk_format import MODEL_FLAGS, SCHEDULE_FLAGS
from cp_ext.checkpoint.state import RngState, optimizer_kind
from cp_ext.grid import Grid


def checkpoint_meta(args, iteration, consumed_samples, train_samples, model_args):
    """meta.json: what parse-time checks and a loading run need before reading any tensor (also written by
    tools/convert_hf.py's import, which trains nothing: 0 and 0). ``model_args``: every model flag of
    the run (`cp_ext.arguments.model_args`), what --use-checkpoint-args gives a loading run."""
    return {"iteration": iteration, "format": "torch_dist", "megatron_core": MEGATRON_CORE_VERSION,
            "world_size": dist.get_world_size(),
            "grid": {**Grid.from_args(args, world_size=dist.get_world_size()).as_meta(),
                     "use_distributed_optimizer": args.use_distributed_optimizer},
            "optimizer_kind": optimizer_kind(args), "rng_grid": RngState.grid(),
            "schedule": {name: getattr(args, name) for name in SCHEDULE_FLAGS},
            "model": {name: getattr(args, name) for name in MODEL_FLAGS},
            "model_args": model_args,
            # DSA's dense warm-up: its optimizer state covers the indexer's parameters only
            "dsa_dense_warmup": bool(getattr(args, "dsa_dense_warmup", False)),
            # the data position, and the length the train dataset's sample order was built for
            "consumed_samples": consumed_samples, "train_samples": train_samples}


# Flags whose value is one rank's own: rank 0's is saved, and the ranks are not expected to agree on them (the
# default --log-dir is stamped with each rank's own clock; rank 0's logs are the run's).
RANK_OWN_ARGS = ("log_dir", "rank", "local_rank")


def comparable_common_state(common):
    """The common state as megatron compares it across ranks before rank 0 saves it (as Megatron-LM's
    ``preprocess_common_state_dict``): ``args`` as a dict, less the flags that are each rank's own."""
    compared = dict(common)
    if isinstance(compared.get("args"), argparse.Namespace):
        compared["args"] = {k: v for k, v in vars(compared["args"]).items() if k not in RANK_OWN_ARGS}
    return compared
