"""Causal attention work per CP rank, zigzag vs contiguous sharding, counted on the ring's own schedule
(`RingSchedule`, what the forward and backward loops run): the pairs each tile's kernel calls compute
(`cp_ext.attention.masks.tiles.Block.pairs`), so the numbers cannot drift from the code.
``tools/attention_balance.py`` prints the table.
"""

from cp_ext.attention.cp.ring import RingSchedule

ZIGZAG_TARGET = 1.05  # the zigzag layout's worst rank may do at most this much more than the mean
RING_SIZES = (2, 4, 8)


def tile_area(rank, size, s_local, layout, causal=True):
    """(q, k) pairs ring rank `rank` computes over one forward, local shard length s_local."""
    schedule = RingSchedule(rank, size, s_local, causal, layout)
    tiles = [schedule.tile(step) for step in range(schedule.num_steps)]
    return sum(blk.pairs() for tile in tiles if tile is not None for blk in tile[2])


def print_balance(seq_len_per_chunk, sizes=RING_SIZES) -> int:
    """Print every rank's causal pairs under both layouts at each ring size, ``seq_len_per_chunk`` tokens
    per zigzag chunk (s = 2C x this). Returns the exit status: 0 when the zigzag's worst max/mean is
    within ``ZIGZAG_TARGET``, else 1."""
    worst = 0.0
    for size in sizes:
        s = 2 * size * seq_len_per_chunk
        s_local = s // size
        full = s * (s + 1) // 2
        print(f"C = {size}, s = {s} (causal: {full} (q,k) pairs in total)")
        for layout in ("contiguous", "zigzag"):
            areas = [tile_area(r, size, s_local, layout) for r in range(size)]
            assert sum(areas) == full, (layout, size, sum(areas), full)  # every pair exactly once
            ratio = max(areas) / (sum(areas) / size)
            if layout == "zigzag":
                worst = max(worst, ratio)
            print(f"  {layout:10s} per rank: {' '.join(f'{a:>11d}' for a in areas)}   max/mean = {ratio:.4f}")
    print(f"zigzag worst max/mean = {worst:.4f} ({'<=' if worst <= ZIGZAG_TARGET else '>'} {ZIGZAG_TARGET})")
    return 0 if worst <= ZIGZAG_TARGET else 1
