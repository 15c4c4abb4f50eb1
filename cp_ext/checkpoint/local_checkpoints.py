"""Non-persistent local checkpoints (``--non-persistent-ckpt-type local``), as Megatron-LM takes them:
nvidia-resiliency-ext's ``LocalCheckpointManager`` writes each rank's part to its node's
``--non-persistent-local-ckpt-dir`` (``<dir>/<rank>/iter_<N>_<rank>_local.pt``), and megatron-core's
``MCoreTensorAwareStateDict`` decides that part: with ``--non-persistent-local-ckpt-algo fully_parallel``
each replicated tensor is written by one rank of the DP×CP group and exchanged on load; with ``atomic``
every rank writes all it holds.

They are cheap (no shared file system, no global metadata) and local: they load only at the grid that
wrote them, and only where every rank still holds its part. A node lost with its disk takes its ranks'
parts with it; the manager then finds no complete local checkpoint, and the run resumes from the newest
persistent or global one, saying so (`LocalCheckpoints.newest`). The manager keeps the newest local
checkpoint only.
"""

from megatron.core import parallel_state
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedBase

from cp_ext.console import print_rank_0
from cp_ext.errors import ConfigError
from cp_ext.grid import Grid

META_KEY = "cp_ext_meta"  # meta.json's content, among a local checkpoint's plain values


def _dp_cp_group():
    return parallel_state.get_data_parallel_group(with_context_parallel=True)


class LocalCheckpoints:
    def __init__(self, args):
        from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager import LocalCheckpointManager

        self.args = args
        self.manager = LocalCheckpointManager(args.non_persistent_local_ckpt_dir)
        self.algo = args.non_persistent_local_ckpt_algo
        self._cached_distribution = None  # --ckpt-assume-constant-structure: the first save's, reused

    def save(self, state, iteration, is_async):
        """Hand the rank's part of ``state`` (a sharded state dict, meta.json's content under `META_KEY`) to
        the manager. Returns megatron's AsyncRequest where ``is_async``, else None once it is written."""
        from megatron.core.dist_checkpointing.tensor_aware_state_dict import MCoreTensorAwareStateDict

        cached = self._cached_distribution if self.args.ckpt_assume_constant_structure else None
        tensor_aware, distribution = MCoreTensorAwareStateDict.from_state_dict(
            state, algo=self.algo, parallelization_group=_dp_cp_group(), cached_metadata=cached)
        self._cached_distribution = distribution
        return self.manager.save(tensor_aware, iteration, is_async=is_async)

    def newest(self, newer_than):
        """The iteration of the newest local checkpoint that every rank holds, or -1 (collective). Where a
        rank holds a newer one that others lack, says that resume falls back past it."""
        latest = self.manager.find_latest()
        available = self.manager.globally_available_ids
        partial = sorted({i for ids in available for (i, _, _) in ids if i > latest})
        if partial:
            holders = {rank for ids in available for (i, rank, _) in ids if i == partial[-1]}
            lacking = sorted(set(range(len(available))) - holders)
            fallback = max(latest, newer_than)
            print_rank_0(f"--non-persistent-local-ckpt-dir: the local checkpoint of iteration {partial[-1]} is not "
                         f"held by every rank (ranks {_ranges(lacking)} lack their part: a lost node or disk?); "
                         f"resuming from {'iteration ' + str(fallback) if fallback >= 0 else 'scratch'} instead, "
                         f"the newest checkpoint that every rank can read")
        return latest

    def load(self):
        """Read this rank's part of the newest complete local checkpoint (after `newest`): its meta.json
        content, its tensors' metadata by key, and a reader for a sharded-state-dict request."""
        tensor_aware, _ = self.manager.load()
        meta = tensor_aware.common[META_KEY]
        here = Grid.from_args(self.args, world_size=len(self.manager.globally_available_ids)).as_meta()
        if {k: meta["grid"].get(k) for k in here} != here:
            raise ConfigError(f"  - --non-persistent-ckpt-type local: the local checkpoint of iteration "
                              f"{meta['iteration']} was written at the grid {meta['grid']}, and this run's is {here}; "
                              f"local checkpoints load only at the grid that wrote them. Resume at that grid, or "
                              f"move {self.args.non_persistent_local_ckpt_dir} aside to resume from the persistent "
                              f"checkpoint")
        saved_tensors = {t.key: t for t in nested_values(tensor_aware.sharded_state_dict)
                         if isinstance(t, ShardedBase)}

        def read(request, validate_access_integrity):
            return tensor_aware.to_state_dict(request, algo=self.algo, parallelization_group=_dp_cp_group(),
                                              validate_access_integrity=validate_access_integrity)

        return meta, saved_tensors, read


def _ranges(ranks):
    return ", ".join(str(r) for r in ranks) if len(ranks) <= 8 else f"{ranks[0]}..{ranks[-1]} ({len(ranks)})"
