"""The bytes autograd holds for backward, live, and what an all-gather attention call holds while it runs.

    with track_saved_tensors(excluded_ptrs=param_ptrs, kept_bytes=lambda: KeptAttention.live_bytes) as saved:
        loss.backward()  # or a whole training step
    saved.peak, saved.peak_with_transient, saved.transient_peak

`track_saved_tensors` counts every storage autograd saves (`torch.autograd.graph.saved_tensors_hooks`)
from the moment it is saved until autograd drops it, and registers with `ALL_GATHER_CALLS`: the
all-gather attention (`cp_ext.attention.cp.all_gather`) marks its forward and backward with
``ALL_GATHER_CALLS.around``, so each call runs inside a scope of the tracker's while one is
registered (and calls straight through otherwise, as the counters of `cp_ext.perf.counter` do).
The layers above pass what they know that this one cannot import: the parameters' storages (not
activations) and the bytes CP-aware recompute keeps outside autograd (``kept_bytes``).
"""

import functools
import weakref
from contextlib import contextmanager

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class CallScope:
    """A scope entered around every call of the functions marked with `around`, opt-in: while none is
    registered (`entering`), a marked call tests one attribute and calls through."""

    def __init__(self):
        self.enter = None  # a function returning a context manager, entered around each marked call

    def around(self, fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            if self.enter is None:
                return fn(*args, **kwargs)
            with self.enter():
                return fn(*args, **kwargs)

        return call

    @contextmanager
    def entering(self, enter):
        """Enter ``enter()`` around every marked call while the block runs."""
        previous, self.enter = self.enter, enter
        try:
            yield
        finally:
            self.enter = previous


# The all-gather attention calls, forward and backward (autograd and CP-aware recompute paths alike):
# the gathered K/V and the full dK/dV live only inside a call, never saved for backward.
ALL_GATHER_CALLS = CallScope()


class _Held:
    """What the saved-tensor hook hands autograd: the tensor, plus a finalizer when autograd drops it."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor):
        self.tensor = tensor


class LiveSavedBytes:
    """Bytes of the unique storages autograd holds for backward right now, and their peak.

    Each saved tensor is counted while autograd keeps it (a tensor saved twice, or two views
    of one storage, count once); the storages in ``excluded_ptrs`` (the parameters' own) are not
    activations. ``kept_bytes()`` (the attention outputs kept by CP-aware recompute, held outside
    autograd) is added to every sample, so under full recompute the peak is the checkpointed layer
    inputs + kept outputs + the one layer being recomputed.

    ``peak`` is that (saved + kept) peak. ``peak_with_transient`` adds what an all-gather
    attention call holds while it runs (`AttentionTransient`: the gathered K/V, the full
    dK/dV): never saved for backward, so invisible to the hooks above, but it sits on top of
    the saved activations of the moment; 0 for the ring, Ulysses and hybrid.
    """

    def __init__(self, excluded_ptrs, kept_bytes=lambda: 0):
        self.excluded = excluded_ptrs
        self.kept_bytes = kept_bytes
        self.live = {}  # storage data_ptr when saved -> [nbytes then, references, the storage]
        self.peak = 0
        self.kept_at_peak = 0
        self.largest = {}  # storage data_ptr -> (nbytes, shape, dtype), every storage ever saved
        self.transient = None  # the AttentionTransient of the all-gather call running now, if any
        self.transient_peak = 0  # the most one call held
        self.peak_with_transient = 0
        self.transient_at_peak = 0

    def _release(self, ptr):
        entry = self.live[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            del self.live[ptr]

    @property
    def bytes(self):
        """The saved storages' bytes now. Read from each storage, not remembered from when it was saved:
        megatron's output-discarding checkpoint (``--recompute-modules mla_up_proj``, ``layernorm``,
        ``moe_act``) shrinks a saved storage to 0 bytes after the forward and refills it in the backward."""
        return sum(entry[2].nbytes() for entry in self.live.values())

    def sample(self):
        kept = self.kept_bytes()
        total = self.bytes + kept
        if total > self.peak:
            self.peak, self.kept_at_peak = total, kept
        extra = self.transient.live_bytes() if self.transient is not None else 0
        self.transient_peak = max(self.transient_peak, extra)
        if total + extra > self.peak_with_transient:
            self.peak_with_transient, self.transient_at_peak = total + extra, extra

    def pack(self, tensor):
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if not ptr or ptr in self.excluded:
            return tensor
        entry = self.live.get(ptr)
        if entry is None:
            entry = self.live[ptr] = [storage.nbytes(), 0, storage]
            self.largest.setdefault(ptr, (entry[0], tuple(tensor.shape), str(tensor.dtype).replace("torch.", "")))
        entry[1] += 1
        held = _Held(tensor)
        weakref.finalize(held, self._release, ptr)
        self.sample()
        return held

    @staticmethod
    def unpack(held):
        return held.tensor if isinstance(held, _Held) else held

    @contextmanager
    def all_gather_call(self):
        """One all-gather attention call, its allocations sampled as `transient` while it runs."""
        with AttentionTransient(self) as transient:
            self.transient = transient
            try:
                yield
            finally:
                self.transient = None


class AttentionTransient(TorchDispatchMode):
    """Every storage an op allocates inside one all-gather attention call, while it lives.

    A storage is new when an op returns it and none of the op's inputs holds it (views and
    in-place ops return their input's); it is live until its last tensor dies (a weak
    reference to the storage itself, so views keep it alive as they do in the allocator).
    What survives the call (its output, the LSE) is counted by the saved-tensor hooks
    afterwards, once the call has returned. After every op the sum joins `LiveSavedBytes`'s sample.
    """

    def __init__(self, saved):
        super().__init__()
        self.saved = saved
        self.storages = {}  # data_ptr -> (StorageWeakRef, nbytes)

    def live_bytes(self):
        self.storages = {p: (r, n) for p, (r, n) in self.storages.items() if not r.expired()}
        return sum(n for _, n in self.storages.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            known = self.storages.get(ptr)
            if ptr and ptr not in inputs and (known is None or known[0].expired()):
                self.storages[ptr] = (StorageWeakRef(storage), storage.nbytes())
        self.saved.sample()
        return out


@contextmanager
def track_saved_tensors(excluded_ptrs=frozenset(), kept_bytes=lambda: 0):
    """A `LiveSavedBytes` counting what autograd saves, and what every all-gather attention call
    holds, while the block runs."""
    saved = LiveSavedBytes(excluded_ptrs, kept_bytes)
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack), \
            ALL_GATHER_CALLS.entering(saved.all_gather_call):
        yield saved
