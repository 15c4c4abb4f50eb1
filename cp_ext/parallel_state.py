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
from typing import Callable, List, Optional

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
    global _STATE
    _STATE = None
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
    `cp_ext.layout.context_parallel_positions` for the layout.
    """
    import torch

    from cp_ext.layout import context_parallel_positions

    if _STATE is None or _STATE.cp_size == 1:
        return torch.arange(seq_len, device=device)
    return context_parallel_positions(
        seq_len, ring_rank=get_ring_rank(), ring_size=get_ring_world_size(),
        ulysses_rank=get_ulysses_rank(), ulysses_size=get_ulysses_world_size(), layout=layout, device=device,
    )
