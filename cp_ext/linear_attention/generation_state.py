"""A linear-attention layer's generation cache: its state and its conv's last inputs, whatever the prompt's length.

A Gated DeltaNet layer (`cp_ext.transformer.gated_delta_net`) needs, to continue a sequence, the rule's state after
the last token (S [b, h_v, K, V], fp32, this TP rank's value heads) and the w - 1 inputs of the causal conv
before the next token ([b, w - 1, conv channels], this TP rank's channels). Both are the same on every CP rank:

* **Prefill** runs the prompt's prefix under CP as training does; the state passing already folds every segment's
  summary on every rank, and one more step of that fold is the state after the last token
  (`cp_ext.linear_attention.context_parallel_gated_delta`'s ``output_final_state``). The conv's tail is the
  prefix's last w - 1 pre-conv inputs, held by whichever ranks hold those positions: each rank writes the
  rows it holds into zeros, and a sum over the CP group (one owner per position: exact) gives every rank all of
  them (`conv_tail`).
* **Decode** needs no communication at all: each CP rank runs the new token through the conv window and one step
  of the rule, from the same state to the same state.

The softmax layers of the same model keep the CP-sharded KV cache (`cp_ext.inference.kv_cache`); this cache
lives beside it (`ShardedKVCache.linear`, by layer); the layers read and write it (`cp_ext.transformer.gated_delta_net`).
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist

from cp_ext.token_partition import context_parallel_positions


@dataclass
class LinearLayerState:
    state: torch.Tensor  # [b, h_v, K, V] fp32: the rule's state after the last token seen
    conv_tail: torch.Tensor  # [b, w - 1, channels]: the conv's inputs at the last w - 1 positions (zeros before 0)

    def bytes_held(self) -> int:
        return self.state.nbytes + self.conv_tail.nbytes


def conv_tail(inputs: torch.Tensor, taps: int, *, group=None, layout: str = "zigzag") -> torch.Tensor:
    """The last ``taps`` - 1 positions of a CP-sharded sequence's conv inputs ``inputs`` [b, s_local, channels]
    (this rank's tokens in ``layout`` over ``group``; None: the whole sequence), on every rank, zeros where the
    sequence is shorter."""
    b, s_local, channels = inputs.shape
    keep = taps - 1
    size = 1 if group is None else dist.get_world_size(group)
    total = s_local * size
    tail = inputs.new_zeros(b, keep, channels)
    if keep == 0:
        return tail
    if group is None:
        positions = torch.arange(total, device=inputs.device)
    else:
        positions = context_parallel_positions(total, ring_rank=dist.get_rank(group), ring_size=size, layout=layout,
                                               device=inputs.device)
    first = total - keep  # the tail's first position (negative: the sequence is shorter than the tail)
    mine = (positions >= first).nonzero()[:, 0]
    tail[:, positions[mine] - first] = inputs[:, mine]
    if group is not None:
        dist.all_reduce(tail, group=group)  # each position on exactly one rank, zeros elsewhere: an exact sum
    return tail
