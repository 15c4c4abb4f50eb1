"""What each part of training saves and loads: the state-dict protocol of cp_ext's checkpoints.

Every component answers three questions, and `cp_ext.checkpoint.checkpointer.Checkpointer`
only asks them (it never reaches into a component's fields)::

    state_dict(ctx)            what to save: plain values (rank 0's go to common.pt) and
                               megatron ShardedTensors/ShardedObjects (written where they live)
    sharded_state_dict_for_load(ctx)
                               what to read: the same global keys, shaped for *this* grid
    load_state_dict(state, ctx)
                               put what was read back in place

``ctx`` is a `CheckpointContext`: the model's sharded state dict (the optimizer keys its state by
the model's global parameter names) and, when loading, what the checkpoint says about itself.

Top-level keys follow Megatron-LM's `checkpointing.py`: ``model``, ``optimizer``,
``opt_param_scheduler``, ``iteration``, ``args`` (a Namespace with ``consumed_train_samples``),
``checkpoint_version``, ``rng_state`` (the keys and layout Megatron-LM's loader expects; not
verified by loading with Megatron-LM itself, which is not installed here).
"""

import argparse
from dataclasses import dataclass, field
from typing import Optional

import torch

from megatron.core import parallel_state
from megatron.core.dist_checkpointing.dict_utils import extract_matching_values, merge, nested_values
from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedBase, ShardedObject, ShardedTensorFactory
from megatron.core.optimizer.optimizer import param_group_identifier_keys

# Megatron-LM's metadata for `optimizer.sharded_state_dict` (its `_build_sharded_state_dict_metadata`
# with --dist-ckpt-optim-fully-reshardable): the distributed optimizer's state is written in model
# space, each parameter's Adam moments and fp32 main copy as tensors of the parameter's shape under
# `optimizer.state.<exp_avg|exp_avg_sq|param>.<global name>`, so it reshards to any TP/PP/EP/DP.
# The default `dp_reshardable` writes DP buckets and cannot change model parallelism.
CONTENT_METADATA = {
    "distrib_optim_sharding_type": "fully_reshardable",
    "singleton_local_shards": False,
    "chained_optim_avoid_prefix": True,
}
CHECKPOINT_VERSION = 3.0  # Megatron-LM's current version number for this layout


@dataclass
class CheckpointContext:
    model_sharded: dict = field(default_factory=dict)  # model.sharded_state_dict() of this run
    saved: Optional[dict] = None  # when loading: the checkpoint's meta.json (grid, optimizer kind, ...)
    saved_keys: frozenset = frozenset()  # when loading: every tensor key the checkpoint holds


class ModelState:
    """The model chunk's parameters, keyed by megatron's global names (`sharded_state_dict`)."""

    def __init__(self, model_chunk):
        self.chunk = model_chunk

    def state_dict(self, ctx):
        return {"model": ctx.model_sharded}

    sharded_state_dict_for_load = state_dict

    def load_state_dict(self, state, ctx):
        self.chunk.load_state_dict(state["model"])


def optimizer_kind(args):
    """How the optimizer holds its state: the distributed optimizer, megatron's mixed-precision
    optimizer (an fp32 copy of bf16 weights), or the plain fp32 one."""
    if args.use_distributed_optimizer:
        return "distributed"
    return "mixed" if args.bf16 else "fp32"


# Where each kind keeps its fp32 main parameters in the checkpoint; the plain fp32 optimizer's
# main parameters are the model weights themselves.
_MAIN_PARAM_PREFIXES = ("optimizer.state.param.", "optimizer.state.fp32_param.")


class OptimizerState:
    """Adam's moments and main parameters in model space, plus Adam's step and param-group values.

    The tensors go through megatron's own `sharded_state_dict` (with `CONTENT_METADATA`), so
    they are keyed by global parameter name whatever the grid and optimizer kind. The plain
    values (step, lr, weight decay, max_lr, ...) sit in common.pt in the *saving* run's layout,
    which depends on its optimizer kind and on how many optimizers megatron chained (dense and
    expert parameters get separate ones when EP > 1 or ETP differs from TP). So they are not
    merged blindly: `load_state_dict` moves them into this run's layout, matching param groups
    by their learning-rate and weight-decay multipliers as megatron does. Another optimizer kind
    reads the main parameters under the key the saving kind used (`_saved_main_param_key`).
    """

    # dist_checkpointing.load returns the checkpoint's plain values merged with what it read, each under
    # the key it was saved under. The plain optimizer values are in the *saving* run's layout, so this
    # run's tensors are requested under another top-level key, and the two never merge (what is read
    # depends on the tensors' global keys, not on where they sit in the request).
    LOADED = "optimizer (loaded tensors)"

    def __init__(self, optimizer, kind):
        self.optimizer, self.kind = optimizer, kind

    def state_dict(self, ctx):
        return {"optimizer": self.optimizer.sharded_state_dict(ctx.model_sharded, metadata=CONTENT_METADATA)}

    def sharded_state_dict_for_load(self, ctx):
        if self.kind == "distributed":
            _allocate_adam_state(self.optimizer)
        request = self.optimizer.sharded_state_dict(ctx.model_sharded, is_loading=True, metadata=CONTENT_METADATA)
        for sharded in nested_values(request):
            if isinstance(sharded, (ShardedBase, ShardedTensorFactory)):
                sharded.key = _saved_main_param_key(sharded.key, ctx.saved_keys)
        # Main params that megatron's fp32 optimizer never saved (its fp32 weights are their own):
        # not read; the distributed optimizer's are views of the weights the model loads.
        _, request = extract_matching_values(
            request, lambda v: isinstance(v, (ShardedBase, ShardedTensorFactory)) and v.key is None)
        # dist_checkpointing.load returns only what it read; keep this layout's plain values.
        self._plain, _ = extract_matching_values(
            request, lambda v: not isinstance(v, (ShardedBase, ShardedTensorFactory, LocalNonpersistentObject)))
        return {self.LOADED: request}

    def load_state_dict(self, state, ctx):
        section = merge(self._plain, state[self.LOADED])
        step, saved_groups = _saved_step_and_groups(state["optimizer"], ctx.saved["optimizer_kind"])
        by_multipliers = {_group_key(g): g for g in saved_groups}
        for sub in _per_optimizer(section):
            groups = _groups(sub, self.kind)
            for group in groups:
                saved = by_multipliers[_group_key(group)]
                # megatron's load pairs these groups with the live ones by its identifier keys (from 0.19 the
                # schedule's max_lr, min_lr, start_wd, end_wd too), so those keep this run's values until after it
                group.update({k: v for k, v in saved.items() if k not in ("params", "step", *param_group_identifier_keys)})
                if self.kind == "distributed":  # the distributed optimizer keeps Adam's step per group
                    group["step"] = step
            if self.kind != "distributed":  # megatron's other optimizers: one step for every parameter
                inner = sub["optimizer"] if self.kind == "mixed" else sub
                inner.setdefault("state", {})["common_step"] = torch.tensor(step)
        self.optimizer.load_state_dict(section)
        for group in self.optimizer.param_groups:  # the checkpoint's schedule values (0.19's identifiers)
            saved = by_multipliers[_group_key(group)]
            group.update({k: saved[k] for k in param_group_identifier_keys if k in saved and k != "is_expert_parallel"})


def _allocate_adam_state(optimizer):
    """Zero Adam state with step 0 where none exists yet (before the first step).

    Without apex or TransformerEngine, megatron's distributed optimizer reads Adam's step from
    torch's per-parameter state when it builds its state dict (`DistributedOptimizer.state_dict`
    asserts one step), and that state is empty until the first step; the values are overwritten
    by what the checkpoint holds."""
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = sub.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                if len(inner.state[p]) == 0:
                    inner.state[p].update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p.data),
                                          exp_avg_sq=torch.zeros_like(p.data))


def _saved_main_param_key(key, saved_keys):
    """The checkpoint's key for the main parameter `key` asks for (another optimizer kind saved it)."""
    prefix = next((p for p in _MAIN_PARAM_PREFIXES if key.startswith(p)), None)
    if prefix is None or key in saved_keys:
        return key
    name = key[len(prefix):]
    for candidate in (p + name for p in _MAIN_PARAM_PREFIXES):
        if candidate in saved_keys:
            return candidate
    return None if name in saved_keys else key  # None: saved by the fp32 optimizer, whose weights are its main params


def _per_optimizer(section):
    """megatron's ChainedOptimizer saves {index: section} when it chains several optimizers."""
    if isinstance(section, dict) and section and all(isinstance(k, int) for k in section):
        return [section[k] for k in sorted(section)]
    return [section]


def _groups(section, kind):
    """The param groups of one optimizer's state dict, in `kind`'s layout."""
    if kind == "distributed" or kind == "mixed":
        return section["optimizer"]["param_groups"]
    return section["param_groups"]


def _saved_step_and_groups(common, kind):
    """Adam's step and every param group the checkpoint's optimizers had (all share the step)."""
    subs = _per_optimizer(common)
    groups = [g for sub in subs for g in _groups(sub, kind)]
    if kind == "distributed":
        step = groups[0].get("step", 0)
    else:
        inner = subs[0]["optimizer"] if kind == "mixed" else subs[0]
        step = inner.get("state", {}).get("common_step", 0)
    return float(step.item() if torch.is_tensor(step) else step), groups


def _group_key(group):
    """megatron's param-group identity (`param_group_identifier_keys`) without is_expert_parallel,
    which changes with the grid (expert parameters join the dense optimizer at EP = 1)."""
    return tuple(group.get(k, group.get(f"pre_{k}")) for k in ("wd_mult", "lr_mult", "is_decoupled_lr"))


class SchedulerState:
    """megatron's OptimizerParamScheduler; `--override-opt_param-scheduler` is its own flag."""

    def __init__(self, scheduler, optimizer, args):
        self.scheduler, self.optimizer, self.args = scheduler, optimizer, args

    def state_dict(self, ctx):
        return {"opt_param_scheduler": self.scheduler.state_dict()}

    def sharded_state_dict_for_load(self, ctx):
        return {}  # plain values: read from common.pt

    def load_state_dict(self, state, ctx):
        if self.args.override_opt_param_scheduler:
            # megatron's param groups carry their own max_lr / min_lr, restored with the optimizer
            # just now, and its scheduler reads those before its own: give them this run's values.
            for group in self.optimizer.param_groups:
                group["max_lr"], group["min_lr"] = self.args.lr, self.args.min_lr
        self.scheduler.load_state_dict(state["opt_param_scheduler"])  # keeps or overrides per the flags


class RunState:
    """Where training stands: iteration and consumed samples (the data position), and the args."""

    def __init__(self, trainer):
        self.trainer = trainer

    def state_dict(self, ctx):
        args = {k: v for k, v in vars(self.trainer.args).items()
                if isinstance(v, (int, float, str, bool, type(None))) or
                (isinstance(v, list) and all(isinstance(x, (int, float, str)) for x in v))}
        args.update(consumed_train_samples=self.trainer.consumed_samples, consumed_valid_samples=0)
        return {"iteration": self.trainer.iteration, "args": argparse.Namespace(**args),
                "checkpoint_version": CHECKPOINT_VERSION, "num_floating_point_operations_so_far": 0}

    def sharded_state_dict_for_load(self, ctx):
        return {}

    def load_state_dict(self, state, ctx):
        self.trainer.iteration = state["iteration"]
        self.trainer.consumed_samples = state["args"].consumed_train_samples


def _rng_grid():
    """(PP, TP, DP×CP) sizes and this rank's place: Megatron-LM's per-rank `rng_state` layout
    (its --data-parallel-random-init form), one entry per rank of the world."""
    sizes = (parallel_state.get_pipeline_model_parallel_world_size(),
             parallel_state.get_tensor_model_parallel_world_size(),
             parallel_state.get_data_parallel_world_size(with_context_parallel=True))
    ranks = (parallel_state.get_pipeline_model_parallel_rank(),
             parallel_state.get_tensor_model_parallel_rank(),
             parallel_state.get_data_parallel_rank(with_context_parallel=True))
    return sizes, ranks


class RngState:
    """Every rank's torch, CUDA and megatron tracker RNG states (they matter with dropout).

    Restored when the grid is the one that saved them; another grid starts its RNG from --seed
    (the weights, optimizer and data position still resume exactly)."""

    def state_dict(self, ctx):
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        rng = {"random_rng_state": torch.get_rng_state(),
               "cuda_rng_state": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
               "rng_tracker_states": get_cuda_rng_tracker().get_states()}
        sizes, ranks = _rng_grid()
        return {"rng_state": ShardedObject("rng_state", [rng], sizes, ranks, replica_id=0)}

    def sharded_state_dict_for_load(self, ctx):
        if not self.same_grid(ctx):
            return {}
        return self.state_dict(ctx)

    @staticmethod
    def grid():
        return list(_rng_grid()[0])

    @classmethod
    def same_grid(cls, ctx):
        return cls.grid() == ctx.saved.get("rng_grid")

    def load_state_dict(self, state, ctx):
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        if "rng_state" not in state:
            return
        rng = state["rng_state"][0]
        torch.set_rng_state(rng["random_rng_state"])
        if rng["cuda_rng_state"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda_rng_state"])
        get_cuda_rng_tracker().set_states(rng["rng_tracker_states"])

