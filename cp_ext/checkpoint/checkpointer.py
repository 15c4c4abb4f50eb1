"""Checkpoints: megatron-core's dist_checkpointing (``torch_dist``), one logical checkpoint that
loads at any grid, written atomically.

Why dist_checkpointing: every tensor is stored once under its global name (megatron's
``sharded_state_dict`` keys, the ones cp_ext's layout-invariant init already uses) with its
shard's place in the full tensor, so a checkpoint written at one TP×PP×CP×DP×EP layout, with or
without ``--use-distributed-optimizer``, loads at any other, in the layout and key names
Megatron-LM's loader expects. (megatron-core 0.16's writer processes call ``psutil``, not one of its
dependencies, outside their error handling; cp_ext depends on psutil.)

What each part of training saves is its own business (`cp_ext.checkpoint.state`); this module
decides what to save and load (Megatron's --no-load-optim, --no-load-rng, --finetune) and makes it
durable. The tensors are written by every rank in parallel, replicas spread over the DP×CP group
(megatron's fully parallel save, unless --no-ckpt-fully-parallel-save), so each rank writes about
1/(DP×CP) of them; with --async-save they are written in the background (`cp_ext.checkpoint.async_writes`)
and the checkpoint is published only once every rank's write has finished. Non-persistent checkpoints
(--non-persistent-save-interval) go to their own directory (``global``) or to node-local files
(``local``, `cp_ext.checkpoint.local_checkpoints`); --load resumes from the newest of all of them. The
directory, the tracker, meta.json and the atomic publish are `cp_ext.checkpoint.disk_format`'s; the
parse-time checks on --load/--save are `cp_ext.checkpoint.checks`'.
"""

import argparse
import functools
import pickle
import shutil

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.dict_utils import merge
from megatron.core.dist_checkpointing.strategies.fully_parallel import (
    FullyParallelLoadStrategyWrapper, FullyParallelSaveStrategyWrapper,
)
from megatron.core.dist_checkpointing.validation import StrictHandling

from cp_ext.checkpoint.async_writes import AsyncWrites, install_file_results
from cp_ext.checkpoint.disk_format import (
    META, TENSOR_INDEX, TRACKER, complete_iterations, iteration_dir,
    latest_iteration, non_persistent_dir, publish, read_meta, remove_older_iterations, staging_dir, write_meta,
)
from cp_ext.checkpoint.local_checkpoints import META_KEY as LOCAL_META, LocalCheckpoints
from cp_ext.checkpoint.common_state import checkpoint_meta, comparable_common_state
from cp_ext.checkpoint.failures import CheckpointReadError, CheckpointWriteError, agree_on_write
from cp_ext.checkpoint.shape_check import shape_mismatches
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
from cp_ext.errors import ConfigError
from cp_ext.megatron_compat import ASYNC_SAVE_KWARGS, load_checkpoint


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
        self._init_saving()

    @classmethod
    def for_weights(cls, model_chunk, args, model_args):
        """A checkpointer that loads a model's weights only, as --finetune does (generation, the tools
        that need a model, not a run): no optimizer, schedule, iteration or RNG state to restore."""
        self = cls.__new__(cls)
        self.trainer, self.args, self.model_args = None, args, model_args
        self.components = {"model": ModelState(model_chunk)}
        self._init_saving()
        return self

    def _init_saving(self):
        args = self.args
        self._save_strategy = None
        self._saved_here = set()  # (root, iteration) this run saved (rank 0): the only ones a save may replace
        self._writes = AsyncWrites() if getattr(args, "async_save", False) else None
        self._waited_for_write = False  # said once: a save was due while the previous one was still writing
        self.local = None
        if getattr(args, "non_persistent_ckpt_type", None) == "local":
            self.local = LocalCheckpoints(args)
        if self._writes is not None and getattr(args, "use_persistent_ckpt_worker", False):
            print_rank_0("note: --use-persistent-ckpt-worker: cp_ext's --async-save forks one writer per save "
                         "(megatron-core's TemporalAsyncCaller); the persistent worker is not used")
        if getattr(args, "ckpt_fully_parallel_save_deprecated", False):
            print_rank_0("note: --ckpt-fully-parallel-save is deprecated (as in Megatron-LM) and has no effect: "
                         "fully parallel save is the default; --no-ckpt-fully-parallel-save turns it off")

    def _context(self, **kw):
        return CheckpointContext(model_sharded=self.components["model"].chunk.sharded_state_dict(), **kw)

    def _strategy(self):
        """torch_dist. With --ckpt-fully-parallel-save (the default) replicas' writes are spread over DP×CP;
        with --ckpt-assume-constant-structure the plan and that distribution are computed once and reused
        (megatron's cached structure), as Megatron-LM builds them."""
        if self._save_strategy is None:
            constant = self.args.ckpt_assume_constant_structure
            strategy = dist_checkpointing.serialization.get_default_save_sharded_strategy()
            strategy.use_cached_ckpt_structure = constant
            if self.args.ckpt_fully_parallel_save:
                strategy = FullyParallelSaveStrategyWrapper(
                    strategy, parallel_state.get_data_parallel_group(with_context_parallel=True),
                    do_cache_distribution=constant)
            self._save_strategy = strategy
        return self._save_strategy

    def _plan_reused(self):
        """Whether the last save reused the cached plan (megatron validates the cache over two saves first)."""
        strategy = getattr(self._save_strategy, "base_strategy", self._save_strategy)
        return bool(getattr(strategy, "validated_cache_reuse", False))

    def meta(self, iteration):
        return checkpoint_meta(self.args, iteration, self.trainer.consumed_samples, len(self.trainer.dataset),
                               self.model_args)

    def _state(self):
        ctx = self._context()
        state = {}
        for component in self.components.values():
            state.update(component.state_dict(ctx))
        return state

    def save(self, root, wait=True, non_persistent=False):
        """Save every component at the trainer's iteration under ``root`` (collective).

        With --async-save and ``wait=False`` this returns once the tensors are handed to the background
        writer; the checkpoint is published (meta.json, then the tracker) by `poll` or `finish` once every
        rank's write has finished. A save still writing when this one is due is finished first. A rank that
        cannot write (a full disk, a quota, an I/O error) fails the save on every rank alike:
        `CheckpointWriteError`, naming the directory and the cause, with the staging directory removed and
        the tracker left where it was. ``non_persistent``: a --non-persistent-ckpt-type global checkpoint,
        which replaces the previous one."""
        iteration = self.trainer.iteration
        self._finish_previous(iteration)
        tmp = staging_dir(root, iteration)
        failure = None
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # debris of a save that was killed
            try:
                tmp.mkdir(parents=True)
            except OSError as e:
                failure = e
        agree_on_write(failure, root, iteration, tmp)
        state = self._state()
        install_file_results().target(tmp, dist.get_rank())
        request = None
        # As Megatron-LM: with --ckpt-assume-constant-structure the sharding is validated at the first save only
        validate = not (self.args.ckpt_assume_constant_structure and self._save_strategy is not None)
        try:
            request = dist_checkpointing.save(state, str(tmp), sharded_strategy=self._strategy(),
                                              validate_access_integrity=validate,
                                              preprocess_common_before_consistancy_check=comparable_common_state,
                                              content_metadata=CONTENT_METADATA,
                                              async_sharded_save=self._writes is not None, **ASYNC_SAVE_KWARGS)
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - every rank hears of it before any stops
            failure = e  # (torch's CheckpointException, what a failed write raises, is a BaseException)
        agree_on_write(failure, root, iteration, tmp)  # every rank's files are written (and fsynced)
        publish_here = functools.partial(self._publish, root, iteration, tmp, self.meta(iteration), non_persistent)
        if self._writes is None:
            publish_here()
        else:
            request.add_finalize_fn(publish_here)
            self._writes.schedule(request, iteration, (root, tmp))
            if wait:
                self.finish()

    def save_local(self):
        """A --non-persistent-ckpt-type local checkpoint of the trainer's iteration (collective): each rank's
        part into its node's --non-persistent-local-ckpt-dir (nvidia-resiliency-ext's local checkpoints)."""
        iteration = self.trainer.iteration
        self._finish_previous(iteration)
        state = self._state()
        state[LOCAL_META] = self.meta(iteration)
        request = self.local.save(state, iteration, is_async=self._writes is not None)
        if request is not None:
            request.add_finalize_fn(functools.partial(print_rank_0, f"saved non-persistent local checkpoint at "
                                                                     f"iteration {iteration}"))
            self._writes.schedule(request, iteration, None)
        else:
            print_rank_0(f"saved non-persistent local checkpoint at iteration {iteration}")

    def _publish(self, root, iteration, tmp, meta, non_persistent):
        """Every rank's tensor files are written: meta.json, the rename into place, the tracker (rank 0)."""
        failure = note = None
        if dist.get_rank() == 0:
            try:
                write_meta(tmp, meta)
                note = publish(tmp, root, iteration, replaceable=(str(root), iteration) in self._saved_here)
            except OSError as e:
                failure = e
        agree_on_write(failure, root, iteration, tmp)
        if dist.get_rank() == 0:
            if note:
                print_rank_0(note)
            self._saved_here.add((str(root), iteration))
            kind = "non-persistent checkpoint" if non_persistent else "checkpoint"
            print_rank_0(f"saved {kind} at iteration {iteration} to {iteration_dir(root, iteration)}"
                         + (" (save plan reused: --ckpt-assume-constant-structure)" if self._plan_reused() else ""))
            if non_persistent:  # Megatron-LM keeps the newest non-persistent checkpoint only
                remove_older_iterations(root, iteration)
        dist.barrier()

    def _finish_previous(self, iteration):
        if self._writes is None or self._writes.in_flight is None:
            return
        if not self._waited_for_write:
            self._waited_for_write = True
            print_rank_0(f"--async-save: the save of iteration {self._writes.in_flight[0]} was still being written "
                         f"when iteration {iteration}'s was due; waiting for it first (said once: a longer "
                         f"--save-interval or --non-persistent-save-interval avoids the wait)")
        self.finish()

    def poll(self):
        """Publish the background save if every rank's write has finished (collective; --async-save)."""
        if self._writes is not None:
            self._settle(self._writes.poll)

    def finish(self):
        """Wait for the background save and publish it (collective; --async-save)."""
        if self._writes is not None:
            self._settle(self._writes.finish)

    def _settle(self, step):
        in_flight = self._writes.in_flight
        try:
            step()
        except CheckpointWriteError:
            raise
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - megatron raises a failed write on every rank
            iteration, where = in_flight[0], in_flight[1]
            root, tmp = where if where else (self.args.non_persistent_local_ckpt_dir, None)
            agree_on_write(e, root, iteration, tmp)

    def abort(self):
        """The run is failing: stop the background writer (its staging directory stays debris)."""
        if self._writes is not None:
            self._writes.abort()

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
        """Restore the newest checkpoint (collective): the latest under ``root`` (--load), or a newer
        non-persistent one (Megatron-LM's choice: non-persistent wins a tie), saying which. With
        --ckpt-fallback, the newest persistent one that reads."""
        args = self.args
        persistent = latest_iteration(root)
        np_root = non_persistent_dir(args, root) if getattr(args, "non_persistent_ckpt_type", None) == "global" else None
        np_global = latest_iteration(np_root) if np_root is not None and np_root.exists() else None
        newest_other = max(-1 if persistent is None else persistent, -1 if np_global is None else np_global)
        local = self.local.newest(newer_than=newest_other) if self.local is not None else -1  # collective
        if local >= 0 and local >= newest_other:  # a tie goes to the non-persistent one, as in Megatron-LM
            return self._load_local(local, newest_other)
        if np_global is not None and np_global >= (-1 if persistent is None else persistent):
            print_rank_0(f"the non-persistent checkpoint of iteration {np_global} in {np_root} is the newest "
                         f"(persistent: {'none' if persistent is None else persistent}); loading it")
            root, persistent = np_root, np_global
        elif persistent is not None and max(local, -1 if np_global is None else np_global) >= 0:
            print_rank_0(f"the persistent checkpoint of iteration {persistent} is the newest (non-persistent: "
                         f"{max(local, -1 if np_global is None else np_global)}); loading it")
        if persistent is None:
            print_rank_0(f"--load {root}: no checkpoint there yet ({TRACKER} missing); starting from scratch")
            return 0
        candidates = [persistent] + [i for i in complete_iterations(root) if i < persistent]
        for n, candidate in enumerate(candidates):
            try:
                return self._load_iteration(root, candidate)
            except CheckpointReadError as e:
                if not args.ckpt_fallback or n + 1 == len(candidates):
                    hint = ("" if args.ckpt_fallback else
                            "; add --ckpt-fallback to load the newest earlier checkpoint that reads")
                    raise CheckpointReadError(f"{e}{hint}") from None
                print_rank_0(f"--ckpt-fallback: {e}; trying iteration {candidates[n + 1]}")

    def _load_iteration(self, root, iteration):
        directory = iteration_dir(root, iteration)
        meta_file = directory / META
        if not (directory / TENSOR_INDEX).exists() or not meta_file.exists():
            raise CheckpointReadError(f"{directory}: not a complete cp_ext torch_dist checkpoint "
                                      f"({TENSOR_INDEX if meta_file.exists() else META} missing)")
        torch.serialization.add_safe_globals([argparse.Namespace])  # Megatron-LM's `args` in common.pt
        try:
            saved_tensors = dist_checkpointing.load_tensors_metadata(str(directory))
            read = functools.partial(self._read_torch_dist, directory)
            return self._restore(f"--load {root}: iteration {iteration}", str(directory), read_meta(directory),
                                 saved_tensors, read)
        except (ConfigError, CheckpointReadError):  # the run's model or megatron-core, not the files: said as such
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

    def _read_torch_dist(self, directory, request, validate_access_integrity):
        """Read ``request`` from a torch_dist directory, as --ckpt-fully-parallel-load and
        --dist-ckpt-strictness say."""
        args, kwargs = self.args, {}
        if getattr(args, "ckpt_fully_parallel_load", False):
            kwargs["sharded_strategy"] = FullyParallelLoadStrategyWrapper(
                dist_checkpointing.serialization.get_default_load_sharded_strategy(str(directory)),
                parallel_state.get_data_parallel_group(with_context_parallel=True))
        strict = getattr(args, "dist_ckpt_strictness", "assume_ok_unexpected")
        try:
            state = load_checkpoint(request, directory, validate_access_integrity=validate_access_integrity,
                                    strict=strict, **kwargs)
        except CheckpointingException as e:
            if strict.startswith("raise") and "keys" in str(e):
                raise ConfigError(f"  - --dist-ckpt-strictness {strict}: {directory} and this run differ in "
                                  f"their tensors: {' '.join(str(e).split())[:600]}; a looser setting "
                                  f"(log_all, or Megatron-LM's default assume_ok_unexpected) loads what matches")
            raise
        if StrictHandling.requires_returning_mismatch_keys(StrictHandling(strict)):
            state, missing, unexpected = state
            print_rank_0(f"--dist-ckpt-strictness {strict}: {len(missing)} tensors of the checkpoint not read, "
                         f"{len(unexpected)} requested tensors not in it")
        return state

    def _load_local(self, iteration, newest_other):
        print_rank_0(f"the non-persistent local checkpoint of iteration {iteration} is the newest (persistent and "
                     f"global: {newest_other if newest_other >= 0 else 'none'}); loading it")
        saved, saved_tensors, read = self.local.load()
        return self._restore(f"--non-persistent-local-ckpt-dir: iteration {iteration}",
                             f"{self.args.non_persistent_local_ckpt_dir} (non-persistent, local)", saved,
                             saved_tensors, read)

    def _restore(self, what, where, saved, saved_tensors, read):
        """Put a checkpoint into the components. ``saved``: its meta.json; ``saved_tensors``: its tensors'
        metadata by key; ``read(request, validate_access_integrity)``: the requested state."""
        args, iteration = self.args, saved["iteration"]
        names = self._to_load()
        cross_kind = "optimizer" in names and saved["optimizer_kind"] != optimizer_kind(args)
        ctx = self._context(saved=saved, saved_keys=frozenset(saved_tensors))
        request = {}
        for name in names:
            merge(request, self.components[name].sharded_state_dict_for_load(ctx))
        mismatches = shape_mismatches(request.get("model", {}), saved_tensors)
        if mismatches:
            raise ConfigError(f"  - {what} holds another model than this run builds:\n"
                              + "\n".join(f"    {m}" for m in mismatches)
                              + "\n    give the saving run's model flags, or --use-checkpoint-args to take "
                                "them from the checkpoint")
        # Another optimizer kind reads the fp32 weights as its main params: the same tensor
        # twice, which the access-integrity check would refuse.
        state = read(request, not cross_kind)
        for name in names:
            self.components[name].load_state_dict(state, ctx)
        if args.finetune or self.trainer is None:
            print_rank_0(f"--finetune: loaded the weights of iteration {iteration} from {where}; starting at iteration 0")
            return 0
        if args.no_load_optim:  # Megatron's --no-load-optim: fresh Adam state, the new schedule from here on
            self.trainer.scheduler.step(increment=iteration)
        notes = []
        if "rng" in names and not RngState.same_grid(ctx):
            notes.append("RNG states start from --seed (saved at another PP×TP×DP×CP grid)")
        if cross_kind:
            notes.append(f"optimizer state converted from the {saved['optimizer_kind']} optimizer's")
        print_rank_0(f"loaded checkpoint of iteration {iteration} from {where}"
                     + (f" ({'; '.join(notes)})" if notes else ""))
        return iteration
