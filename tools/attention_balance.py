"""Causal attention work per CP rank: zigzag vs contiguous sharding.

For each rank this builds the ring's own schedule (`cp_ext.attention.cp.ring.RingSchedule`, what
the forward and backward loops run) and counts the (query, key) pairs each tile's kernel calls
compute (`cp_ext.attention.masks.tiles.Block.pairs`: a causal diagonal tile of n rows counts n(n+1)/2,
a full tile rows x cols). So the numbers cannot drift from the code.

    python tools/attention_balance.py [--seq-len-per-chunk 1024]
"""

import argparse
import sys

from cp_ext.bench.attention_balance import print_balance


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len-per-chunk", type=int, default=1024, help="tokens per zigzag chunk (s = 2C x this)")
    args = p.parse_args(argv)
    return print_balance(args.seq_len_per_chunk)


if __name__ == "__main__":
    sys.exit(main())
