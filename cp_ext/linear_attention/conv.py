"""The causal depthwise convolution in front of Gated DeltaNet's rule, and its halo across CP ranks.

Qwen3-Next (and megatron-core's GDN) run q, k, v through a depthwise causal conv of kernel w (4) with SiLU:
out_t = silu(bias + sum_{i<w} weight[:, w-1-i] * x_{t-i}), zeros before the sequence. Under CP each of a rank's
segments needs the w - 1 tokens before it in global order: `conv_halo` all-gathers the last min(w - 1, L)
tokens of every segment (L: the segment length) and assembles each halo from the tails of the segments
before it, so a segment shorter than w - 1 tokens takes its halo from several segments (several ranks).
The gather is differentiable: a halo token's gradient returns to the rank that owns the token.

Packed documents: a token reads only the tokens of its own document (`causal_conv1d`'s ``document_ids``),
so the halo carries the ids of its tokens (-1 before the sequence start, which no document matches when
ids are non-negative). The weight's gradient on a rank covers its own tokens only: CP ranks sum it, as
they do every parameter's (megatron's data-parallel x CP gradient reduction).
"""

from typing import NamedTuple, Optional

import torch

from cp_ext.linear_attention.segments import gather_in_sequence_order, group_size_rank, rank_segments, zeros_reading

ACTIVATIONS = {"silu": torch.nn.functional.silu, "swish": torch.nn.functional.silu, None: lambda x: x}


class Halo(NamedTuple):
    """The w - 1 tokens before each of this rank's segments, in local segment order."""

    x: torch.Tensor  # [b, segments, w - 1, d]; zeros before the sequence start
    document_ids: Optional[torch.Tensor]  # [b, segments, w - 1]; -1 before the sequence start (None without ids)


def _assemble(every: torch.Tensor, ids, width: int) -> torch.Tensor:
    """[b, len(ids), width, ...]: for each global segment j, the last ``width`` rows of (padding, tail_0, ..,
    tail_{j-1}); tails shorter than ``width`` are whole segments, so their concatenation is the sequence.
    The padding before the sequence start: zeros (tokens), -1 (document ids)."""
    tail = every.shape[2]
    need = -(-width // tail)  # how many segments back the halo can reach
    shape = every.shape[1:2] + (width,) + every.shape[3:]
    # zeros_reading: the backward reaches the gather on every rank, also where no halo reads another rank
    pad = zeros_reading(every, shape) if every.is_floating_point() else every.new_full(shape, -1)
    halos = [torch.cat([pad, *every[max(0, j - need):j]], dim=1)[:, -width:] for j in ids]
    return torch.stack(halos, dim=1)


def conv_halo(x: torch.Tensor, kernel_size: int, *, group, layout: str = "zigzag", document_ids=None) -> Halo:
    """The (kernel_size - 1) tokens that precede each of this rank's segments in global order.

    x: [b, s_local, d], this rank's tokens in ``layout`` over ``group``; ``document_ids`` [b, s_local] adds
    the halo tokens' ids. Every rank of ``group`` must call it (one all-gather, two with documents).
    """
    size, rank = group_size_rank(group)
    segments = rank_segments(x.shape[1], layout, rank, size)
    width = kernel_size - 1
    b, per = x.shape[0], len(segments.ids)
    if width == 0:
        ids = None if document_ids is None else document_ids.new_empty(b, per, 0)
        return Halo(x.new_empty(b, per, 0, x.shape[2]), ids)
    tail = min(width, segments.length)  # what each segment sends: a shorter segment sends all of itself

    def halos(t):  # [b, s_local, ...] -> [b, per, width, ...]
        tails = torch.stack([t[:, sl][:, -tail:] for sl in segments.slices()])  # [per, b, tail, ...]
        return _assemble(gather_in_sequence_order(tails, group, segments), segments.ids, width)

    return Halo(halos(x), None if document_ids is None else halos(document_ids))


def causal_conv1d(x_with_halo: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                  document_ids=None, activation: Optional[str] = "silu") -> torch.Tensor:
    """Depthwise causal conv of [b, w - 1 + s, d] (halo, then the s tokens): [b, s, d] in x's dtype.

    weight: [d, w] (or megatron's / nn.Conv1d's [d, 1, w]); weight[:, w - 1] multiplies the token itself, as
    ``F.conv1d(x, weight, padding=w - 1)[..., :s]`` does. ``document_ids`` [b, w - 1 + s] (the halo's ids,
    then the tokens'): a token reads only its own document. Sums in fp32 (fp64 for fp64 inputs). On one
    device the halo is w - 1 zeros (ids -1): `context_parallel_causal_conv1d` without torch.distributed.
    """
    d, w = x_with_halo.shape[-1], weight.shape[-1]
    weight = weight.reshape(d, w)
    s = x_with_halo.shape[1] - (w - 1)
    acc = torch.float64 if x_with_halo.dtype == torch.float64 else torch.float32
    xa, wa = x_with_halo.to(acc), weight.to(acc)
    out = torch.zeros_like(xa[:, w - 1:]) if bias is None else bias.to(acc).expand_as(xa[:, w - 1:])
    for j in range(w):  # a sum of w (4) shifted products: readable, and it masks per lag
        term = xa[:, j:j + s] * wa[:, j]
        if document_ids is not None:
            term = term * (document_ids[:, j:j + s] == document_ids[:, w - 1:]).unsqueeze(-1)
        out = out + term
    return ACTIVATIONS[activation](out).to(x_with_halo.dtype)


def context_parallel_causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                                   group, layout: str = "zigzag", document_ids=None,
                                   activation: Optional[str] = "silu") -> torch.Tensor:
    """`causal_conv1d` of this rank's shard ([b, s_local, d]) of a CP-sharded sequence: each segment with
    its `conv_halo`; equals the conv of the whole sequence at this rank's positions."""
    halo = conv_halo(x, weight.shape[-1], group=group, layout=layout, document_ids=document_ids)
    size, rank = group_size_rank(group)
    outs = []
    for i, sl in enumerate(rank_segments(x.shape[1], layout, rank, size).slices()):
        ids = None if document_ids is None else torch.cat([halo.document_ids[:, i], document_ids[:, sl]], dim=1)
        outs.append(causal_conv1d(torch.cat([halo.x[:, i], x[:, sl]], dim=1), weight, bias, document_ids=ids,
                                  activation=activation))
    return torch.cat(outs, dim=1)
