"""megatron's alltoall MoE dispatcher on a CPU host over gloo: the three accommodations it needs.

Part of `cp_ext.platform` (which calls `install` from `setup_platform` on CPU only; GPU runs are
untouched). Each was found by running megatron-core 0.16.1's `MoEAlltoAllTokenDispatcher` on CPU:
it copies token counts to the host on a side CUDA stream and waits on an event, it hands tensor
split sizes to `all_to_all_single` where a GPU run has host arrays, and at expert-TP > 1 it gathers
and scatters unequal pieces, which gloo cannot. tests/training/test_grid_equivalence.py's alltoall
layouts check the result equals the allgather dispatcher's.
"""

import contextlib

import torch


def install(patch):
    """Apply the three, through `cp_ext.platform`'s ``patch(obj, name, value)`` (undone by its teardown)."""
    _cpu_streams(patch)
    _host_token_counts(patch)
    _gloo_uneven_gather_and_scatter(patch)


class _CpuStream:
    """The CPU's one stream: work runs in issue order, so waits and events have nothing to wait for.

    megatron's alltoall dispatcher copies its token counts to the host on a side stream and
    synchronizes on an event later (`_maybe_dtoh_and_synchronize`); every stream compares equal
    here, so it sees itself on the current stream and records nothing."""

    def __init__(self, *args, **kwargs):
        pass

    def __eq__(self, other):
        return isinstance(other, _CpuStream)

    def __hash__(self):
        return 0

    def wait_stream(self, stream):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return event if event is not None else _CpuEvent()

    def synchronize(self):
        pass

    def query(self):
        return True


class _CpuEvent:
    """An event of `_CpuStream`: always complete."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


def _cpu_streams(patch):
    patch(torch.cuda, "Stream", _CpuStream)
    patch(torch.cuda, "Event", _CpuEvent)
    patch(torch.cuda, "current_stream", lambda device=None: _CpuStream())
    patch(torch.cuda, "default_stream", lambda device=None: _CpuStream())
    patch(torch.cuda, "stream", lambda stream: contextlib.nullcontext())


def _host_token_counts(patch):
    """The alltoall dispatcher's split sizes as host arrays, as on GPU.

    `_maybe_dtoh_and_synchronize` moves the token counts to the host with `maybe_move_tensor_to_cpu`
    (``as_numpy=True`` for the all-to-all split sizes), which only moves CUDA tensors; a CPU
    tensor is returned as it is, and `all_to_all_single` then refuses tensor split sizes.
    Here, as on GPU, the host copy is made (a numpy array where asked for)."""
    from megatron.core.transformer.moe import token_dispatcher

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor) and as_numpy:
            return tensor.detach().numpy()
        return tensor

    patch(token_dispatcher, "maybe_move_tensor_to_cpu", maybe_move_tensor_to_cpu)


def _gloo_uneven_gather_and_scatter(patch):
    """Uneven all-gather and reduce-scatter along dim 0, which gloo lacks.

    megatron's alltoall dispatcher at expert-TP > 1 gathers the received tokens over TP with per-rank
    sizes (``output_split_sizes``) and reduce-scatters them back in the combine, through
    `torch.distributed.all_gather` / `reduce_scatter` on lists of unequal tensors; gloo's allgather
    refuses unequal sizes ("invalid tensor size") and it has no list reduce-scatter. Here each
    rank's piece is zero-padded to the largest one, sent with the equal-size collective, and cut
    back: the same values (padding is zeros and never read)."""
    from megatron.core.tensor_parallel import mappings

    gather, scatter = mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim

    def padded(piece, rows):
        return torch.cat([piece, piece.new_zeros(rows - piece.shape[0], *piece.shape[1:])]) if piece.shape[0] < rows else piece

    def _gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return gather(input_, group, output_split_sizes, use_global_buffer)
        rows = max(output_split_sizes)
        out = input_.new_empty(group.size() * rows, *input_.shape[1:])
        torch.distributed.all_gather_into_tensor(out, padded(input_.contiguous(), rows), group=group)
        return torch.cat([out[r * rows:r * rows + n] for r, n in enumerate(output_split_sizes)])

    def _reduce_scatter_along_first_dim(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return scatter(input_, group, input_split_sizes, use_global_buffer)
        rows = max(input_split_sizes)
        pieces = torch.split(input_, list(input_split_sizes), dim=0)
        stacked = torch.cat([padded(piece, rows) for piece in pieces])
        out = input_.new_empty(rows, *input_.shape[1:])
        torch.distributed.reduce_scatter_tensor(out, stacked, group=group)
        return out[:input_split_sizes[group.rank()]]

    patch(mappings, "_gather_along_first_dim", _gather_along_first_dim)
    patch(mappings, "_reduce_scatter_along_first_dim", _reduce_scatter_along_first_dim)
