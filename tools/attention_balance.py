"""Causal attention work per CP rank: zigzag vs contiguous sharding.

For each rank this builds the ring's own schedule (`cp_ext.attention.ring.RingSchedule`, what
the forward and backward loops run) and counts the (query, key) pairs each tile's kernel calls
compute (`cp_ext.attention.masks.Block.pairs`: a causal diagonal tile of n rows counts n(n+1)/2,
a full tile rows x cols). So the numbers cannot drift from the code.

    python tools/attention_balance.py [--seq-len-per-chunk 1024]
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cp_ext.attention.ring import RingSchedule  # noqa: E402


def tile_area(rank, size, s_local, layout, causal=True):
    """(q, k) pairs ring rank `rank` computes over one forward, local shard length s_local."""
    schedule = RingSchedule(rank, size, s_local, causal, layout)
    tiles = [schedule.tile(step) for step in range(schedule.num_steps)]
    return sum(blk.pairs() for tile in tiles if tile is not None for blk in tile[2])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len-per-chunk", type=int, default=1024, help="tokens per zigzag chunk (s = 2C x this)")
    args = p.parse_args(argv)
    worst = 0.0
    for size in (2, 4, 8):
        s = 2 * size * args.seq_len_per_chunk
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
    print(f"zigzag worst max/mean = {worst:.4f} ({'<=' if worst <= 1.05 else '>'} 1.05)")
    return 0 if worst <= 1.05 else 1


if __name__ == "__main__":
    sys.exit(main())
