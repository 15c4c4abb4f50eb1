"""Ulysses and ring sub-groups of megatron's context-parallel group.

This *extends* ``megatron.core.parallel_state``; it does not fork it. Call
``initialize_context_parallel(ulysses_size)`` after megatron's
``parallel_state.initialize_model_parallel(..., context_parallel_size=C, ...)``. For every
megatron CP group (rank list ``cp``, length C) it builds, with U = ulysses_size:

* Ulysses groups: U adjacent entries of the CP rank list, ``cp[i*U:(i+1)*U]`` (meant to sit
  inside a node; with TP > 1 the CP ranks are not adjacent globally, e.g. TP2 x CP4 gives
  the CP group [0, 2, 4, 6] and, for U = 2, the Ulysses groups [0, 2] and [4, 6]);
* ring groups: the C/U ranks with the same Ulysses rank, ``cp[j::U]`` ([0, 4], [2, 6]).

Megatron's own CP group stays the full group, so its DDP gradient reduction over DP x CP
and its expert folding are untouched. When a sub-group equals the whole CP group (U = 1
for the ring, U = C for Ulysses) megatron's CP group object is reused.
"""

from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch.distributed as dist


@dataclass
class _ContextParallelState:
    cp_size: int
    ulysses_size: int
    ulysses_group: dist.ProcessGroup
    ulysses_ranks: List[int]
    ring_group: dist.ProcessGroup
    ring_ranks: List[int]
    grid: Optional[tuple] = None  # what built the groups (`cp_ext.grid.Grid.initialize` keeps a match)


_STATE: Optional[_ContextParallelState] = None
# Dynamic CP's groups, built on demand by `initialize_dynamic_context_parallel`.
_DYNAMIC: Optional["_DynamicGroups"] = None
# What leaving the grid must also release: objects built on its groups that Python's garbage
# collector cannot free alone (`on_grid_destroy`).
_ON_DESTROY: List[Callable[[], None]] = []


def _new_group(ranks, cp_ranks, cp_group, desc, timeout):
    from megatron.core import parallel_state as mpu

    if list(ranks) == list(cp_ranks):
        return cp_group
    return mpu.create_group(ranks=list(ranks), timeout=timeout, group_desc=desc)


def initialize_context_parallel(ulysses_size: int = 1, timeout: Optional[timedelta] = None, grid: Optional[tuple] = None) -> None:
    """Build the Ulysses and ring sub-groups of every megatron CP group (collective, all ranks).

    ``timeout``: how long a collective on them may wait for a missing rank before it fails
    (pass megatron's ``distributed_timeout_minutes``; None: torch's default, 30 minutes for gloo).
    ``grid``: a key describing the whole grid, kept for `initialized_grid`."""
    global _STATE
    from megatron.core import parallel_state as mpu

    if _STATE is not None:
        raise RuntimeError("cp_ext context parallelism is already initialized; call destroy_context_parallel() first")
    if not mpu.model_parallel_is_initialized():
        raise RuntimeError("call megatron's parallel_state.initialize_model_parallel(...) before initialize_context_parallel()")
    cp_size = mpu.get_context_parallel_world_size()
    if ulysses_size < 1 or cp_size % ulysses_size != 0:
        raise ValueError(
            f"--ulysses-size ({ulysses_size}) must be >= 1 and divide --context-parallel-size ({cp_size}); "
            f"valid choices: {[u for u in range(1, cp_size + 1) if cp_size % u == 0]}"
        )
    my_cp_ranks = list(mpu.get_context_parallel_global_ranks())
    cp_group = mpu.get_context_parallel_group()

    # Every rank must create every group, in the same order: gather all CP rank lists.
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, tuple(my_cp_ranks))
    all_cp_groups = sorted(set(gathered))

    me = dist.get_rank()
    state = None
    u, n_ring = ulysses_size, cp_size // ulysses_size
    for cp in all_cp_groups:
        ulysses = [cp[i * u:(i + 1) * u] for i in range(n_ring)]
        rings = [cp[j::u] for j in range(u)]
        mine = list(cp) == my_cp_ranks
        u_groups = [_new_group(r, cp, cp_group if mine else None, "CP_ULYSSES", timeout) for r in ulysses]
        r_groups = [_new_group(r, cp, cp_group if mine else None, "CP_RING", timeout) for r in rings]
        if mine:
            ui = next(i for i, r in enumerate(ulysses) if me in r)
            ri = next(j for j, r in enumerate(rings) if me in r)
            state = _ContextParallelState(cp_size, u, u_groups[ui], list(ulysses[ui]), r_groups[ri], list(rings[ri]), grid)
    assert state is not None, f"rank {me} is in none of the CP groups {all_cp_groups}"
    _STATE = state


def initialized_grid():
    """The grid key `initialize_context_parallel` was given (None when not initialized)."""
    return None if _STATE is None else _STATE.grid


def destroy_context_parallel() -> None:
    """Forget the sub-groups (megatron's destroy_model_parallel / destroy_process_group frees them),
    and release what was built on them (`on_grid_destroy`)."""
    global _STATE, _DYNAMIC
    _STATE = _DYNAMIC = None
    while _ON_DESTROY:
        _ON_DESTROY.pop()()


def on_grid_destroy(release: Callable[[], None]) -> None:
    """Run ``release`` when this grid is left (`destroy_grid`, `destroy_context_parallel`): a trainer built on the grid drops
    what holds its groups, so their gloo threads end even if nobody called its ``shutdown``."""
    _ON_DESTROY.append(release)


def destroy_grid() -> None:
    """Leave this grid's process groups, cp_ext's and megatron's, and keep the world group, so the
    same ranks can initialize another grid (tests and tools that run many grids in one process).

    megatron's ``destroy_model_parallel`` only drops its references (it destroys just its gloo
    copies), so every group but the world is destroyed here too. A gloo group's threads (about 50
    per grid of 4 ranks, and they poll: 3 training steps took 3.7 s with none left over, 6.2 s
    after 7 grids) end only when the last reference goes, and a model megatron's DDP wrapped is
    never freed (its gradient hooks hold it from autograd's side, out of the garbage collector's
    reach). Trainers register their release (`on_grid_destroy`), so leaving a grid frees the models
    built on it even when nobody shut them down. A process that builds many trainers still does best
    to build them on one grid: `cp_ext.grid.Grid.initialize` keeps a grid that matches.
    """
    from megatron.core import parallel_state as mpu
    from torch.distributed import distributed_c10d as c10d

    import gc

    destroy_context_parallel()
    mpu.destroy_model_parallel()
    for group in list(c10d._world.pg_map):  # torch has no public list of the groups a process made
        if group is not c10d.GroupMember.WORLD:
            dist.destroy_process_group(group)
    gc.collect()  # the finished models' reference cycles hold the groups (`Trainer.shutdown`): end their threads now


def _state() -> _ContextParallelState:
    if _STATE is None:
        raise RuntimeError("cp_ext context parallelism is not initialized; call cp_ext.parallel_state.initialize_context_parallel()")
    return _STATE


def get_ulysses_group() -> dist.ProcessGroup:
    return _state().ulysses_group


def get_ulysses_global_ranks() -> List[int]:
    return list(_state().ulysses_ranks)


def get_ulysses_rank() -> int:
    s = _state()
    return s.ulysses_ranks.index(dist.get_rank())


def get_ulysses_world_size() -> int:
    return _state().ulysses_size


def get_ring_group() -> dist.ProcessGroup:
    return _state().ring_group


def get_ring_global_ranks() -> List[int]:
    return list(_state().ring_ranks)


def get_ring_rank() -> int:
    return _state().ring_ranks.index(dist.get_rank())


def get_ring_world_size() -> int:
    return len(_state().ring_ranks)


def get_context_parallel_positions(seq_len: int, layout: str = "zigzag", device=None):
    """Global positions of the tokens this rank holds of a ``seq_len`` sequence (CP=1: all).

    The one place the data loader, RoPE and the attention agree on who holds what; see
    `cp_ext.token_partition.context_parallel_positions` for the layout.
    """
    import torch

    from cp_ext.token_partition import context_parallel_positions

    if _STATE is None or _STATE.cp_size == 1:
        return torch.arange(seq_len, device=device)
    return context_parallel_positions(
        seq_len, ring_rank=get_ring_rank(), ring_size=get_ring_world_size(),
        ulysses_rank=get_ulysses_rank(), ulysses_size=get_ulysses_world_size(), layout=layout, device=device,
    )


@dataclass
class _DynamicGroups:
    sizes: Tuple[int, ...]
    rank: int  # this rank's index in its DP x CP rank list
    world: int  # DP x CP
    groups: Dict[Tuple[int, int], Optional[dist.ProcessGroup]]  # (first, size) -> group, this rank's blocks
    router_groups: Dict[Tuple[int, int], dist.ProcessGroup]  # (first, size) -> the block's ranks x TP


def initialize_dynamic_context_parallel(sizes: Sequence[int], timeout: Optional[timedelta] = None) -> None:
    """Dynamic CP's groups (collective, all ranks): for each size in ``sizes``, the aligned blocks of that
    many consecutive ranks of every DP x CP rank list, ``dp_cp[first:first + size]`` with ``first % size == 0``.

    megatron-core's rule (``create_hybrid_dp_cp_groups``, 0.16-0.19), which builds the powers of two from 2 to
    half the ranks; here any size that divides DP x CP (`cp_ext.data.dynamic_schedule.group_sizes`). A block
    that is the whole DP x CP list reuses megatron's DP x CP group, one that is a CP group megatron's CP
    group; size 1 needs none (no communication). Each block also gets the group of its ranks' TP ranks, the
    router's reduce group (megatron's ``tp_cp`` for a static CP group), reused the same way. Every rank
    creates every group, in one order."""
    global _DYNAMIC
    from megatron.core import parallel_state as mpu

    _state()
    mine = dist.get_process_group_ranks(mpu.get_data_parallel_group(with_context_parallel=True))
    if _DYNAMIC is not None and _DYNAMIC.sizes == tuple(sizes) and _DYNAMIC.world == len(mine):
        return
    reused = {  # megatron's groups a block's group may equal: (this rank's ranks, the group)
        "dp_cp": mpu.get_data_parallel_group(with_context_parallel=True),
        "cp": mpu.get_context_parallel_group(),
        "tp": mpu.get_tensor_model_parallel_group(),
        "tp_cp": mpu.get_tensor_and_context_parallel_group(),
        "tp_dp_cp": mpu.get_tensor_and_data_parallel_group(with_context_parallel=True),
    }
    ranks_of = {name: tuple(dist.get_process_group_ranks(group)) for name, group in reused.items()}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, ranks_of)  # in global rank order
    known = {}  # ranks -> the name of the megatron group with exactly those ranks (on its members)
    for entry in gathered:
        for name, ranks in entry.items():
            known.setdefault(ranks, name)
    tp_of = dict(enumerate(entry["tp"] for entry in gathered))

    def group(ranks, desc):  # the same decision on every rank: reuse, or every rank creates
        if ranks in known:
            return reused[known[ranks]] if dist.get_rank() in ranks else None
        return mpu.create_group(ranks=list(ranks), timeout=timeout, group_desc=desc)

    groups, router_groups, made = {}, {}, {}
    for ranks in sorted({entry["dp_cp"] for entry in gathered}):
        for size in sizes:
            for first in range(0, len(ranks), size):
                block = ranks[first:first + size]
                with_tp = tuple(sorted(r for b in block for r in tp_of[b]))
                if with_tp not in made:
                    made[with_tp] = group(with_tp, f"DYNAMIC_TP_DP_CP_GROUP_{size}")
                cp_group = None if size == 1 else group(block, f"DYNAMIC_DP_CP_GROUP_{size}")
                if ranks == tuple(mine) and dist.get_rank() in block:
                    groups[(first, size)], router_groups[(first, size)] = cp_group, made[with_tp]
    _DYNAMIC = _DynamicGroups(tuple(sizes), mine.index(dist.get_rank()), len(mine), groups, router_groups)


def _dynamic() -> _DynamicGroups:
    if _DYNAMIC is None:
        raise RuntimeError("dynamic CP's groups are not built; call initialize_dynamic_context_parallel(sizes)")
    return _DYNAMIC


def get_dynamic_group(first: int, size: int) -> Optional[dist.ProcessGroup]:
    """The group of the ``size`` DP x CP ranks from ``first`` this rank belongs to (None for size 1)."""
    state = _dynamic()
    if (first, size) not in state.groups:
        raise ValueError(f"rank {state.rank} of DP x CP is not in the block of {size} ranks from {first} "
                         f"(sizes built: {state.sizes})")
    return state.groups[(first, size)]


def get_dynamic_router_group(first: int, size: int) -> dist.ProcessGroup:
    """The block's ranks with their TP ranks: where megatron's router reduces its expert counts (its
    ``tp_cp`` group under static CP)."""
    get_dynamic_group(first, size)  # the same check
    return _dynamic().router_groups[(first, size)]


def get_dynamic_rank() -> int:
    """This rank's index among its DP x CP ranks (what dynamic CP's schedule places work on)."""
    return _dynamic().rank
