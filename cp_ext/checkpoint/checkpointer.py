"""Checkpoints: megatron-core's dist_checkpointing (``torch_dist``), one logical checkpoint that
loads at any grid, written atomically.

Why dist_checkpointing: every tensor is stored once under its global name (megatron's
``sharded_state_dict`` keys, the ones cp_ext's layout-invariant init already uses) with its
shard's place in the full tensor, so a checkpoint written at one TP×PP×CP×DP×EP layout, with or
without ``--use-distributed-optimizer``, loads at any other, in the layout and key names
Megatron-LM's loader expects. Its save once "did not finish" on CPU/gloo: megatron-core 0.16's writer processes
call ``psutil`` (not one of its dependencies) outside their error handling, die, and leave the
parent waiting on a queue forever; cp_ext depends on psutil.

What each part of training saves is its own business (`cp_ext.checkpoint.state`); this module
decides what to save and load (Megatron's --no-load-optim, --no-load-rng, --finetune) and makes it
durable. The tensors are written by every rank in parallel, replicas spread over the DP×CP group
(megatron's fully parallel save), so each rank writes about 1/(DP×CP) of them. The directory, the
tracker, meta.json and the atomic publish are `cp_ext.checkpoint.disk_format`'s; the parse-time checks on
--load/--save are `cp_ext.checkpoint.checks`'.
"""

import argparse
import pickle
import shutil

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.dict_utils import merge
from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

from cp_ext import MEGATRON_CORE_VERSION
from cp_ext.checkpoint.disk_format import (
    META, MODEL_FLAGS, SCHEDULE_FLAGS, TENSOR_INDEX, TRACKER, complete_iterations, iteration_dir,
    latest_iteration, publish, read_meta, staging_dir, write_meta,
)
from cp_ext.checkpoint.state import (
    CONTENT_METADATA,
    CheckpointContext,
    ModelState,
    OptimizerState,
    RngState,
    RunState,
    SchedulerState,
    optimizer_kind,
)
from cp_ext.console import print_rank_0
from cp_ext.grid import Grid
from cp_ext.errors import ConfigError
from cp_ext.megatron_compat import load_checkpoint


def _in_process_write_results():
    """megatron's torch_dist writer hands its results back through a queue that lives in a
    *spawned* multiprocessing Manager, made for its asynchronous save. That server process
    outlives a rank that is killed (kill -9, OOM) and keeps the job's stdout and stderr open, so
    the launcher never sees the job end. cp_ext saves synchronously, in the training process:
    a plain queue carries the results and no server process is started."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


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


class Checkpointer:
    """Saves and loads the trainer's components (`cp_ext.checkpoint.state`) under --save / --load.

    ``trainer``: what the components read (model, optimizer, scheduler, iteration, data position);
    ``model_args``: the run's model flags, recorded in meta.json."""

    def __init__(self, trainer, model_args):
        self.trainer, self.args, self.model_args = trainer, trainer.args, model_args
        self.components = {
            "model": ModelState(trainer.model[0].module),
            "optimizer": OptimizerState(trainer.optimizer, optimizer_kind(trainer.args)),
            "scheduler": SchedulerState(trainer.scheduler, trainer.optimizer, trainer.args),
            "run": RunState(trainer),
            "rng": RngState(),
        }
        self._save_strategy = None
        self._saved_here = set()  # iterations this run saved (rank 0): the only ones a save may replace

    @classmethod
    def for_weights(cls, model_chunk, args, model_args):
        """A checkpointer that loads a model's weights only, as --finetune does (generation, the tools
        that need a model, not a run): no optimizer, schedule, iteration or RNG state to restore."""
        self = cls.__new__(cls)
        self.trainer, self.args, self.model_args = None, args, model_args
        self.components = {"model": ModelState(model_chunk)}
        self._save_strategy, self._saved_here = None, set()
        return self

    def _context(self, **kw):
        return CheckpointContext(model_sharded=self.components["model"].chunk.sharded_state_dict(), **kw)

    def _strategy(self):
        """torch_dist, with replicas' writes spread over DP×CP (Megatron-LM's --ckpt-fully-parallel-save);
        the distribution is computed once and reused by later saves."""
        if self._save_strategy is None:
            _in_process_write_results()
            self._save_strategy = FullyParallelSaveStrategyWrapper(
                dist_checkpointing.serialization.get_default_save_sharded_strategy(),
                parallel_state.get_data_parallel_group(with_context_parallel=True),
                do_cache_distribution=True,
            )
        return self._save_strategy

    def meta(self, iteration):
        return checkpoint_meta(self.args, iteration, self.trainer.consumed_samples, len(self.trainer.dataset),
                               self.model_args)

    def save(self, root):
        """Save every component at the trainer's iteration (collective). A rank that cannot write (a full
        disk, a quota, an I/O error) fails the save on every rank alike: `CheckpointWriteError`, naming the
        directory and the cause, with the staging directory removed and the tracker left where it was."""
        iteration = self.trainer.iteration
        final, tmp = iteration_dir(root, iteration), staging_dir(root, iteration)
        failure = None
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # debris of a save that was killed
            try:
                tmp.mkdir(parents=True)
            except OSError as e:
                failure = e
        _agree_on_write(failure, root, iteration, tmp)
        ctx = self._context()
        state = {}
        for component in self.components.values():
            state.update(component.state_dict(ctx))
        try:
            dist_checkpointing.save(state, str(tmp), sharded_strategy=self._strategy(),
                                    content_metadata=CONTENT_METADATA)
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - every rank hears of it before any stops
            failure = e  # (torch's CheckpointException, what a failed write raises, is a BaseException)
        _agree_on_write(failure, root, iteration, tmp)  # every rank's files are written (and fsynced)
        if dist.get_rank() == 0:
            try:
                write_meta(tmp, self.meta(iteration))
                note = publish(tmp, root, iteration, replaceable=iteration in self._saved_here)
            except OSError as e:
                failure = e
        _agree_on_write(failure, root, iteration, tmp)
        if dist.get_rank() == 0:
            if note:
                print_rank_0(note)
            self._saved_here.add(iteration)
            print_rank_0(f"saved checkpoint at iteration {iteration} to {final}")
        dist.barrier()

    def _to_load(self):
        """Which components this run restores (Megatron-LM's --finetune, --no-load-optim, --no-load-rng)."""
        args = self.args
        if args.finetune or self.trainer is None:
            return ["model"]
        names = ["model", "run"]
        if not args.no_load_optim:
            names += ["optimizer", "scheduler"]
        if not args.no_load_rng:
            names.append("rng")
        return names

    def load(self, root):
        """Restore the latest checkpoint under `root` (with --ckpt-fallback, the newest one that reads)."""
        iteration = latest_iteration(root)
        if iteration is None:
            print_rank_0(f"--load {root}: no checkpoint there yet ({TRACKER} missing); starting from scratch")
            return 0
        candidates = [iteration] + [i for i in complete_iterations(root) if i < iteration]
        for n, candidate in enumerate(candidates):
            try:
                return self._load_iteration(root, candidate)
            except CheckpointReadError as e:
                if not self.args.ckpt_fallback or n + 1 == len(candidates):
                    hint = ("" if self.args.ckpt_fallback else
                            "; add --ckpt-fallback to load the newest earlier checkpoint that reads")
                    raise CheckpointReadError(f"{e}{hint}") from None
                print_rank_0(f"--ckpt-fallback: {e}; trying iteration {candidates[n + 1]}")

    def _load_iteration(self, root, iteration):
        args, directory = self.args, iteration_dir(root, iteration)
        meta_file = directory / META
        if not (directory / TENSOR_INDEX).exists() or not meta_file.exists():
            raise CheckpointReadError(f"{directory}: not a complete cp_ext torch_dist checkpoint "
                                      f"({TENSOR_INDEX if meta_file.exists() else META} missing)")
        saved = read_meta(directory)
        names = self._to_load()
        cross_kind = "optimizer" in names and saved["optimizer_kind"] != optimizer_kind(args)
        torch.serialization.add_safe_globals([argparse.Namespace])  # Megatron-LM's `args` in common.pt
        try:
            saved_tensors = dist_checkpointing.load_tensors_metadata(str(directory))
            ctx = self._context(saved=saved, saved_keys=frozenset(saved_tensors))
            request = {}
            for name in names:
                merge(request, self.components[name].sharded_state_dict_for_load(ctx))
            mismatches = shape_mismatches(request.get("model", {}), saved_tensors)
            if mismatches:
                raise ConfigError(f"  - --load {root}: iteration {iteration} holds another model than this run "
                                  f"builds:\n" + "\n".join(f"    {m}" for m in mismatches)
                                  + "\n    give the saving run's model flags, or --use-checkpoint-args to take "
                                    "them from the checkpoint")
            # Another optimizer kind reads the fp32 weights as its main params: the same tensor
            # twice, which the access-integrity check would refuse.
            state = load_checkpoint(request, directory, validate_access_integrity=not cross_kind)
        except ConfigError:  # the run's model or megatron-core, not the files: said as such
            raise
        except pickle.UnpicklingError as e:
            raise CheckpointReadError(
                f"{directory}: refused to load: it holds objects other than tensors and plain data "
                f"(checkpoints load with weights_only=True, so a crafted file cannot run code): "
                f"{str(e).splitlines()[0]}") from None
        except (CheckpointingException, CheckpointException, RuntimeError, OSError, EOFError, ValueError) as e:
            # what unreadable files raise (ours, megatron's, torch.distributed.checkpoint's, zip and
            # pickle's): name the checkpoint instead of a traceback
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise CheckpointReadError(f"{directory}: unreadable checkpoint (truncated or corrupt?): "
                                      f"{type(e).__name__}: {first}") from None
        for name in names:
            self.components[name].load_state_dict(state, ctx)
        if args.finetune or self.trainer is None:
            print_rank_0(f"--finetune: loaded the weights of iteration {iteration} from {directory}; starting at iteration 0")
            return 0
        if args.no_load_optim:  # Megatron's --no-load-optim: fresh Adam state, the new schedule from here on
            self.trainer.scheduler.step(increment=iteration)
        notes = []
        if "rng" in names and not RngState.same_grid(ctx):
            notes.append("RNG states start from --seed (saved at another PP×TP×DP×CP grid)")
        if cross_kind:
            notes.append(f"optimizer state converted from the {saved['optimizer_kind']} optimizer's")
        print_rank_0(f"loaded checkpoint of iteration {iteration} from {directory}"
                     + (f" ({'; '.join(notes)})" if notes else ""))
        return iteration


# Which flags decide the shape of a tensor, by the tensor's checkpoint key: a mismatch names them.
_SHAPE_FLAGS_BY_KEY = (
    ("position_embeddings", "--max-position-embeddings (default: --seq-length)"),
    ("word_embeddings", "--padded-vocab-size, --vocab-size or the tokenizer, --make-vocab-size-divisible-by"),
    ("output_layer", "--padded-vocab-size, --vocab-size or the tokenizer, --make-vocab-size-divisible-by"),
    ("router", "--num-experts, --hidden-size"),
    ("shared_experts", "--moe-shared-expert-intermediate-size, --hidden-size, --swiglu"),
    ("experts", "--num-experts, --moe-ffn-hidden-size, --hidden-size, --swiglu"),
    ("linear_fc", "--ffn-hidden-size, --hidden-size, --swiglu"),
    ("linear_qkv", "--num-attention-heads, --num-query-groups, --kv-channels, --hidden-size, --attention-output-gate"),
    ("self_attention.in_proj", "--linear-num-key-heads, --linear-num-value-heads, --linear-key-head-dim, "
                               "--linear-value-head-dim, --hidden-size"),
    ("self_attention.conv1d", "--linear-conv-kernel-dim, --linear-num-key-heads, --linear-num-value-heads, "
                              "--linear-key-head-dim, --linear-value-head-dim"),
    ("self_attention.out_proj", "--linear-num-value-heads, --linear-value-head-dim, --hidden-size"),
    ("self_attention.out_norm", "--linear-value-head-dim"),
    ("A_log", "--linear-num-value-heads"),
    ("dt_bias", "--linear-num-value-heads"),
    ("linear_q", "--num-attention-heads, --hidden-size, --q-lora-rank, --qk-head-dim, --qk-pos-emb-head-dim"),
    ("linear_kv", "--kv-lora-rank, --qk-head-dim, --v-head-dim, --num-attention-heads"),
    ("linear_proj", "--num-attention-heads, --kv-channels, --v-head-dim, --hidden-size"),
    ("layernorm", "--hidden-size, --kv-channels, --normalization"),
)


def shape_mismatches(model_request, saved_tensors):
    """Each model tensor whose global shape here differs from the checkpoint's: key, both shapes, the flags."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    out = {}
    for t in nested_values(model_request):
        if not isinstance(t, ShardedTensor) or t.key not in saved_tensors or t.key in out:
            continue
        here, there = tuple(t.global_shape), tuple(saved_tensors[t.key].global_shape)
        if here != there:
            flags = next((f for part, f in _SHAPE_FLAGS_BY_KEY if part in t.key), "the model flags")
            out[t.key] = f"{t.key}: {list(there)} in the checkpoint, {list(here)} here (set by {flags})"
    return list(out.values())


class CheckpointWriteError(RuntimeError):
    """A save that failed on some rank, raised on every rank: the message names the directory and the cause."""


def _agree_on_write(failure, root, iteration, staged):
    """Collective: every rank learns whether any rank's part of the save failed, and stops alike. The staging
    directory goes (it is what filled a full disk); the tracker still names the last complete checkpoint."""
    failures = [None] * dist.get_world_size()
    dist.all_gather_object(failures, None if failure is None else _cause(failure))
    failed = [(rank, text) for rank, text in enumerate(failures) if text is not None]
    if not failed:
        return
    free = shutil.disk_usage(root).free / 2**20  # before the staging directory goes: what the save met
    if dist.get_rank() == 0:
        shutil.rmtree(staged, ignore_errors=True)
    last = latest_iteration(root)
    rank, text = next(((r, t) for r, t in failed if "Errno" in t), failed[0])  # an OS error says the most
    raise CheckpointWriteError(
        f"--save {root}: the checkpoint of iteration {iteration} could not be written ({len(failed)} of "
        f"{len(failures)} ranks failed; rank {rank}: {text}; {free:.1f} MiB were free on its disk). The tracker "
        f"still names {'iteration ' + str(last) if last is not None else 'no checkpoint'}; free space on {root} "
        f"(or give --save another directory) and resume with --load")


def _cause(error):
    """One line for a failed save: torch's CheckpointException carries each rank's own error (the OS error,
    where there is one), and its text is their tracebacks."""
    if isinstance(error, CheckpointException) and error.failures:
        errors = [e[0] if isinstance(e, tuple) else e for e in error.failures.values()]  # (error, its frames)
        texts = [str(e).removeprefix("Worker failure: ") for e in errors]
        return next((t for t in texts if "Errno" in t), texts[0])[:300]
    return " ".join(f"{type(error).__name__}: {error}".split())[:300]


class CheckpointReadError(RuntimeError):
    """A checkpoint that cannot be read: the message names the directory and what failed."""
