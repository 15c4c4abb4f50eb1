"""Causal attention work per CP rank: zigzag vs contiguous sharding.

For each rank this replays the ring's own step schedule (`cp_ext.attention.ring.step_plan`,
the function the forward and backward loops run) and counts the (query, key) pairs each
step's kernel call computes: a causal diagonal tile of n rows counts n(n+1)/2, a full tile
rows x cols. So the numbers cannot drift from the code.

    python tools/attention_balance.py [--seq-len-per-chunk 1024]
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cp_ext.attention.ring import ALL, step_plan  # noqa: E402


def _rows(part, s):
    return s if part == ALL else s // 2


def tile_area(rank, size, s_local, layout, causal=True):
    """(q, k) pairs ring rank `rank` computes over one forward, local shard length s_local."""
    area = 0
    for step in range(size):
        plan = step_plan(rank, size, step, causal, layout)
        if plan is None:
            continue
        nq, nk = _rows(plan.q_part, s_local), _rows(plan.kv_part, s_local)
        area += nq * (nq + 1) // 2 if plan.causal else nq * nk
    return area


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
