"""The bytes a run's torch.distributed calls send, recorded by wrapping the calls themselves.

`cp_ext.perf.counter` counts where cp_ext's attention code chooses to report; this records every call of
the collectives below while the block runs, whoever makes it, so a test or a benchmark can hold
`cp_ext.perf.comm`'s formulas against what really went out. A call made inside a wrapped call (torch's
``send`` posts an ``isend``, ``all_gather_into_tensor`` calls ``all_gather_single``) counts once.

Bytes sent by one rank, by collective (the ring implementation's count, as `cp_ext.perf.comm` uses):

    all_gather      (n-1) x the input          reduce_scatter  (n-1) x the output
    all_to_all      the input less the chunk kept (n-1)/n of it with equal splits)
    p2p             the tensor sent (send, isend; receives send nothing)
    all_reduce      2 (n-1)/n x the tensor

    with record_sent_bytes() as sent:
        out = op(...)
        forward = sent.take()      # {"all_gather": bytes, ...} since the last take
        out.backward(grad)
        backward = sent.take()

Only for measuring: it replaces module attributes of torch.distributed while the block runs (one
thread's calls counted; nesting is refused).
"""

import contextlib
import inspect
import threading
from collections import defaultdict
from typing import Dict

import torch.distributed as dist

_KINDS = {"all_gather_single": "all_gather", "all_gather_into_tensor": "all_gather", "all_gather": "all_gather",
          "reduce_scatter_single": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
          "all_to_all_single": "all_to_all", "send": "p2p", "isend": "p2p", "all_reduce": "all_reduce"}
_ACTIVE = threading.Lock()


def _size(group) -> int:
    return dist.get_world_size(group)


def _sent(name: str, call: inspect.BoundArguments) -> int:
    """Bytes this rank sends in the call ``name`` with bound arguments ``call``."""
    a = call.arguments
    group = a.get("group")
    if name in ("send", "isend"):
        return a["tensor"].nbytes
    n = _size(group)
    if name in ("all_gather_single", "all_gather_into_tensor"):
        return (n - 1) * a["input_tensor"].nbytes
    if name == "all_gather":
        return (n - 1) * a["tensor"].nbytes
    if name in ("reduce_scatter_single", "reduce_scatter_tensor"):
        return (n - 1) * a["output"].nbytes
    if name == "all_to_all_single":
        inp, splits = a["input"], a.get("input_split_sizes")
        if not splits:
            return inp.nbytes * (n - 1) // n
        row = inp.nbytes // max(inp.shape[0], 1)
        return (sum(splits) - splits[dist.get_rank(group)]) * row
    if name == "all_reduce":
        return 2 * (n - 1) * a["tensor"].nbytes // n
    raise KeyError(name)


class SentBytes:
    """What the recorded calls sent: bytes and calls by collective, since the last `take`."""

    def __init__(self):
        self.bytes: Dict[str, int] = defaultdict(int)
        self.calls: Dict[str, int] = defaultdict(int)

    def add(self, kind: str, nbytes: int) -> None:
        self.bytes[kind] += int(nbytes)
        self.calls[kind] += 1

    def take(self) -> Dict[str, int]:
        """{collective: bytes} since the last take (or the start), and start counting again."""
        out = dict(self.bytes)
        self.bytes.clear()
        self.calls.clear()
        return out


@contextlib.contextmanager
def record_sent_bytes():
    """Count the bytes this rank's torch.distributed calls send while the block runs (see the module)."""
    if not _ACTIVE.acquire(blocking=False):
        raise RuntimeError("record_sent_bytes is already recording")
    sent, depth, originals = SentBytes(), threading.local(), {}

    def wrap(name, original):
        signature = inspect.signature(original)

        def recorded(*args, **kwargs):
            outer = getattr(depth, "n", 0) == 0
            if outer:
                sent.add(_KINDS[name], _sent(name, signature.bind(*args, **kwargs)))
            depth.n = getattr(depth, "n", 0) + 1
            try:
                return original(*args, **kwargs)
            finally:
                depth.n -= 1

        return recorded

    try:
        for name in _KINDS:
            if hasattr(dist, name):
                originals[name] = getattr(dist, name)
                setattr(dist, name, wrap(name, originals[name]))
        yield sent
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
        _ACTIVE.release()
