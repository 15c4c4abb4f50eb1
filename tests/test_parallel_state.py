"""cp_ext.parallel_state on 8 gloo ranks against rank tables written out by hand.

Layouts: TP2 x CP4 (megatron order tp-cp-ep-dp-pp, so the CP groups are [0,2,4,6] and
[1,3,5,7]) with --ulysses-size 2, the same with EP2, and U = 1 / U = 4. One launch runs
them all (re-initializing megatron between them) and also runs `ring_attention` with
group=None on the cp_ext ring group against a float64 truth. Last, the Trainer's
`initialize_distributed`: a grid that matches the one in place keeps its groups, another one
replaces them and frees the old ones (no groups pile up across grids).
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.launch import launch, run_code, worker_args, write_results  # noqa: E402

NPROC = 8

# global rank -> (cp group, ulysses group, ring group, ulysses rank, ring rank, ring prev, ring next)
TP2_CP4_U2 = {
    0: ([0, 2, 4, 6], [0, 2], [0, 4], 0, 0, 4, 4),
    1: ([1, 3, 5, 7], [1, 3], [1, 5], 0, 0, 5, 5),
    2: ([0, 2, 4, 6], [0, 2], [2, 6], 1, 0, 6, 6),
    3: ([1, 3, 5, 7], [1, 3], [3, 7], 1, 0, 7, 7),
    4: ([0, 2, 4, 6], [4, 6], [0, 4], 0, 1, 0, 0),
    5: ([1, 3, 5, 7], [5, 7], [1, 5], 0, 1, 1, 1),
    6: ([0, 2, 4, 6], [4, 6], [2, 6], 1, 1, 2, 2),
    7: ([1, 3, 5, 7], [5, 7], [3, 7], 1, 1, 3, 3),
}
# With EP2 the CP layout is the same; megatron's expert groups (CP folded into expert-DP):
# global rank -> (expert-model-parallel group, expert-data-parallel group)
EP2_EXPERT = {
    0: ([0, 2], [0, 4]), 1: ([1, 3], [1, 5]), 2: ([0, 2], [2, 6]), 3: ([1, 3], [3, 7]),
    4: ([4, 6], [0, 4]), 5: ([5, 7], [1, 5]), 6: ([4, 6], [2, 6]), 7: ([5, 7], [3, 7]),
}
# U = 1: Ulysses groups are single ranks, the ring is the whole CP group.
TP2_CP4_U1 = {
    0: ([0], [0, 2, 4, 6], 0, 0, 6, 2), 2: ([2], [0, 2, 4, 6], 0, 1, 0, 4),
    4: ([4], [0, 2, 4, 6], 0, 2, 2, 6), 6: ([6], [0, 2, 4, 6], 0, 3, 4, 0),
    1: ([1], [1, 3, 5, 7], 0, 0, 7, 3), 3: ([3], [1, 3, 5, 7], 0, 1, 1, 5),
    5: ([5], [1, 3, 5, 7], 0, 2, 3, 7), 7: ([7], [1, 3, 5, 7], 0, 3, 5, 1),
}


def _snapshot():
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from cp_ext import parallel_state as ps
    from cp_ext.attention.cp.primitives import RingComm

    return dict(
        cp=list(mpu.get_context_parallel_global_ranks()),
        megatron_cp_group=dist.get_process_group_ranks(mpu.get_context_parallel_group()),
        dp_cp=dist.get_process_group_ranks(mpu.get_data_parallel_group(with_context_parallel=True)),
        ulysses=ps.get_ulysses_global_ranks(),
        ulysses_group=dist.get_process_group_ranks(ps.get_ulysses_group()),
        ring=ps.get_ring_global_ranks(),
        ring_group=dist.get_process_group_ranks(ps.get_ring_group()),
        ulysses_rank=ps.get_ulysses_rank(), ulysses_size=ps.get_ulysses_world_size(),
        ring_rank=ps.get_ring_rank(), ring_size=ps.get_ring_world_size(),
        ring_rank_in_group=dist.get_rank(ps.get_ring_group()),
        # the neighbours the ring's P2P exchange actually uses
        prev=RingComm(ps.get_ring_group()).recv_rank, next=RingComm(ps.get_ring_group()).send_rank,
        ring_is_megatron_cp=ps.get_ring_group() is mpu.get_context_parallel_group(),
    )


def _ring_attention_default_group():
    """ring_attention(group=None) uses the cp_ext ring group: compare with float64 truth."""
    import torch
    import torch.nn.functional as F

    from cp_ext import parallel_state as ps
    from cp_ext.attention import ring_attention
    from cp_ext.token_partition import zigzag_shard

    r, n = ps.get_ring_rank(), ps.get_ring_world_size()
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(24, 2, 4, 64, generator=g, dtype=torch.float64) for _ in range(3))
    truth = F.scaled_dot_product_attention(*(x.permute(1, 2, 0, 3) for x in (q, k, v)), is_causal=True).permute(2, 0, 1, 3)
    out = ring_attention(*(zigzag_shard(x, 0, r, n).float() for x in (q, k, v)), causal=True)
    return (out.double() - zigzag_shard(truth, 0, r, n)).abs().max().item()


def _grid_reuse():
    """initialize_distributed on grids A, A, B, A: the number of live groups and the CP group seen."""
    from types import SimpleNamespace

    import torch.distributed as dist
    from megatron.core import parallel_state as mpu
    from torch.distributed import distributed_c10d as c10d

    from cp_ext.platform import setup_platform
    from cp_ext.grid import initialize_distributed

    from cp_ext import parallel_state as ps

    setup_platform("cpu")
    ps.destroy_grid()  # the layouts above left megatron's groups alive (destroy_model_parallel keeps them)
    sizes = dict(pipeline_model_parallel_size=1, expert_model_parallel_size=1, expert_tensor_parallel_size=1,
                 distributed_timeout_minutes=10, seed=1)
    grid_a = SimpleNamespace(tensor_model_parallel_size=2, context_parallel_size=4, ulysses_size=2, **sizes)
    grid_b = SimpleNamespace(tensor_model_parallel_size=1, context_parallel_size=8, ulysses_size=4, **sizes)
    seen, groups = [], []
    for args in (grid_a, grid_a, grid_b, grid_a):
        initialize_distributed(args, None)
        seen.append(mpu.get_context_parallel_group())
        groups.append(len(c10d._world.pg_map))
    return {"group_counts": groups, "same_group_reused": seen[1] is seen[0],
            "cp_sizes": [dist.get_world_size(g) for g in seen], "regrid_new_group": seen[3] is not seen[0]}


def main():
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from cp_ext import parallel_state as ps

    args = worker_args()
    dist.init_process_group("gloo")
    res = {}
    for name, ep, u in [("u2", 1, 2), ("u2_ep2", 2, 2), ("u1", 1, 1), ("u4", 1, 4)]:
        mpu.initialize_model_parallel(tensor_model_parallel_size=2, context_parallel_size=4,
                                      expert_model_parallel_size=ep, create_gloo_process_groups=False)
        ps.initialize_context_parallel(ulysses_size=u)
        res[name] = _snapshot()
        if ep > 1:
            res[name]["ep"] = dist.get_process_group_ranks(mpu.get_expert_model_parallel_group())
            res[name]["edp"] = dist.get_process_group_ranks(mpu.get_expert_data_parallel_group())
        if name == "u2":
            res["ring_attention_err"] = _ring_attention_default_group()
            try:
                ps.initialize_context_parallel(ulysses_size=2)
            except RuntimeError as e:
                res["double_init_msg"] = str(e)
        ps.destroy_context_parallel()
        if name == "u2":
            try:
                ps.initialize_context_parallel(ulysses_size=3)
            except ValueError as e:
                res["bad_u_msg"] = str(e)
            try:
                ps.get_ring_group()
            except RuntimeError as e:
                res["uninit_msg"] = str(e)
        mpu.destroy_model_parallel()
    res["grid_reuse"] = _grid_reuse()
    write_results(args.results_dir, res)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def results():
    return launch(__file__, NPROC)


@pytest.mark.quick
@pytest.mark.parametrize("layout", ["u2", "u2_ep2"])
def test_tp2_cp4_ulysses2_layout(results, layout):
    for rank, res in results.items():
        got = res[layout]
        cp, uly, ring, urank, rrank, prev, nxt = TP2_CP4_U2[rank]
        assert (got["cp"], got["ulysses"], got["ring"]) == (cp, uly, ring), rank
        assert (got["ulysses_group"], got["ring_group"]) == (uly, ring), rank
        assert (got["ulysses_rank"], got["ring_rank"], got["ring_rank_in_group"]) == (urank, rrank, rrank), rank
        assert (got["ulysses_size"], got["ring_size"]) == (2, 2)
        assert (got["prev"], got["next"]) == (prev, nxt), rank
        # megatron's CP group stays the full group; DP x CP (DP = 1) is the CP group
        assert got["megatron_cp_group"] == cp and got["dp_cp"] == cp
        if layout == "u2_ep2":
            assert (got["ep"], got["edp"]) == EP2_EXPERT[rank], rank


def test_ulysses1_ring_is_the_whole_cp_group(results):
    for rank, res in results.items():
        got = res["u1"]
        uly, ring, urank, rrank, prev, nxt = TP2_CP4_U1[rank]
        assert (got["ulysses"], got["ring"], got["ulysses_rank"], got["ring_rank"]) == (uly, ring, urank, rrank)
        assert (got["prev"], got["next"]) == (prev, nxt), rank
        assert got["ring_is_megatron_cp"]


def test_ulysses4_is_the_whole_cp_group(results):
    for rank, res in results.items():
        got = res["u4"]
        assert got["ulysses"] == got["cp"] and got["ring"] == [rank] and got["ring_size"] == 1
        assert got["ulysses_rank"] == got["cp"].index(rank) and got["prev"] == got["next"] == rank


def test_ring_attention_uses_the_cp_ext_ring_group(results):
    for res in results.values():
        assert res["ring_attention_err"] < 1e-5


@pytest.mark.quick
def test_clear_errors(results):
    msg = results[0]["bad_u_msg"]
    assert "--ulysses-size (3)" in msg and "--context-parallel-size (4)" in msg
    assert "initialize_context_parallel" in results[0]["uninit_msg"]
    assert "already initialized" in results[0]["double_init_msg"]


def test_a_matching_grid_is_reused_and_another_replaces_it(results):
    """Trainers built one after another (tests, tools) share a matching grid's groups; a new grid
    frees the old groups, so their count (and the gloo threads behind them) does not grow."""
    for res in results.values():
        got = res["grid_reuse"]
        assert got["same_group_reused"] and got["regrid_new_group"]
        assert got["cp_sizes"] == [4, 4, 8, 4]
        a, again, b, back = got["group_counts"]
        assert again == a and back == a, got["group_counts"]


def test_leaving_a_grid_frees_the_trainers_built_on_it():
    """A trainer nobody shut down is freed when its grid is left (a test or tool building trainers
    on many grids): otherwise megatron's DDP hooks keep its model, and the model its gloo groups with
    their polling threads, for the life of the process (`cp_state.on_grid_destroy`)."""
    code = """
        import gc, weakref
        from cp_ext.arguments import parse_args, single_process_without_torchrun
        single_process_without_torchrun()
        from cp_ext.training.trainer import Trainer
        flags = ["--hidden-size", "16", "--num-attention-heads", "2", "--num-experts", "2", "--seq-length", "16",
                 "--global-batch-size", "1", "--train-iters", "2", "--num-layers", "1"]
        trainer = Trainer(parse_args(flags))
        trainer.train_step()
        first = weakref.ref(trainer.model[0])
        trainer = Trainer(parse_args(flags + ["--distributed-timeout-minutes", "3"]))  # another grid
        gc.collect()
        print("FIRST FREED", first() is None)
        print("SECOND TRAINS", trainer.train_step()["lm loss"] > 0)
    """
    out = run_code(code).stdout
    assert "FIRST FREED True" in out and "SECOND TRAINS True" in out, out


if __name__ == "__main__":
    main()
