"""An opt-in counter of bytes sent per rank, fed by the communication call sites.

`cp_ext.attention.cp.primitives.RingComm.send_recv` reports ``"ring_p2p"`` (the bytes of the tensor
sent to the next rank) and the Ulysses all-to-all reports ``"ulysses_a2a"`` (the bytes that
leave the rank: (U-1)/U of the send buffer). Off by default: the call sites test one
attribute and do nothing else.

    with count_comm() as c:
        out = ring_attention(...)
    c.bytes["ring_p2p"], c.calls["ring_p2p"]
"""

from collections import defaultdict
from contextlib import contextmanager


class CommCounter:
    def __init__(self):
        self.enabled = False
        self.bytes = defaultdict(int)
        self.calls = defaultdict(int)

    def add(self, name: str, nbytes: int) -> None:
        self.bytes[name] += int(nbytes)
        self.calls[name] += 1

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()


COMM_COUNTER = CommCounter()

# The same counter for attention work: the ring reports ``"tiles"`` (steps that computed
# something) and ``"pairs"`` (query-key pairs computed; a causal square counts its triangle).
WORK_COUNTER = CommCounter()


@contextmanager
def count_work():
    """Count (from zero) the attention tiles and query-key pairs computed while the block runs."""
    WORK_COUNTER.reset()
    WORK_COUNTER.enabled = True
    try:
        yield WORK_COUNTER
    finally:
        WORK_COUNTER.enabled = False


@contextmanager
def count_comm():
    """Count (from zero) the bytes every call site sends while the block runs."""
    COMM_COUNTER.reset()
    COMM_COUNTER.enabled = True
    try:
        yield COMM_COUNTER
    finally:
        COMM_COUNTER.enabled = False
