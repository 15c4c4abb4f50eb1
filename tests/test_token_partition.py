"""The CP layout contract (`cp_ext.token_partition`): zigzag_shard / zigzag_unshard / positions and the sequence-length errors."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.launch import launch, worker_args, write_results  # noqa: E402

from cp_ext.token_partition import check_seq_len, contiguous_shard, zigzag_chunk_ids, zigzag_positions, zigzag_shard


@pytest.mark.quick
def test_zigzag_layout_by_hand():
    x = torch.arange(16)  # C = 4: 8 chunks of 2
    assert zigzag_shard(x, 0, 0, 4).tolist() == [0, 1, 14, 15]
    assert zigzag_shard(x, 0, 1, 4).tolist() == [2, 3, 12, 13]
    assert zigzag_shard(x, 0, 3, 4).tolist() == [6, 7, 8, 9]
    assert [zigzag_chunk_ids(r, 4) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert zigzag_positions(16, 2, 4).tolist() == [4, 5, 10, 11]
    assert contiguous_shard(x, 0, 1, 4).tolist() == [4, 5, 6, 7]


@pytest.mark.parametrize("size", [1, 2, 3, 4, 8])
def test_shards_partition_the_sequence_along_any_dim(size):
    s = 2 * size * 5
    x = torch.randn(3, s, 2)
    shards = [zigzag_shard(x, 1, r, size) for r in range(size)]
    pos = torch.cat([zigzag_positions(s, r, size) for r in range(size)])
    assert sorted(pos.tolist()) == list(range(s))
    assert torch.equal(torch.cat(shards, 1), x[:, pos])


def test_ulysses_times_ring_layout_by_hand():
    from cp_ext.token_partition import context_parallel_positions as positions

    # C = 4 = U2 x R2, zigzag, 16 tokens: ring shards (0,3) and (1,2) of 4 chunks, split in 2
    got = [positions(16, ring_rank=r, ring_size=2, ulysses_rank=u, ulysses_size=2).tolist() for r in range(2) for u in range(2)]
    assert got == [[0, 1, 2, 3], [12, 13, 14, 15], [4, 5, 6, 7], [8, 9, 10, 11]]
    # pure Ulysses (R = 1) is contiguous blocks; pure ring (U = 1) is zigzag
    assert positions(8, ring_rank=0, ring_size=1, ulysses_rank=3, ulysses_size=4).tolist() == [6, 7]
    assert positions(8, ring_rank=1, ring_size=2).tolist() == [2, 3, 4, 5]


@pytest.mark.parametrize("u,r", [(1, 1), (1, 4), (2, 2), (4, 1), (2, 4), (4, 2)])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_ulysses_times_ring_positions_partition_the_sequence(u, r, layout):
    from cp_ext.token_partition import context_parallel_positions as positions

    s = 2 * u * r * 3
    held = [positions(s, ring_rank=i, ring_size=r, ulysses_rank=j, ulysses_size=u, layout=layout)
            for i in range(r) for j in range(u)]
    assert sorted(torch.cat(held).tolist()) == list(range(s))
    assert all(p.numel() == s // (u * r) for p in held)
    for i in range(r):  # a Ulysses group's pieces, in Ulysses-rank order, are its ring shard
        ring_shard = torch.cat(held[i * u:(i + 1) * u])
        expect = zigzag_positions(s, i, r) if layout == "zigzag" and r > 1 else torch.arange(i * s // r, (i + 1) * s // r)
        assert torch.equal(ring_shard, expect)


@pytest.mark.quick
@pytest.mark.parametrize("layout,s,size,needle", [("zigzag", 30, 4, "2 x C = 2 x 4 = 8"), ("contiguous", 30, 4, "C = 4")])
def test_indivisible_sequence_is_a_clear_error(layout, s, size, needle):
    with pytest.raises(ValueError) as e:
        check_seq_len(s, size, layout)
    msg = str(e.value)
    assert f"sequence length {s}" in msg and needle in msg and "pad" in msg and "32" in msg
    fn = zigzag_shard if layout == "zigzag" else contiguous_shard
    with pytest.raises(ValueError, match=f"sequence length {s}"):
        fn(torch.zeros(s), 0, 0, size)


@pytest.fixture(scope="module")
def unshard_results():
    return launch(__file__, 4)


def test_unshard_puts_the_sequence_back(unshard_results):
    for res in unshard_results.values():
        assert res["world"] and res["pair"]


if __name__ == "__main__":
    import torch.distributed as dist

    from cp_ext.token_partition import zigzag_unshard

    args = worker_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    pair = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    x = torch.randn(2, 40, 3, generator=torch.Generator().manual_seed(0))
    world = torch.equal(zigzag_unshard(zigzag_shard(x, 1, rank, 4), 1, None), x)
    prank = dist.get_rank(pair)
    pair_ok = torch.equal(zigzag_unshard(zigzag_shard(x, 1, prank, 2), 1, pair), x)
    write_results(args.results_dir, {"world": world, "pair": pair_ok})
    dist.destroy_process_group()
